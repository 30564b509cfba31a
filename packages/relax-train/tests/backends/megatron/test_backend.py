"""The megatron training backend against the torch backend, on the same HF weights and samples: log-probs,
one PPO training step (loss, gradient norm, updated weights), weights exported in HF names, checkpoints,
and tensor and context parallelism over two processes.

megatron-core's real model code runs here on CPU (gloo; see ``relax_train.backends.megatron.backend``),
through Megatron's own forward-backward schedules. Runs of one size (one rank, two) go one after another
through one long-lived group of processes, each run setting up and leaving torch.distributed and megatron's
parallel state (global to a process) itself — CI minutes: importing megatron-core costs ~15 s a process. bf16 and megatron's fused GPU kernels are not exercised here."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("megatron.core")

from relax_app.cli_config import build_config  # noqa: E402
from relax_core.net import free_port  # noqa: E402
from relax_testing import (  # noqa: E402
    tiny_omni_thinker_config,
    tiny_qwen3_config,
    tiny_vision_config,
)
from relax_train.backends.torch_backend import TorchBackend  # noqa: E402

WORKER = Path(__file__).with_name("_megatron_worker.py")
VOCAB = 300  # not a multiple of 128: megatron's vocab padding must not leak into the log-probs
FLAGS = [
    "--micro-batch-size",
    "2",
    "--rollout-batch-size",
    "2",
    "--n-samples-per-prompt",
    "2",
    "--lr",
    "1e-3",
]


def _model(tmp: Path, kind: str) -> str:
    """A tiny random Qwen3 (dense, tied or MoE) with weights large enough that the logits are far from
    uniform, saved in HF format."""
    common = tiny_qwen3_config(vocab_size=VOCAB, max_position_embeddings=128)
    torch.manual_seed(0)
    if kind == "moe":
        cfg = transformers.Qwen3MoeConfig(
            **common, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1]
        )
        model = transformers.Qwen3MoeForCausalLM(cfg)
    else:
        model = transformers.Qwen3ForCausalLM(
            transformers.Qwen3Config(**common, tie_word_embeddings=kind == "tied")
        )
        if kind == "tied":
            model.lm_head.weight = model.model.embed_tokens.weight
    _sharpen(model)
    out = tmp / kind
    model.save_pretrained(out)
    return str(out)


def _sharpen(model, keep: tuple[str, ...] = ()) -> None:
    """Random weights large enough that the logits are far from uniform (norm weights near 1); parameters
    under the prefixes ``keep`` stay as initialised (media encoders: their layer norms must stay norms)."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith(keep):
                continue
            p.copy_(
                1.0 + 0.1 * torch.randn(p.shape, generator=gen)
                if p.ndim == 1
                else 0.2 * torch.randn(p.shape, generator=gen)
            )


def _rl_fields(rng, resp: tuple[int, ...]) -> dict:
    """Advantages, loss masks and rollout log-probs for responses of lengths ``resp``."""
    return {
        "advantages": [np.full(r, a, np.float32) for r, a in zip(resp, (1.0, -1.0, 0.5, -0.5))],
        "loss_mask": [np.ones(r, np.float32) for r in resp],
        "rollout_log_probs": [rng.uniform(-7.0, -4.0, r).astype(np.float32) for r in resp],
    }


