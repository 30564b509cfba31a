"""Fixtures for the agent-trajectory tests: a tiny Qwen3 with a chat template, in-process servers, and an
engine that replies with scripted texts (so agent loops and canonical tokens are deterministic)."""

import threading

import pytest


@pytest.fixture(scope="session")
def chat_model_dir(tmp_path_factory) -> str:
    """A tiny Qwen3 and the demo's byte-level BPE tokenizer with a Qwen-style chat template."""
    import torch

    tokenizer = pytest.importorskip("relax_app.demo.tokenizer")
    model = pytest.importorskip("relax_app.demo.model")
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("chat_qwen3")
    corpus = [f"{a}+{b}={a + b}" for a in range(30) for b in range(0, 30, 3)] + [
        "What is 17+25? Use the calculator. calc: 17*2 result: 42 error: The answer is",
        "Solve the problem. To compute, write calc: <expression> and wait for the result. Now double it.",
    ]
    tok = tokenizer.train_tokenizer(corpus, out)
    model.build_tiny_qwen3(tok, out_dir=out, **model.SMALLEST, max_position_embeddings=1024)
    return str(out)


TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<think>", "</think>"]


@pytest.fixture(scope="session")
def tool_model_dir(tmp_path_factory) -> str:
    """A tool-capable tiny Qwen3: the demo's byte-level BPE tokenizer and Qwen-style chat template, with
    ``<tool_call>``, ``</tool_call>``, ``<think>`` and ``</think>`` as added special tokens: each one token,
    as in a real Qwen3 checkpoint, and dropped from the shown text (the server parses the raw decode)."""
    import torch

    tokenizer = pytest.importorskip("relax_app.demo.tokenizer")
    model = pytest.importorskip("relax_app.demo.model")
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("tool_qwen3")
    corpus = [
        '{"name": "add", "arguments": {"a": 1, "b": 2}} {"city": "Oslo", "answer": 3, "ok": true}',
        "What is 1+2? Use the tools. The weather in Paris is sunny. The answer is",
    ] * 4
    tok = tokenizer.train_tokenizer(corpus)
    tok.add_tokens(TOOL_TOKENS, special_tokens=True)
    model.build_tiny_qwen3(tok, out_dir=out, **model.SMALLEST, max_position_embeddings=1024)
    return str(out)


@pytest.fixture(scope="module")
def serve():
    """``serve(engine, tokenizer, token=None, max_context=None) -> base URL``: an in-process server (no
    start-up cost), shut down with the module."""
    from relax_rollout.server import EngineServer, make_server
    from relax_rollout.server.trajectories import TrajectoryRecorder

    started = []

    def start(engine, tokenizer, token=None, max_context=None):
        state = EngineServer(engine, tokenizer, token=token)
        if max_context is not None:
            state.recorder = TrajectoryRecorder(tokenizer, max_context=max_context)
        httpd = make_server(state, "127.0.0.1", 0)
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        started.append(httpd)
        return f"http://127.0.0.1:{httpd.server_address[1]}"

    yield start
    for httpd in started:
        httpd.shutdown()
        httpd.server_close()


class ScriptedEngine:
    """Replies with scripted texts, tokenised canonically and ended with EOS (cut at max_new_tokens), with
    the tiny model's own log-probs of those tokens at the request's temperature: the recorded trajectory is
    trainable like a sampled one, and its log-probs must line up with the trainer's position by position."""

    def __init__(self, model_dir: str, replies=()):
        from transformers import AutoTokenizer

        from relax_core.models import load_model

        self.model = load_model(model_dir, "float32").eval()
        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.replies, self.weight_version, self._lock = list(replies), 0, threading.Lock()

    def generate(self, prompts, params):
        import torch

        from relax_rollout.engines.base import GenerateOutput

        outs = []
        for p in prompts:
            with self._lock:
                text = self.replies.pop(0) if self.replies else "ok"
            ids = (self.tok.encode(text, add_special_tokens=False) + [self.tok.eos_token_id])[
                : params.max_new_tokens
            ]
            with torch.no_grad():
                logits = self.model(input_ids=torch.tensor([p + ids])).logits[0, len(p) - 1 : -1].float()
            lp = torch.log_softmax(logits / params.temperature, -1)[torch.arange(len(ids)), torch.tensor(ids)]
            finish = "stop" if ids[-1] == self.tok.eos_token_id else "length"
            outs.append(GenerateOutput(ids, lp.tolist(), finish, self.weight_version))
        return outs

    def update_weights(self, tensors, version):
        raise NotImplementedError("a scripted engine has fixed weights")

    def weights_checksum(self) -> str:
        return ""


@pytest.fixture(scope="session")
def scripted():
    """``scripted(model_dir, replies)``: a :class:`ScriptedEngine` (test modules cannot import conftest)."""
    return ScriptedEngine


@pytest.fixture(scope="session")
def backend_cfg():
    """A RelaxConfig for TorchBackend at the rollout temperature the tests sample with (1.0)."""
    from relax_core.config import RelaxConfig

    return RelaxConfig.model_validate(
        {
            "train": {"micro_batch_size": 2, "lr": 1e-3},
            "rollout": {"rollout_temperature": 1.0, "rollout_batch_size": 1, "n_samples_per_prompt": 2},
        }
    )


@pytest.fixture
def tool_server(tool_model_dir, scripted, serve):
    """``start(replies) -> URL``: a server on the tool-capable tiny Qwen3 whose engine replies with scripted
    texts (the protocol tests: Messages, Responses)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tool_model_dir)

    def start(replies=()):
        return serve(scripted(tool_model_dir, replies), tok)

    return start
