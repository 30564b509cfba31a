"""Test helpers shared by the packages' tests, the cross-package tests and the benchmarks: tiny HF
checkpoints any role can load, rewards that misbehave on purpose, a role killed mid-run, ranks spawned.

Why a package of its own: these helpers were shipped inside relax-core (`relax_testing`), so every
user's install carried code that only tests run. relax-testing is a dev-only workspace member (the root
`dev` group installs it), never a dependency of a shipped package. torch, transformers and ray are imported
inside the functions that need them.
"""

from __future__ import annotations

import contextlib
import random
import threading
from collections.abc import Callable
from typing import Any

PAD, EOS = "<|endoftext|>", "<|im_end|>"
# 64 tokens: the two specials, digits, '+', '=', and letters as filler so every model id decodes
VOCAB = [PAD, EOS, *"0123456789+=", *"abcdefghijklmnopqrstuvwxyz", *"ABCDEFGHIJKLMNOPQRSTUVWX"]


def build_tiny_checkpoint(path) -> str:
    """Write a ~40k-parameter Qwen3 model and a matching tokenizer to ``path``; returns the path."""
    import torch
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(VOCAB)}, unk_token=PAD))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS)
    hf_tok.save_pretrained(path)

    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=len(VOCAB),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=1,
        tie_word_embeddings=False,
        initializer_range=0.2,
    )
    Qwen3ForCausalLM(cfg).save_pretrained(path)
    return str(path)


def model_log_probs(model, prompt: list[int], tokens: list[int]) -> list[float]:
    """``tokens``' log-probs after ``prompt`` under an HF causal LM, from one forward: what an engine serving
    the same weights must report for them (temperature 1, no penalties)."""
    import torch

    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        lp = torch.log_softmax(model(ids).logits[0, len(prompt) - 1 : -1].float(), -1)
    return lp.gather(-1, torch.tensor(tokens)[:, None])[:, 0].tolist()


def parity_reward(response: str, label, metadata=None) -> float:
    """1 when the response has an even number of characters: on an untrained model's samples it splits
    most groups and leaves some all-equal, which is what a dynamic-sampling test needs. Importable in every
    Ray worker, unlike a function defined in a test file.

    >>> parity_reward("ab", "x")
    1.0
    """
    return float(len(response) % 2 == 0)


class BlockingFloat:
    """A reward's return whose ``__float__`` blocks for 60 s (converting it must be under the time-out)."""

    def __float__(self) -> float:
        import time

        time.sleep(60)
        return 1.0


def hostile_reward(response: str, label, metadata=None) -> float:
    """A reward as hostile user code can be, chosen by the label: ``inf`` / ``nan`` return that, ``huge``
    returns ``10**400`` (past float's range), ``blocking`` an object whose ``__float__`` blocks, ``raise``
    raises ValueError, ``hang`` sleeps 60 s, ``exit`` ends its own process (``os._exit``); any other label
    scores an exact match. Importable in every Ray worker and reward process."""
    import os
    import time

    if label == "inf":
        return float("inf")
    if label == "nan":
        return float("nan")
    if label == "huge":
        return 10**400
    if label == "blocking":
        return BlockingFloat()  # type: ignore[return-value]  # hostile on purpose: not a float
    if label == "raise":
        raise ValueError("hostile reward: raised on purpose")
    if label == "hang":
        time.sleep(60)
    if label == "exit":
        os._exit(3)
    return float(response.strip() == str(label))


def crashing_reward(response: str, label, metadata=None) -> float:
    """A reward that crashes its process (a segfault, as a broken C extension does): nothing can catch it in
    thread isolation; a test checks the death is reported naming this reward."""
    import ctypes

    ctypes.string_at(0)  # reads address 0: SIGSEGV
    return 0.0


def uneven_reward(response: str, label, metadata=None) -> float:
    """An exact match that takes 0.3 s when the label ends in an odd digit: a step's groups finish scoring
    at different times, so a streaming rollout is part-way through a step most of the time."""
    import time

    if str(label)[-1:] in "13579":
        time.sleep(0.3)
    return float(response.strip() == str(label))


JITTER = random.Random(0)
"""The random delays of :func:`jittered_reward` (seed it for a test's timings)."""


def jittered_reward(response: str, label, metadata=None) -> float:
    """An exact match that takes a random 0-50 ms (drawn from :data:`JITTER`): groups finish scoring in a
    random order, for tests of properties that must hold under any timing."""
    import time

    time.sleep(JITTER.uniform(0.0, 0.05))
    return float(response.strip() == str(label))