def _samples(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    lens, plens = (9, 11, 6, 10), (4, 5, 2, 6)
    tokens = [rng.integers(0, VOCAB, n) for n in lens]
    resp = [n - p for n, p in zip(lens, plens)]
    return {
        "tokens": tokens,
        "prompt_len": list(plens),
        **_rl_fields(rng, tuple(resp)),
    }


def _megatron(
    tmp: Path, model: str, flags: list[str], world: int = 1, data: dict | None = None, **task
) -> dict:
    """Run the worker on ``world`` ranks (gloo on CPU); rank 0's results."""
    samples = tmp / "samples.pt"
    torch.save(data or _samples(), samples)
    spec = tmp / f"spec_{len(list(tmp.glob('spec_*')))}.json"
    spec.write_text(json.dumps({"model": model, "flags": flags, "samples": str(samples), **task}))
    out = spec.with_suffix(".pt")
    _RANKS[world].run(spec, out)
    result = torch.load(out, weights_only=False)
    result["weights_held"] = [int(Path(f"{out}.rank{r}.weights").read_text()) for r in range(world)]
    return result


class _Ranks:
    """A long-lived group of ``world`` ranks (``_megatron_worker.py --serve``), started on first use and
    again after a failed run (a rank left inside a collective is not worth saving); their stderr goes to
    files, read back when a run fails."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.procs: list[subprocess.Popen] = []

    def run(self, spec: Path, out: Path, timeout_s: float = 600.0) -> None:
        import threading

        if not self.procs or any(p.poll() is not None for p in self.procs):
            self.close()
            self.logs = [spec.with_name(f"ranks{self.world}_rank{r}.log") for r in range(self.world)]
            self.procs = [
                subprocess.Popen(
                    [sys.executable, str(WORKER), "--serve"],
                    start_new_session=True,  # (its own process group: close() ends what a rank started too)
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=log.open("w"),
                    text=True,
                    env={
                        **os.environ,
                        "OMP_NUM_THREADS": "1",
                        "RANK": str(r),
                        "WORLD_SIZE": str(self.world),
                        "LOCAL_RANK": str(r),
                        "MASTER_ADDR": "127.0.0.1",
                    },
                )
                for r, log in enumerate(self.logs)
            ]
        port = free_port()
        answers: list[str | None] = [None] * self.world

        def answer(r: int, proc: subprocess.Popen) -> None:
            for line in proc.stdout:  # (megatron may print; the answer is the sentinel line)
                if line.startswith("@@done "):
                    answers[r] = line.split()[1]
                    return

        readers = []
        for r, proc in enumerate(self.procs):
            proc.stdin.write(f"{spec} {out} {port}\n")
            proc.stdin.flush()
            readers.append(threading.Thread(target=answer, args=(r, proc), daemon=True))
            readers[-1].start()
        for t in readers:
            t.join(timeout_s)
        if answers != ["ok"] * self.world:
            errors = [
                Path(f"{out}.err.rank{r}").read_text()
                if Path(f"{out}.err.rank{r}").exists()
                else log.read_text()
                for r, log in enumerate(self.logs)
            ]
            self.close()
            raise AssertionError(f"ranks answered {answers}:\n" + "\n".join(e[-4000:] for e in errors))

    def close(self) -> None:
        """End every rank and whatever it started (megatron's and torch's helper processes, which a rank
        killed alone leaves running, parented to init)."""
        for p in self.procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(timeout=30)
        self.procs = []


_RANKS = {world: _Ranks(world) for world in (1, 2)}


@pytest.fixture(scope="module", autouse=True)
def _rank_groups():
    yield
    for ranks in _RANKS.values():
        ranks.close()


def _torch(model: str, flags: list[str], train_steps: int = 0, data: dict | None = None) -> dict:
    cfg = build_config(None, ["--prompt-data", "unused", "--hf-checkpoint", model, *flags])
    backend = TorchBackend(cfg, model)
    samples = data or _samples()
    out: dict = {"logp": backend.compute_log_probs(samples)}
    out["metrics"] = [backend.train_step(samples) for _ in range(train_steps)]
    out["weights"] = dict(backend.named_weights())
    out["logp_after"] = backend.compute_log_probs(samples)
    return out


def _assert_same_update(got, ref, name: str) -> None:
    """Weights after AdamW steps (lr 1e-3: each element moves ~1e-3 per step). Adam normalises each
    element's gradient, so one whose gradient is at rounding level moves by up to lr either way:
    such elements (at most one in a thousand) may differ by up to lr; all others must agree to 1e-6."""
    diff = (got - ref).abs()
    off = int((diff > 1e-6).sum())
    assert float(diff.max()) <= 1e-3 + 1e-6, (name, float(diff.max()), off)
    assert off <= max(1, diff.numel() // 1000), (name, off, diff.numel())


METRICS = ("loss", "grad_norm", "pg_loss", "clipfrac", "ratio_mean")


def _assert_same_training(got: dict, ref: dict, keys: tuple[str, ...] = METRICS, after: bool = True) -> None:
    """Megatron's run ``got`` against the torch backend's ``ref``: log-probs, every step's metrics ``keys``,
    the updated weights under their HF names (what rollout engines load) and, with ``after``, the policy
    after the steps."""
    assert _max_diff(got["logp"], ref["logp"]) < 1e-4
    for m_ref, m_got in zip(ref["metrics"], got["metrics"], strict=True):
        for key in keys:
            assert m_got[key] == pytest.approx(m_ref[key], rel=1e-4, abs=1e-6), key
    assert set(got["weights"]) == set(ref["weights"])
    for name, value in ref["weights"].items():
        _assert_same_update(got["weights"][name], value, name)
    if after:
        assert _max_diff(got["logp_after"], ref["logp_after"]) < 1e-4


def _max_diff(a: list, b: list) -> float:
    assert [len(x) for x in a] == [len(y) for y in b]
    return max(float(np.abs(np.asarray(x) - np.asarray(y)).max()) for x, y in zip(a, b))


@pytest.mark.parametrize("kind", ["dense", "tied"])
def test_log_probs_and_a_training_step_match_the_torch_backend(tmp_path, kind):
    model = _model(tmp_path, kind)
    ref = _torch(model, FLAGS, train_steps=2)
    got = _megatron(tmp_path, model, FLAGS, train_steps=2)
    assert min(float(np.min(x)) for x in ref["logp"]) < -8.0  # far from uniform (log 300 = -5.7)
    _assert_same_training(got, ref)
    assert _max_diff(ref["logp_after"], ref["logp"]) > 1e-3  # training changed the policy


@pytest.mark.parametrize(
    "layout",
    [[], ["--context-parallel-size", "2"], ["--tensor-model-parallel-size", "2", "--sequence-parallel"]],
    ids=["one-rank", "cp2", "tp2-sp"],
)
def test_routing_replay_through_megatrons_router_matches_the_torch_backend(tmp_path, layout):
    """R3: both backends route every recorded token to the rollout's experts (not their own choice); without
    R3 megatron's MoE log-probs and exported weights are the torch backend's (one rank). Under
    context parallelism each rank's routers see its two chunks of every row, under sequence parallelism
    its share of the sequence: each replays the records of those positions, and the r3 counts are summed
    over the ranks."""
    model = _model(tmp_path, "moe")  # layer 0 MoE (4 experts, top 2), layer 1 dense
    data = _samples()
    rng = np.random.default_rng(3)
    data["routed_experts"] = [
        np.stack([rng.permutation(4)[:2] for _ in range(len(t) - 1)])[:, None, :] for t in data["tokens"]
    ]  # [len - 1, MoE layers, k]: arbitrary expert pairs, mostly not the router's own
    flags = [*FLAGS, "--routing-replay"]
    ref = _torch(model, flags, train_steps=1, data=data)
    world = 2 if layout else 1
    got = _megatron(tmp_path, model, [*flags, *layout], world=world, train_steps=1, data=data)
    assert _max_diff(got["logp"], ref["logp"]) < 1e-4
    if not layout:  # (once is enough) without replay: the MoE model's own routing, as the torch backend's
        plain = _megatron(tmp_path, model, FLAGS, data=data)
        assert _max_diff(got["logp"], plain["logp"]) > 1e-2  # the replay changed the routing
        own = _torch(model, FLAGS, data=data)
        assert _max_diff(plain["logp"], own["logp"]) < 1e-4
        assert set(plain["weights"]) == set(own["weights"])  # (the experts under their HF names)
        for name, value in own["weights"].items():
            torch.testing.assert_close(plain["weights"][name], value, msg=name)
    m_ref, m_got = ref["metrics"][0], got["metrics"][0]
    for key in ("loss", "grad_norm", "r3_replayed_frac", "r3_expert_differ_frac"):
        assert m_got[key] == pytest.approx(m_ref[key], rel=1e-4), key
    assert m_got["r3_expert_differ_frac"] > 0.3
    for name, value in ref["weights"].items():  # the router trained the same way
        _assert_same_update(got["weights"][name], value, name)


PARALLEL_FLAGS = [*FLAGS, "--entropy-coef", "0.01"]  # (the entropy term too goes through the gathers)


@pytest.fixture(scope="module")
def dense_one_rank(tmp_path_factory):
    """The dense model and one training step of it on one rank: what TP=2 and CP=2 must equal."""
    tmp = tmp_path_factory.mktemp("dense_one_rank")
    model = _model(tmp, "dense")
    return model, _megatron(tmp, model, PARALLEL_FLAGS, train_steps=1)


def test_tensor_and_sequence_parallel_two_ranks_equal_one(tmp_path, dense_one_rank):
    """TP=2 with sequence parallelism (norms on half the tokens each, their gradients summed over TP; a
    micro-batch of odd width padded to split)."""
    model, one = dense_one_rank
    flags = [*PARALLEL_FLAGS, "--tensor-model-parallel-size", "2", "--sequence-parallel"]
    two = _megatron(tmp_path, model, flags, world=2, train_steps=1)
    assert _max_diff(two["logp"], one["logp"]) < 1e-5
    assert two["metrics"][0]["grad_norm"] == pytest.approx(one["metrics"][0]["grad_norm"], rel=1e-4)
    for name, value in one["weights"].items():  # gathered from both ranks' shards
        _assert_same_update(two["weights"][name], value, name)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_context_parallel_two_ranks_equals_one(tmp_path, kind, dense_one_rank):
    """CP=2 without Transformer Engine (``relax_train.backends.megatron.context_parallel``): each rank holds two of
    four chunks of every sequence and attends to the keys of both; the log-probs, one training step's
    metrics (entropy included) and the updated weights equal one rank's. For the MoE model the experts'
    gradients are summed over the CP ranks through the expert data-parallel group."""
    if kind == "dense":
        model, one = dense_one_rank
    else:
        model = _model(tmp_path, kind)
        one = _megatron(tmp_path, model, PARALLEL_FLAGS, train_steps=1)
    two = _megatron(
        tmp_path, model, [*PARALLEL_FLAGS, "--context-parallel-size", "2"], world=2, train_steps=1
    )
    assert _max_diff(two["logp"], one["logp"]) < 1e-5
    for key in ("loss", "grad_norm", "entropy"):
        assert two["metrics"][0][key] == pytest.approx(one["metrics"][0][key], rel=1e-4), key
    for name, value in one["weights"].items():
        _assert_same_update(two["weights"][name], value, name)
    assert _max_diff(two["logp_after"], one["logp_after"]) < 1e-5


def test_pipeline_parallel_through_megatrons_schedule_matches_the_torch_backend(tmp_path):
    """PP=2 through Megatron's own 1F1B schedule (over gloo here): four micro-batches, so the first stage
    runs a warm-up forward before its steady 1F1B phase. The model ties its embeddings (as Qwen3-0.6B to
    4B do): stage 0 holds the table, stage 1 the output layer, two copies of one weight whose gradients
    are summed. Log-probs, two steps' metrics (computed on the last stage) and the updated weights equal
    the torch backend's; the distributed checkpoint saved by the two stages loads on one rank. (MoE under
    PP: the Omni test below.)"""
    model = _model(tmp_path, "tied")
    flags = [*FLAGS, "--micro-batch-size", "1"]
    ref = _torch(model, flags, train_steps=2)
    ckpt = tmp_path / "ckpt"
    got = _megatron(
        tmp_path,
        model,
        [*flags, "--pipeline-model-parallel-size", "2"],
        world=2,
        train_steps=2,
        save=str(ckpt),
        publish_dtype="bfloat16",
    )
    _assert_same_training(got, ref)
    # the weights reach rank 0 only (stage 1's bucket by bucket), in the dtype the rollout serves
    assert got["weights_held"] == [len(got["weights"]), 0]
    assert set(got["weights_published"]) == set(got["weights"])
    for name, value in got["weights_published"].items():
        assert value.dtype == torch.bfloat16, name
        torch.testing.assert_close(value, got["weights"][name].to(torch.bfloat16), rtol=0, atol=0, msg=name)
    loaded = _megatron(tmp_path, model, flags, load=str(ckpt))
    for name, value in got["weights"].items():
        torch.testing.assert_close(loaded["weights_loaded"][name], value, rtol=0, atol=0, msg=name)


def test_expert_and_data_parallel_two_ranks_match_the_torch_backend(tmp_path):
    """EP=2 on two ranks, so two data-parallel replicas: each runs its share of the micro-batches, the
    experts' tokens cross ranks in megatron's all-to-all dispatcher, gradients are summed over the
    replicas. Three samples in micro-batches of one: one replica runs a stand-in third micro-batch (the
    all-to-all needs both in step) that must contribute nothing. With routing replay, whose counts are
    summed over the replicas."""
    model = _model(tmp_path, "moe")
    data = {k: v[:3] for k, v in _samples().items()}
    rng = np.random.default_rng(3)
    data["routed_experts"] = [
        np.stack([rng.permutation(4)[:2] for _ in range(len(t) - 1)])[:, None, :] for t in data["tokens"]
    ]
    flags = [*FLAGS, "--micro-batch-size", "1", "--routing-replay"]
    ref = _torch(model, flags, train_steps=2, data=data)
    got = _megatron(
        tmp_path, model, [*flags, "--expert-model-parallel-size", "2"], world=2, train_steps=2, data=data
    )
    _assert_same_training(got, ref, (*METRICS, "r3_replayed_frac", "r3_expert_differ_frac"))


def test_distributed_optimizer_shards_the_moments_and_matches_the_torch_backend(tmp_path):
    """--use-distributed-optimizer on two data-parallel replicas: each holds AdamW moments for only the
    parameters it owns, steps those and sends them to the other; two steps equal the torch backend's.
    The distributed checkpoint (each moment saved by its owner) loads on one rank, moments included: the
    next step equals the saving run's next step."""
    model = _model(tmp_path, "dense")
    flags = [*FLAGS, "--micro-batch-size", "1"]
    ref = _torch(model, flags, train_steps=2)
    ckpt = tmp_path / "ckpt"
    zero = [*flags, "--train-backend", "megatron", "--use-distributed-optimizer"]
    got = _megatron(tmp_path, model, zero, world=2, train_steps=2, save=str(ckpt), then_train=1)
    assert 0 < got["optimizer_params"] < got["params"]  # rank 0's share of the moments
    _assert_same_training(got, ref, after=False)  # (its log-probs "after" follow one more step)
    loaded = _megatron(tmp_path, model, flags, load=str(ckpt), then_train=1)
    for name, value in got["weights"].items():
        torch.testing.assert_close(loaded["weights_loaded"][name], value, rtol=0, atol=0, msg=name)
    for name, value in got["weights_then"].items():
        _assert_same_update(loaded["weights_then"][name], value, name)


