"""How far a run is from the machine's limit: the model FLOPs of each role against a measured matmul peak.

Why: a speed-up against a peer says nothing about what is left; the share of the machine's matrix-multiply
rate that a step turns into model FLOPs (model-FLOPs utilisation, MFU) does. Everything here is counted,
not estimated from a rule of thumb, and a test checks the count against torch's own FLOP counter on a
real model.

The formula (a decoder of ``L`` layers, hidden ``H``, ``h`` query heads and ``g`` key/value heads of size
``d``, MLP width ``F`` (MoE: ``k`` experts of width ``F_e`` per token, ``E`` experts routed, a shared
expert of width ``F_s``), vocabulary ``V``; a multiply-add is 2 FLOPs):

- per token, the matrix products: ``P = 2 * (L * (H*h*d + 2*H*g*d + h*d*H + 3*H*F) + H*V)``
  (MoE: ``3*H*F`` is ``k*3*H*F_e + 3*H*F_s + H*E``, the router included);
- per sequence of ``S`` tokens, attention's two products (scores and the weighted sum) over every pair the
  kernel computes: ``A(S) = L * 4*h*d * S*S`` in a forward over the whole sequence (the training and
  log-prob passes: the causal mask hides pairs, the kernel still computes them), ``L * 4*h*d * S*(S+1)/2``
  when generating with a KV cache (each new token against the ones before it);
- forward ``Fwd = sum(P*S + A(S))``; a training step ``3 * Fwd`` (backward is two products per forward one);
  generation ``sum(P*S + A_cached(S))``.

Normalisation, rotary, softmax and the optimizer are not FLOPs of the model (the convention of MFU): the
time they take is what MFU shows as lost. Lengths are the samples' real ones (padding is not model work).

The peak is measured, not taken from a data sheet: torch's fp32 matmul on the run's thread count, the best
of a few shapes, cached per machine (CPU model, threads, torch version) in ``$RELAX_CACHE_DIR`` (else
``~/.cache/relax``). CPU only: on a GPU machine the trainer logs the FLOPs and no MFU (a GPU's peak probe
is not written yet; no GPU was there to check one).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROBE_SHAPES = ((1024, 1024, 1024), (2560, 128, 384))
"""(m, k, n) of the probe's products: a large square one (the machine's best) and the CPU demo's own."""


@dataclass(frozen=True)
class ModelShape:
    """The sizes the FLOP count needs, from a Hugging Face ``config.json``."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    experts: int = 0
    experts_per_token: int = 0
    expert_ffn: int = 0
    shared_ffn: int = 0

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> ModelShape:
        """A text model's config, or a multimodal one's language part (``text_config``, Omni's thinker)."""
        for key in ("thinker_config", "text_config"):
            if isinstance(config.get(key), Mapping):
                return cls.from_hf_config(config[key])
        hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        experts = int(
            config.get("num_experts")
            or config.get("num_local_experts")
            or config.get("n_routed_experts")
            or 0
        )
        return cls(
            layers=int(config["num_hidden_layers"]),
            hidden=hidden,
            heads=heads,
            kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            ffn=int(config.get("intermediate_size") or 0),
            vocab=int(config["vocab_size"]),
            experts=experts,
            experts_per_token=int(config.get("num_experts_per_tok") or 0) if experts else 0,
            expert_ffn=int(config.get("moe_intermediate_size") or 0) if experts else 0,
            shared_ffn=int(config.get("shared_expert_intermediate_size") or 0) if experts else 0,
        )

    @classmethod
    def from_checkpoint(cls, path: str | os.PathLike[str]) -> ModelShape | None:
        """The shape of an HF checkpoint directory (None where it has no readable ``config.json``)."""
        try:
            return cls.from_hf_config(json.loads((Path(path) / "config.json").read_text()))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def per_token(self) -> int:
        """``P``: FLOPs of the matrix products one token goes through (the module docstring)."""
        h, d, g, hid = self.heads, self.head_dim, self.kv_heads, self.hidden
        attn = hid * h * d + 2 * hid * g * d + h * d * hid
        if self.experts:
            mlp = self.experts_per_token * 3 * hid * self.expert_ffn + 3 * hid * self.shared_ffn
            mlp += hid * self.experts
        else:
            mlp = 3 * hid * self.ffn
        return 2 * (self.layers * (attn + mlp) + hid * self.vocab)

    def attention(self, length: int, cached: bool) -> float:
        """``A(S)``: attention's products over one sequence, all pairs or (``cached``) the causal ones."""
        pairs = length * (length + 1) / 2 if cached else float(length * length)
        return self.layers * 4 * self.heads * self.head_dim * pairs


def forward_flops(shape: ModelShape, lengths: Iterable[int]) -> float:
    """A forward over whole sequences of these lengths (a log-prob pass: ActorFwd, Reference)."""
    p = shape.per_token()
    return float(sum(p * s + shape.attention(s, cached=False) for s in lengths))


def train_flops(shape: ModelShape, lengths: Iterable[int]) -> float:
    """A training pass (forward and backward) over sequences of these lengths."""
    return 3 * forward_flops(shape, lengths)


def generation_flops(shape: ModelShape, lengths: Iterable[int]) -> float:
    """Generating sequences of these (prompt + response) lengths with a KV cache."""
    p = shape.per_token()
    return float(sum(p * s + shape.attention(s, cached=True) for s in lengths))


@dataclass(frozen=True)
class Peak:
    """The measured matmul rate: ``gflops`` on ``threads`` threads, the best of the probe's ``shapes``."""

    gflops: float
    threads: int
    machine: str
    shapes: dict[str, float]
    load: float

    def mfu(self, flops: float, seconds: float) -> float | None:
        """The share of this peak that ``flops`` in ``seconds`` is (None without time)."""
        return flops / (seconds * self.gflops * 1e9) if seconds > 0 and self.gflops > 0 else None


QUIET_LOAD = 0.5
"""A probe is cached only when the 1-minute load average per core was below this (a quiet machine)."""


def cpu_model() -> str:
    """The CPU's name (Linux ``/proc/cpuinfo``; the platform's otherwise)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def cache_file() -> Path:
    base = os.environ.get("RELAX_CACHE_DIR")
    return (Path(base) if base else Path.home() / ".cache" / "relax") / "roofline.json"


def matmul_peak(threads: int, seconds: float = 0.15, refresh: bool = False) -> Peak:
    """The machine's fp32 matmul rate on ``threads`` torch threads: from the cache, else probed (about
    ``seconds`` per shape) and cached. ``refresh`` probes again (after a probe on a busy machine)."""
    import torch

    machine = f"{cpu_model()} | {threads} threads | torch {torch.__version__} | fp32"
    path = cache_file()
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        cached = {}
    if machine in cached and not refresh:
        return Peak(**cached[machine])
    peak = probe(threads, seconds, machine)
    if peak.load >= QUIET_LOAD * (os.cpu_count() or 1):
        return peak  # (a busy machine's rate is below its peak: used for this run, never cached)
    cached[machine] = peak.__dict__
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cached, indent=1))
        tmp.replace(path)
    except OSError:  # (a read-only home: the run goes on with the probe's figure, uncached)
        pass
    return peak


def probe(threads: int, seconds: float = 0.15, machine: str = "") -> Peak:
    """The matmul rate now, on ``threads`` threads (not cached: :func:`matmul_peak` caches a quiet one)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    rates: dict[str, float] = {}
    try:
        for m, k, n in PROBE_SHAPES:
            a, b = torch.randn(m, k), torch.randn(k, n)
            a @ b  # (warm-up: the first product allocates and spins the thread team up)
            count, t0 = 0, time.perf_counter()
            while (elapsed := time.perf_counter() - t0) < seconds:
                a @ b
                count += 1
            rates[f"{m}x{k}@{k}x{n}"] = round(2 * m * k * n * count / elapsed / 1e9, 1)
    finally:
        torch.set_num_threads(before)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else -1.0
    return Peak(max(rates.values()), threads, machine, rates, round(load, 2))


