"""The roofline's FLOP count against torch's own counter on real models, and the peak probe's cache."""

import json

import pytest

from relax_core.roofline import (
    ModelShape,
    forward_flops,
    generation_flops,
    matmul_peak,
    train_flops,
)
from relax_testing import tiny_moe, tiny_qwen3_config

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _counted(model, length: int, backward: bool) -> int:
    """FLOPs torch's FlopCounterMode sees in a forward (and backward) over one sequence of ``length``."""
    from torch.utils.flop_counter import FlopCounterMode

    ids = torch.randint(2, model.config.vocab_size, (1, length))
    with FlopCounterMode(display=False) as counter:
        logits = model(ids).logits
        if backward:
            logits.float().pow(2).mean().backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("tied", [False, True])
def test_dense_forward_and_training_match_torch_s_counter(tied):
    cfg = transformers.Qwen3Config(**tiny_qwen3_config(tie_word_embeddings=tied), attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(cfg)
    shape = ModelShape.from_hf_config(cfg.to_dict())
    assert forward_flops(shape, [37]) == _counted(model, 37, backward=False)
    assert train_flops(shape, [37]) == _counted(model, 37, backward=True)
    # a batch is the sum of its sequences: attention grows with each one's square, not the batch's
    assert forward_flops(shape, [10, 27]) == forward_flops(shape, [10]) + forward_flops(shape, [27])
    assert forward_flops(shape, [37]) > forward_flops(shape, [10, 27])


def test_moe_counts_the_experts_each_token_goes_through():
    # (eager experts: one product per expert, which torch's counter sees; the grouped kernel it does not)
    model = tiny_moe(layers=2, top_k=2, attn_implementation="eager", experts_implementation="eager")
    shape = ModelShape.from_hf_config(model.config.to_dict())
    assert shape.experts == 8 and shape.experts_per_token == 2
    counted = _counted(model, 29, backward=False)
    assert forward_flops(shape, [29]) == pytest.approx(counted, rel=0.01)


def test_generation_counts_the_causal_pairs_only():
    shape = ModelShape.from_hf_config(tiny_qwen3_config())
    s = 50
    full = forward_flops(shape, [s])
    cached = generation_flops(shape, [s])
    attn_full = shape.layers * 4 * shape.heads * shape.head_dim * s * s
    assert full - cached == attn_full - attn_full * (s + 1) / (2 * s)


def test_the_language_part_of_a_multimodal_config(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"text_config": tiny_qwen3_config(), "vision_config": {}})
    )
    assert ModelShape.from_checkpoint(tmp_path) == ModelShape.from_hf_config(tiny_qwen3_config())
    assert ModelShape.from_checkpoint(tmp_path / "missing") is None


def test_the_peak_is_probed_once_per_machine_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("RELAX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr("os.getloadavg", lambda: (0.0, 0.0, 0.0))
    peak = matmul_peak(1, seconds=0.02)
    assert peak.gflops > 0 and peak.gflops == max(peak.shapes.values()) and peak.threads == 1
    cached = json.loads((tmp_path / "roofline.json").read_text())
    assert list(cached) == [peak.machine] and "1 threads" in peak.machine
    cached[peak.machine]["gflops"] = 123.0  # (the cache answers: no second probe)
    (tmp_path / "roofline.json").write_text(json.dumps(cached))
    assert matmul_peak(1).gflops == 123.0
    assert matmul_peak(1, seconds=0.02, refresh=True).gflops != 123.0
    assert peak.mfu(peak.gflops * 1e9, 2.0) == pytest.approx(0.5)


def test_a_probe_on_a_busy_machine_is_not_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("RELAX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr("os.getloadavg", lambda: (64.0, 64.0, 64.0))
    assert matmul_peak(1, seconds=0.02).load == 64.0
    assert not (tmp_path / "roofline.json").exists()


def test_a_batch_s_figures_and_the_run_s():
    from relax_core import sample
    from relax_core.roofline import Peak, run_roofline, step_roofline

    shape = ModelShape.from_hf_config(tiny_qwen3_config())
    d = {
        sample.TOKENS: [[1] * 12, [1] * 20],
        sample.RESPONSE_LEN: [4, 6],
        sample.ROLLOUT_TOKENS_PER_S: [5.0, 5.0],  # (10 tokens at 5/s: 2 s of generation)
        sample.REF_LOG_PROBS: [[0.0] * 4, [0.0] * 6],
    }
    peak = Peak(gflops=0.001, threads=2, machine="m", shapes={}, load=0.0)
    step = step_roofline(shape, d, train_s=3.0, peak=peak)
    assert step["perf/train_gflop"] == train_flops(shape, [12, 20]) / 1e9
    assert step["perf/forward_gflop"] == forward_flops(shape, [12, 20]) / 1e9  # (the Reference alone)
    assert step["perf/train_mfu"] == pytest.approx(train_flops(shape, [12, 20]) / 3.0 / 1e6)
    assert step["perf/rollout_mfu"] == pytest.approx(generation_flops(shape, [12, 20]) / 2.0 / 1e6)
    run = run_roofline([step, {"eval/accuracy": 0.5}, step], rl_wall_s=10.0, peak=peak)
    total = 2 * (step["perf/train_gflop"] + step["perf/rollout_gflop"] + step["perf/forward_gflop"])
    assert run["mfu_run"] == pytest.approx(total / 10.0 / peak.gflops, abs=1e-4)
    assert run["mfu_train"] == pytest.approx(step["perf/train_mfu"], abs=1e-4)
    assert run["gflop"]["train"] == round(2 * step["perf/train_gflop"], 2)