def test_micro_batches_of_empty_responses_train_with_a_proximal_policy(tmp_path):
    """Responses of no token (an engine's EOS first) with π_prox's log-probs, one sample per micro-batch:
    two micro-batches hold no response token. Before (#49): the step crashed taking ``prox_gap_max`` over
    them; now both backends take the same step (the empty ones add nothing)."""
    model = _model(tmp_path, "dense")
    data = _samples()
    for i in (0, 2):  # (their prompts only)
        data["tokens"][i] = data["tokens"][i][: data["prompt_len"][i]]
        for key in ("advantages", "loss_mask", "rollout_log_probs"):
            data[key][i] = data[key][i][:0]
    data["log_probs"] = [x + 0.01 for x in data["rollout_log_probs"]]  # (ActorFwd's π_prox)
    flags = [*FLAGS[2:], "--micro-batch-size", "1"]
    ref = _torch(model, flags, train_steps=1, data=data)
    got = _megatron(tmp_path, model, flags, train_steps=1, data=data)
    for m_ref, m_got in zip(ref["metrics"], got["metrics"], strict=True):
        for key in (*METRICS, "prox_gap_max"):
            assert m_got[key] == pytest.approx(m_ref[key], rel=1e-4, abs=1e-6), key
    for name, value in ref["weights"].items():
        _assert_same_update(got["weights"][name], value, name)