def step_roofline(
    shape: ModelShape, d: Mapping[str, Any], train_s: float, peak: Peak | None
) -> dict[str, float]:
    """``perf/*`` FLOP figures of one trained batch ``d`` (its samples' fields): the training pass, the
    rollout that generated it, the log-prob passes of ActorFwd and Reference where they ran (their fields
    are filled), and, with ``peak``, the training step's MFU over ``train_s`` and the rollout's over its
    generation time (the batch's model tokens at the rollout's tokens/s)."""
    from relax_core import sample

    lengths = [len(t) for t in d[sample.TOKENS]]
    out = {
        "perf/train_gflop": train_flops(shape, lengths) / 1e9,
        "perf/rollout_gflop": generation_flops(shape, lengths) / 1e9,
        "perf/forward_gflop": sum(
            forward_flops(shape, lengths) / 1e9
            for key in (sample.LOG_PROBS, sample.REF_LOG_PROBS)
            if key in d
        ),
    }
    if peak is None:
        return out
    train_mfu = peak.mfu(out["perf/train_gflop"] * 1e9, train_s)
    if train_mfu is not None:
        out["perf/train_mfu"] = train_mfu
    rates = [r for r in d.get(sample.ROLLOUT_TOKENS_PER_S, ()) if r]
    if rates:  # (one rate per rollout step, repeated on its samples)
        gen_s = sum(int(n) for n in d[sample.RESPONSE_LEN]) / (sum(rates) / len(rates))
        rollout_mfu = peak.mfu(out["perf/rollout_gflop"] * 1e9, gen_s)
        if rollout_mfu is not None:
            out["perf/rollout_mfu"] = rollout_mfu
    return out


def run_roofline(history: Iterable[Mapping[str, Any]], rl_wall_s: float, peak: Peak) -> dict[str, Any]:
    """The run's roofline for summary.json: the peak, every role's FLOPs, their mean MFU per step, and the
    whole run's (all FLOPs over the RL loop's wall time: roles waiting on each other lower it)."""
    rows = [h for h in history if "perf/train_gflop" in h]
    total = sum(h["perf/train_gflop"] + h["perf/rollout_gflop"] + h["perf/forward_gflop"] for h in rows)

    def mean(key: str) -> float | None:
        values = [float(h[key]) for h in rows if h.get(key) is not None]
        return round(sum(values) / len(values), 4) if values else None

    return {
        "peak_gflops": peak.gflops,
        "peak_machine": peak.machine,
        "peak_probe": peak.shapes,
        "peak_probe_load": peak.load,
        "gflop": {
            role: round(sum(h[f"perf/{role}_gflop"] for h in rows), 2)
            for role in ("train", "rollout", "forward")
        },
        "mfu_train": mean("perf/train_mfu"),
        "mfu_rollout": mean("perf/rollout_mfu"),
        "mfu_run": round(peak.mfu(total * 1e9, rl_wall_s) or 0.0, 4) if rows else None,
        "formula": "relax_core.roofline (module docstring); model FLOPs of real tokens, padding excluded",
    }
