"""A checkpoint's ``model/`` serves: the trainer's checkpoint writer puts the tokenizer (with its chat template)
and the generation config beside the weights, and ``python -m relax_rollout.server --model <ckpt>/model``
answers a chat completion through the official ``openai`` client; a model directory without a tokenizer is
refused at start-up in one line naming it and the files missing (it used to start, ``/tokenize`` answering
``[]`` and chat a 500)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@pytest.fixture(scope="module")
def saved_model(tiny_run_inputs, tmp_path_factory) -> Path:
    """``<checkpoint>/model`` as the torch backend's checkpoint writer leaves it after a training step."""
    import numpy as np

    from relax_core.config import RelaxConfig
    from relax_train.backends.torch_backend import TorchBackend

    cfg = RelaxConfig.model_validate(
        {"train": {"micro_batch_size": 2}, "rollout": {"n_samples_per_prompt": 2}}
    )
    backend = TorchBackend(cfg, tiny_run_inputs.model_path)
    seqs = [([5, 6, 7], [8, 9]), ([5, 7], [6, 8])]
    samples = {
        "tokens": [np.asarray(p + r, dtype=np.int64) for p, r in seqs],
        "prompt_len": [len(p) for p, _ in seqs],
        "loss_mask": [np.ones(len(r), dtype=np.float32) for _, r in seqs],
        "advantages": [np.full(len(r), a, dtype=np.float32) for (_, r), a in zip(seqs, (1.0, -1.0))],
    }
    samples["rollout_log_probs"] = backend.compute_log_probs(samples)
    backend.train_step(samples)  # (the weights saved are the trained ones, not the source's)
    ckpt = tmp_path_factory.mktemp("ckpt") / "step_1"
    backend.save_checkpoint(ckpt)
    return ckpt / "model"


def _server(model_dir: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "relax_rollout.server", "--model", str(model_dir), "--port", "0"]
    return subprocess.Popen(
        [*cmd, "--torch-threads", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def test_the_checkpoint_writer_saves_what_serving_needs(saved_model, tiny_run_inputs):
    source = Path(tiny_run_inputs.model_path)
    for name in (*TOKENIZER_FILES, "generation_config.json", "config.json", "model.safetensors"):
        assert (saved_model / name).is_file(), name
    assert (saved_model / "tokenizer.json").read_bytes() == (source / "tokenizer.json").read_bytes()
    template = json.loads((saved_model / "tokenizer_config.json").read_text()).get("chat_template")
    assert template or (saved_model / "chat_template.jinja").is_file()
    generation = json.loads((saved_model / "generation_config.json").read_text())
    assert generation["eos_token_id"] == json.loads((source / "config.json").read_text())["eos_token_id"]


def test_a_saved_checkpoint_serves_chat(saved_model):
    proc = _server(saved_model)
    try:
        deadline = time.monotonic() + 120
        url = None
        while url is None:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, f"the server exited: {proc.stderr.read()}"
            if "listening on" in line:
                url = line.strip().rsplit(" ", 1)[-1]
            assert time.monotonic() < deadline, "the server did not start"
        with urllib.request.urlopen(url + "/health", timeout=30) as r:
            assert r.status == 200
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        reply = client.chat.completions.create(
            model=str(saved_model),
            messages=[{"role": "user", "content": "3+4="}],
            max_tokens=4,
            temperature=0,
        )
        choice = reply.choices[0]
        assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
        assert reply.usage.prompt_tokens > 0 and 1 <= reply.usage.completion_tokens <= 4
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_model_directory_without_a_tokenizer_is_refused_at_start(saved_model, tmp_path):
    bare = tmp_path / "bare"
    shutil.copytree(saved_model, bare)
    for name in bare.iterdir():
        if name.name.startswith(("tokenizer", "special_tokens", "chat_template", "vocab", "merges")):
            name.unlink()
    proc = _server(bare)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "listening" not in out
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert str(bare) in lines[0] and "no tokenizer" in lines[0]
    assert all(name in lines[0] for name in TOKENIZER_FILES) and "copy the tokenizer files" in lines[0]