def test_offload_and_onload_between_two_steps_change_nothing(tmp_path):
    """Colocate's ``--offload`` (on by default where CUDA is): between its turns the trainer's weights,
    gradients and AdamW moments leave the device and come back; the next step is the one a run without the
    hand-over takes. On a GPU the device memory is measured too: the trainer leaves (next to) nothing."""
    model = _model(tmp_path, "dense")
    ref = _torch(model, FLAGS, train_steps=2)  # two steps, no hand-over (the torch backend: the same update)
    handed = _megatron(tmp_path, model, FLAGS, train_steps=1, offload=True, then_train=1)
    o = handed["offload"]
    hf_bytes = sum(t.numel() * t.element_size() for t in ref["weights"].values())
    assert o["freed"] == o["restored"] >= 3 * hf_bytes  # the weights and AdamW's two moments (+ gradients)
    assert _max_diff(o["logp_after"], o["logp"]) == 0
    for name, value in ref["weights"].items():
        _assert_same_update(handed["weights_then"][name], value, name)
    before, offloaded, after = o["allocated"]
    if before:  # CUDA: what the trainer held is given back to the device (all but a few KiB), and taken again
        assert o["on_gpu"] >= 3 * hf_bytes and before - offloaded >= o["on_gpu"], o
        assert offloaded <= before // 10 and after - offloaded >= o["on_gpu"], o  # (blocks rounded up)