def tiny_moe(layers: int = 2, top_k: int = 2, seed: int = 0, **overrides):
    """A tiny random ``Qwen3MoeForCausalLM`` (vocab 300, 8 experts; ``overrides`` go to the config).
    ``initializer_range=0.1`` so the random router is not near-uniform and routing is meaningful."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        **{
            "vocab_size": 300,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": layers,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 8,
            "num_experts": 8,
            "num_experts_per_tok": top_k,
            "moe_intermediate_size": 32,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "norm_topk_prob": True,
            "initializer_range": 0.1,
            "pad_token_id": 0,
            "eos_token_id": 1,
            **overrides,
        }
    )
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(cfg)


def tiny_qwen3_config(**overrides) -> dict:
    """Keyword arguments of a tiny Qwen3 decoder: 2 layers, hidden 64, 4 query heads of 16 over 2 KV heads,
    FFN 96, vocabulary 300 (not a multiple of 128: megatron's vocab padding shows). ``overrides`` replace or
    add keys (tied embeddings, MoE sizes, rope, token ids). For ``Qwen3Config`` / ``Qwen3MoeConfig``, and the
    ``text_config`` of a tiny Qwen3-VL or :func:`tiny_omni_thinker_config`."""
    return {
        "vocab_size": 300,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        **overrides,
    }


def tiny_vision_config(**overrides) -> dict:
    """The ``vision_config`` of a tiny Qwen3-VL / Qwen3-Omni: two blocks of width 32, both feeding DeepStack,
    projected to :func:`tiny_qwen3_config`'s hidden size 64; ``overrides`` replace or add keys."""
    return {
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "out_hidden_size": 64,
        "deepstack_visual_indexes": [0, 1],
        "num_position_embeddings": 64,
        **overrides,
    }


def tiny_omni_thinker_config(text: dict | None = None, vision: dict | None = None, **overrides) -> dict:
    """Keyword arguments of a tiny Qwen3-Omni thinker (``Qwen3OmniMoeThinkerConfig``, or the whole model's
    ``thinker_config``): a one-layer audio encoder on the real 128 mel bins, :func:`tiny_vision_config`, and
    :func:`tiny_qwen3_config` as an MoE decoder (4 experts of 32, top 2; layer 1 dense). ``text`` and
    ``vision`` replace or add keys of those two; ``overrides``, top-level keys (token ids)."""
    return {
        "audio_config": {
            "num_mel_bins": 128,
            "encoder_layers": 1,
            "encoder_attention_heads": 2,
            "encoder_ffn_dim": 64,
            "d_model": 32,
            "downsample_hidden_size": 16,
            "output_dim": 64,
        },
        "vision_config": tiny_vision_config(**(vision or {})),
        "text_config": tiny_qwen3_config(
            **{
                "moe_intermediate_size": 32,
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "mlp_only_layers": [1],
                **(text or {}),
            }
        ),
        **overrides,
    }


def experts_used(trainer, data: dict):
    """Per sample, the experts a TorchBackend's forwards routed its first len − 1 tokens to ([T, layers, k]),
    and the log-probs of that pass: what R3 tests and ``benchmarks/r3.py`` compare with the rollout's."""
    with trainer.routing.record() as rec:
        logp = trainer.compute_log_probs(data)
    n, mbs = len(data["tokens"]), trainer.cfg.train.micro_batch_size
    out: list[Any] = []
    for f in range(len(rec.forwards)):
        idx = range(f * mbs, min(n, (f + 1) * mbs))
        width = max(len(data["tokens"][i]) for i in idx)
        stacked = rec.stacked(f)
        fw = stacked.view(len(idx), width, *stacked.shape[1:]).numpy()
        out.extend(fw[row, : len(data["tokens"][i]) - 1] for row, i in enumerate(idx))
    return out, logp


@contextlib.contextmanager
def json_webhook():
    """A local HTTP endpoint on 127.0.0.1 for notification tests: yields (``json://`` base URL, list of
    received (path, JSON body)); Apprise's ``json://`` URLs POST there."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    received: list[tuple[str, dict]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            received.append((self.path, json.loads(body)))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"json://127.0.0.1:{server.server_address[1]}", received
    finally:
        server.shutdown()
        server.server_close()


def dead_json_url() -> str:
    """A ``json://`` URL on a port nobody listens to."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"json://127.0.0.1:{s.getsockname()[1]}/nobody"


def signal_role_after(
    controller, trained_steps: int, role: str, sig: int | None = None, then: Callable[[], bool] | None = None
) -> dict:
    """Fault injection for a running fully-async :class:`~relax_core.controller.Controller`: once
    ``trained_steps`` steps are in its metrics.jsonl (and then, if given, once ``then()`` is true: polled
    every millisecond with the process already found, to hit a short window such as a checkpoint being
    written), send ``sig`` (default SIGKILL) to the process of ``role`` ("actor", "rollout", "actor_fwd",
    ... "engine": the rollout role's first engine process, or "bus": the bus controller actor, killed
    through Ray).
    Runs on a daemon thread; the returned dict gets ``pid``, ``at`` (time.time() of the signal) and, for
    an engine, its ``engine`` id."""
    import os
    import signal
    import threading
    import time
    from pathlib import Path

    metrics = Path(controller.cfg.run.output_dir) / "metrics.jsonl"
    out: dict = {}

    def watch() -> None:
        import ray

        while True:
            lines = metrics.read_text().splitlines() if metrics.exists() else []
            if sum('"train/loss"' in line for line in lines) >= trained_steps:
                break
            time.sleep(0.01)
        if role == "bus":  # the bus controller actor: its state is the run's data
            ray.kill(controller.async_run.bus.link.controller, no_restart=True)
            out["pid"], out["at"] = "bus", time.time()
            return
        if role == "engine":
            rollout = controller.async_run.roles["rollout"]
            pids = ray.get(rollout.__ray_call__.remote(lambda w: w.engine_service.pids()))
            out["engine"], pid = sorted(pids.items())[0]
        else:
            pid = ray.get(controller.async_run.roles[role].heartbeat.remote())["pid"]
        if pid == os.getpid():
            raise RuntimeError(f"{role} runs in this process; refusing to signal it")
        while then is not None and not then():
            time.sleep(0.001)
        os.kill(pid, signal.SIGKILL if sig is None else sig)
        out["pid"], out["at"] = pid, time.time()

    out["thread"] = threading.Thread(target=watch, name=f"signal-{role}", daemon=True)
    out["thread"].start()
    return out


def spawn_ranks(argv: list[str], world: int, capture: bool = False, **env: str) -> list:
    """Start ``argv`` once per rank of a ``world``-rank group on this machine, as ``torchrun`` would:
    RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR (127.0.0.1) and MASTER_PORT (a free port) set on top of this
    process's environment and ``env``. ``capture``: stderr piped, as text. Returns the ``Popen`` objects."""
    import os
    import socket
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pipes: dict[str, Any] = {"stderr": subprocess.PIPE, "text": True} if capture else {}
    return [
        subprocess.Popen(
            argv,
            env={
                **os.environ,
                **env,
                "RANK": str(rank),
                "WORLD_SIZE": str(world),
                "LOCAL_RANK": str(rank),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
            },
            **pipes,
        )
        for rank in range(world)
    ]


def single_thread_torch() -> None:
    """One torch thread, where torch is installed: multi-threaded torch is orders of magnitude slower on a
    busy 2-core machine (the autouse fixture of the packages' conftests)."""
    try:
        import torch
    except ImportError:
        return
    torch.set_num_threads(1)


class SlowEngine:
    """Wraps a rollout engine (a ``TorchEngine``): sleeps ``delay`` seconds before every decode step
    (abortable: it honours the server's ``on_step`` hook), so requests stay in flight long enough to kill,
    drain or scale in their server, and records in ``versions`` the weight version of every batch it
    generates."""

    def __init__(self, engine, delay: float = 0.0):
        self.engine, self.delay = engine, delay
        self.versions: list[int] = []

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    def update_weights(self, tensors, version):
        self.engine.update_weights(tensors, version)

    def weights_checksum(self) -> str:
        return self.engine.weights_checksum()

    def generate(self, prompts, params, on_step=None):
        import time

        self.versions.append(self.engine.weight_version)

        def hook(t):
            time.sleep(self.delay)
            return on_step(t) if on_step is not None else set()

        return self.engine.generate(prompts, params, on_step=hook)


def after_trained_steps(metrics, trained_steps: int, fire: Callable[[], object]) -> threading.Thread:
    """``fire()`` (e.g. SIGTERM to this process) from a daemon thread once ``trained_steps`` training steps
    are in the run's ``metrics`` file (a metrics.jsonl path): a stop that lands mid-run."""
    import time
    from pathlib import Path

    def watch() -> None:
        while True:
            path = Path(metrics)
            lines = path.read_text().splitlines() if path.exists() else []
            if sum('"train/loss"' in line for line in lines) >= trained_steps:
                fire()
                return
            time.sleep(0.01)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


def wait_until(cond, timeout: float = 10.0, what: str = "condition", interval: float = 0.01) -> None:
    """Poll ``cond()`` until it is true; an AssertionError naming ``what`` after ``timeout`` seconds."""
    import time

    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(interval)


class BackgroundCall:
    """What :func:`in_background` returns: calling it (``timeout=60.0``) joins the thread and returns what
    ``fn`` returned or re-raises what it raised; ``thread`` is the thread."""

    def __init__(self, fn: Callable[..., Any], thread: threading.Thread, box: dict[str, Any]) -> None:
        self.fn, self.thread, self._box = fn, thread, box

    def __call__(self, timeout: float = 60.0) -> Any:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"{getattr(self.fn, '__name__', self.fn)} did not return"
        if "err" in self._box:
            raise self._box["err"]
        return self._box["out"]


def in_background(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> BackgroundCall:
    """Call ``fn`` on a daemon thread; the returned :class:`BackgroundCall` gives its result."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["out"] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - re-raised by the BackgroundCall
            box["err"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return BackgroundCall(fn, t, box)