def test_distributed_checkpoint_reloads_under_another_tensor_parallel_size(tmp_path):
    """The checkpoint round trip: saved by two TP ranks (the backend's own ``meta.json``, a megatron
    distributed checkpoint, an HF export of the trained weights that transformers loads), loaded by one:
    the weights are the gathered shards and the AdamW moments come along, so the next step equals the saving run's next step (as TP=2 equals TP=1). With fresh
    moments it would not: Adam's first step moves every element by ~lr, its second by far less."""
    model = _model(tmp_path, "dense")
    ckpt = tmp_path / "ckpt"
    tp2 = [*FLAGS, "--tensor-model-parallel-size", "2"]
    saved = _megatron(tmp_path, model, tp2, world=2, train_steps=1, save=str(ckpt), then_train=1)
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta == {"version": 1}  # the backend's own state only (the run's lies beside it)
    assert (ckpt / "dist" / "metadata.json").is_file()  # a megatron distributed checkpoint
    # a fresh backend from the original weights loads the trained state back
    loaded = _megatron(tmp_path, model, FLAGS, load=str(ckpt), then_train=1)
    assert loaded["meta"]["version"] == 1
    for name, value in saved["weights"].items():
        torch.testing.assert_close(loaded["weights_loaded"][name], value, rtol=0, atol=0, msg=name)
    # and the optimizer state: the next step is the one the saving run took after its save
    for name, value in saved["weights_then"].items():
        _assert_same_update(loaded["weights_then"][name], value, name)
    # the HF export is a loadable transformers model with the trained weights
    hf = transformers.AutoModelForCausalLM.from_pretrained(ckpt / "model")
    for name, p in hf.named_parameters():
        torch.testing.assert_close(p.detach(), saved["weights"][name], rtol=0, atol=0, msg=name)
    # the same weights (the checkpoint's HF export) with fresh AdamW moments step elsewhere
    # (one torch-backend step: the same update as megatron's, to 1e-6, without starting a process)
    fresh = _torch(str(ckpt / "model"), FLAGS, train_steps=1)
    assert max(float((fresh["weights"][n] - v).abs().max()) for n, v in saved["weights_then"].items()) > 1e-4


def test_streaming_rollout_trains_a_megatron_batch_whole(tmp_path):
    """--streaming-rollout: the trainer trains a batch part by part only on a backend that declares streamed
    steps (the torch backend); megatron takes the whole batch. (A one-rank MegatronBackend once subclassed
    TorchBackend, so the trainer's ``isinstance`` check sent it down the torch backend's streamed path, an HF
    forward on megatron's model.)"""
    from relax_train.roles.stream import streams_training

    model = _model(tmp_path, "dense")
    flags = [*FLAGS, "--streaming-rollout", "--fully-async"]
    cfg = build_config(None, ["--prompt-data", "unused", "--hf-checkpoint", model, *flags])
    assert streams_training(cfg, TorchBackend(cfg, model))  # the same run on the torch backend streams
    assert _megatron(tmp_path, model, flags, streams=True)["streams"] is False


def test_model_parallelism_without_enough_ranks_is_a_clear_error(tmp_path):
    model = _model(tmp_path, "dense")
    with pytest.raises(AssertionError, match="start one process per rank"):
        _megatron(tmp_path, model, [*FLAGS, "--tensor-model-parallel-size", "2"], world=1)


# -- Qwen3-VL: HF's vision tower in front of the megatron decoder ------------------------------------------
VL_IDS = dict(image_token_id=290, video_token_id=291, vision_start_token_id=292, vision_end_token_id=293)
PATCH = 3 * 2 * 16 * 16  # channels × temporal patch × patch²: one row of pixel_values


def _vl_model(tmp: Path) -> str:
    """A tiny random Qwen3-VL: two decoder layers, both receiving DeepStack features (from the two vision
    blocks), interleaved M-RoPE; weights scaled as in :func:`_model`."""
    cfg = transformers.Qwen3VLConfig(
        text_config=tiny_qwen3_config(
            vocab_size=VOCAB,
            max_position_embeddings=256,
            pad_token_id=0,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 5e6,
                "mrope_section": [2, 3, 3],
                "mrope_interleaved": True,
            },
        ),
        vision_config=tiny_vision_config(),
        **VL_IDS,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3VLForConditionalGeneration(cfg)
    _sharpen(model, keep=("model.visual",))
    out = tmp / "qwen3_vl"
    model.save_pretrained(out)
    return str(out)


def _vl_samples(seed: int = 0) -> dict:
    """Four rows as relax-multimodal and the rollout worker make them: an image (4 merged tokens), a
    two-frame video (4 tokens a frame, text between the frames), a text-only row and a wider image (8)."""
    rng = np.random.default_rng(seed)
    s, e, img, vid = (
        VL_IDS[k]
        for k in ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id")
    )

    def text(n):
        return list(rng.integers(1, 280, n))

    def image(grid):
        n = grid[1] * grid[2] // 4
        return {
            "pixel_values": rng.normal(size=(grid[0] * grid[1] * grid[2], PATCH)).astype(np.float32),
            "image_grid_thw": np.array([grid]),
        }, [s, *[img] * n, e]

    m_img, t_img = image([1, 4, 4])
    m_wide, t_wide = image([1, 4, 8])
    m_vid = {
        "pixel_values_videos": rng.normal(size=(32, PATCH)).astype(np.float32),
        "video_grid_thw": np.array([[2, 4, 4]]),
    }
    t_vid = [*text(2), s, *[vid] * 4, e, *text(2), s, *[vid] * 4, e]
    prompts = [text(3) + t_img + text(2), t_vid + text(1), text(6), text(2) + t_wide + text(3)]
    media = [m_img, m_vid, None, m_wide]
    resp = (5, 4, 6, 3)
    tokens, mms = [], []
    for p, m, r in zip(prompts, media, resp):
        tokens.append(np.array(p + text(r)))
        if m is not None:
            types = np.array([1 if t == img else 2 if t == vid else 0 for t in p])
            m = {**m, "mm_token_type_ids": types}
        mms.append(m)
    return {
        "tokens": tokens,
        "prompt_len": [len(p) for p in prompts],
        "mm": mms,
        **_rl_fields(rng, tuple(resp)),
    }


def test_qwen3_vl_under_context_parallelism_matches_the_torch_backend(tmp_path):
    """Images, a video and a text row in one micro-batch, on two CP ranks: each rank encodes the media
    itself and keeps two of four chunks of every row (media positions included); media features, M-RoPE
    positions and DeepStack go into megatron's decoder as HF's Qwen3-VL does it, and the vision tower
    trains like the rest. (TP with sequence parallelism: ``tests/test_mm_rl.py``, in a colocate run.)"""
    _assert_multimodal_matches_torch(
        tmp_path, _vl_model(tmp_path), _vl_samples(), world=2, flags=["--context-parallel-size", "2"]
    )


def test_qwen3_vl_data_parallel_replica_without_media_matches_the_torch_backend(tmp_path):
    """Two data-parallel replicas, micro-batches of one row: one replica gets the image and the video, the
    other only text rows, so its vision tower gets no gradient of its own; it joins the replicas' gradient
    sum with zeros (otherwise the two replicas' reductions would pair different tensors)."""
    data = {k: [v[i] for i in (0, 2, 1, 2)] for k, v in _vl_samples().items()}  # image, text, video, text
    _assert_multimodal_matches_torch(
        tmp_path, _vl_model(tmp_path), data, world=2, flags=["--micro-batch-size", "1"]
    )


def _assert_multimodal_matches_torch(tmp_path, model: str, data: dict, world: int = 1, flags=()) -> None:
    """Megatron on ``world`` ranks against the torch backend (HF's model): log-probs, one step's metrics,
    the updated weights under their HF names (the media encoders' included) and the policy after it; and
    the media matter (the rows without their media tensors give other log-probs)."""
    ref = _torch(model, PARALLEL_FLAGS, train_steps=1, data=data)
    got = _megatron(tmp_path, model, [*PARALLEL_FLAGS, *flags], world=world, data=data, train_steps=1)
    _assert_same_training(got, ref, ("loss", "grad_norm", "entropy"))
    bare = _torch(model, PARALLEL_FLAGS, data={**data, "mm": [None] * len(data["tokens"])})
    assert _max_diff(bare["logp"], ref["logp"]) > 1e-2


OMNI_IDS = dict(
    image_token_id=290,
    video_token_id=291,
    vision_start_token_id=292,
    vision_end_token_id=293,
    audio_token_id=294,
    audio_start_token_id=295,
    audio_end_token_id=296,
)


def _omni_model(tmp: Path, deepstack: tuple[int, ...] = (0, 1)) -> str:
    """A tiny random Qwen3-Omni thinker: MoE decoder (4 experts, top 2; layer 1 dense), vision tower with
    DeepStack (from the blocks ``deepstack``, into as many first decoder layers), audio tower."""
    cfg = transformers.Qwen3OmniMoeThinkerConfig(
        **tiny_omni_thinker_config(
            vision={"deepstack_visual_indexes": list(deepstack)},
            text={
                "vocab_size": VOCAB,
                "max_position_embeddings": 256,
                "pad_token_id": 0,
                "rope_parameters": {
                    "rope_type": "default",
                    "rope_theta": 1e6,
                    "mrope_section": [2, 3, 3],
                    "interleaved": True,
                    "mrope_interleaved": False,
                },
            },
            position_id_per_seconds=13,
            **OMNI_IDS,
        )
    )
    torch.manual_seed(0)
    model = transformers.Qwen3OmniMoeThinkerForConditionalGeneration(cfg)
    _sharpen(model, keep=("visual", "audio_tower"))
    out = tmp / "qwen3_omni"
    model.save_pretrained(out)
    return str(out)


def _omni_samples(seed: int = 0) -> dict:
    """An image + audio row (AVQA-R1-6K's shape), an audio-only row, a text row and a video + audio row
    (the audio-video rows of the same format, the audio block after the video's) whose frames are 0.6 s
    apart: fractional time positions, which Qwen3-Omni keeps (unlike Qwen3-VL, it computes them as floats)."""
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import _get_feat_extract_output_lengths

    rng = np.random.default_rng(seed)
    ids = OMNI_IDS

    def text(n):
        return list(rng.integers(1, 280, n))

    def audio(frames):
        n = int(_get_feat_extract_output_lengths(torch.tensor(frames)))
        feats = {
            "input_features": rng.normal(size=(1, 128, frames)).astype(np.float32),
            "feature_attention_mask": np.ones((1, frames), np.int64),
        }
        return feats, [ids["audio_start_token_id"], *[ids["audio_token_id"]] * n, ids["audio_end_token_id"]]

    m_img = {
        "pixel_values": rng.normal(size=(16, PATCH)).astype(np.float32),
        "image_grid_thw": np.array([[1, 4, 4]]),
    }
    t_img = [ids["vision_start_token_id"], *[ids["image_token_id"]] * 4, ids["vision_end_token_id"]]
    m_vid = {
        "pixel_values_videos": rng.normal(size=(32, PATCH)).astype(np.float32),
        "video_grid_thw": np.array([[2, 4, 4]]),
        "video_second_per_grid": np.array([0.6], np.float32),
    }
    t_vid = [ids["vision_start_token_id"], *[ids["video_token_id"]] * 8, ids["vision_end_token_id"]]
    a1, t_a1 = audio(120)
    a2, t_a2 = audio(64)
    a3, t_a3 = audio(40)
    prompts = [
        text(2) + t_img + t_a1 + text(2),
        text(3) + t_a2 + text(1),
        text(6),
        text(1) + t_vid + t_a3 + text(3),
    ]
    media = [{**m_img, **a1}, a2, None, {**m_vid, **a3}]
    resp = (5, 4, 6, 3)
    tokens = [np.array(p + text(r)) for p, r in zip(prompts, resp)]
    return {
        "tokens": tokens,
        "prompt_len": [len(p) for p in prompts],
        "mm": media,
        **_rl_fields(rng, tuple(resp)),
    }


def test_qwen3_omni_thinker_under_pipeline_parallelism_matches_the_torch_backend(tmp_path):
    """Qwen3-Omni's thinker (the Omni recipe's model, with its pipeline parallelism) on two stages: the
    first encodes image, video and audio, puts the features in place and adds DeepStack's after its MoE layer;
    the second, the dense layer and the output, needs only Omni's M-RoPE positions (audio clips advance
    time). As HF computes it, through the torch backend."""
    _assert_multimodal_matches_torch(
        tmp_path,
        _omni_model(tmp_path, deepstack=(1,)),
        _omni_samples(),
        world=2,
        flags=["--pipeline-model-parallel-size", "2"],
    )


def test_the_backend_refuses_to_start_without_psutil(monkeypatch):
    """megatron-core's checkpoint writer dies without psutil and the save then waits forever: say so at
    start-up (the megatron extra brings it)."""
    from relax_train.backends.megatron.startup import require_psutil

    require_psutil()  # installed here
    monkeypatch.setitem(sys.modules, "psutil", None)  # an environment without it
    with pytest.raises(ImportError, match=r"needs psutil .*checkpoint writer hangs.*relax-train\[megatron\]"):
        require_psutil()
