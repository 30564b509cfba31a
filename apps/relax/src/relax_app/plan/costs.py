"""What each piece of work costs on a described machine: the simulator's cost models, from first principles.

Every constant is named here with where it comes from; nothing is tuned per case. The models:

- **decode** (one step of a running batch of ``b`` responses holding ``C`` tokens of context, on an engine of
  ``tp`` GPUs) is memory-bound until the batch is large: ``max(bytes / (HBM bandwidth * decode_bw_share),
  FLOPs / (peak * decode_mfu)) + decode_step_s`` — bytes = the weights it reads (an MoE's experts: the share
  a batch of ``b`` tokens touches) plus the KV cache it attends over; FLOPs = ``relax_core.roofline``'s count;
- **prefill, log-prob forwards and training** are compute-bound: ``relax_core.roofline``'s FLOPs (a
  training step is 3 forwards) over ``GPUs * peak * MFU``;
- **weight sync** = bytes / link bandwidth + latency; the engines' pause to load a version = the bytes
  each GPU holds / HBM bandwidth + ``engine_update_s``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from relax_core.roofline import ModelShape, forward_flops, train_flops


class Device(BaseModel):
    """One accelerator (or, calibrating on CPU, one machine's cores) as the cost models see it."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    peak_tflops: float = Field(gt=0)
    """Dense bf16 matrix-multiply peak, TFLOP/s (CPU: the measured fp32 matmul peak)."""
    hbm_gbps: float = Field(gt=0)
    """Memory bandwidth, GB/s."""
    memory_gb: float = Field(gt=0)
    """Memory per device, GB (the KV cache gets what the weights leave, see ``kv_share``)."""
    source: str = ""
    """Where the figures come from."""


DEVICES: dict[str, Device] = {
    "H100-SXM": Device(
        peak_tflops=989,
        hbm_gbps=3350,
        memory_gb=80,
        source="NVIDIA H100 datasheet (SXM5): BF16 Tensor Core 1,979 TFLOPS with sparsity = 989 dense; "
        "HBM3 3.35 TB/s; 80 GB",
    ),
    "H800": Device(
        peak_tflops=989,
        hbm_gbps=3350,
        memory_gb=80,
        source="NVIDIA H800 SXM5 (H100's compute and memory; NVLink cut to 400 GB/s)",
    ),
    "H20": Device(
        peak_tflops=148,
        hbm_gbps=4000,
        memory_gb=96,
        source="NVIDIA H20 datasheet: BF16 148 TFLOPS dense, HBM3 4.0 TB/s, 96 GB",
    ),
    "A100-80GB": Device(
        peak_tflops=312,
        hbm_gbps=2039,
        memory_gb=80,
        source="NVIDIA A100 datasheet (SXM 80GB): BF16 312 TFLOPS dense, HBM2e 2,039 GB/s",
    ),
}
"""The accelerators a plan may name (``cluster.device``); any other is given in full (``cluster.custom``)."""


class Efficiency(BaseModel):
    """The shares of a device's peak each kind of work reaches: one set for every plan, never tuned per case."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    train_mfu: float = Field(0.35, gt=0, le=1)
    """Training's model-FLOPs utilisation. Megatron-LM reports 41-48% on GPT-3-class models at scale
    (Korthikanti et al. 2022, arXiv 2205.05198); RL batches of uneven lengths reach less: 35%."""
    forward_mfu: float = Field(0.45, gt=0, le=1)
    """Log-prob forwards (ActorFwd, reference) and prefill: no backward, larger kernels: 45%."""
    decode_bw_share: float = Field(0.6, gt=0, le=1)
    """The share of HBM bandwidth a decode step reaches (SGLang/vLLM decode kernels, 55-75% at batch)."""
    decode_mfu: float = Field(0.5, gt=0, le=1)
    """Decode's FLOP rate once compute-bound (large batches)."""
    decode_step_s: float = Field(0.004, ge=0)
    """Per decode step, what neither bytes nor FLOPs explain: scheduling, sampling, kernel launches (SGLang's
    CUDA-graph decode of a small model: ~3-5 ms a step, its own bench_one_batch). CPU: measured."""
    decode_row_s: float = Field(0.0, ge=0)
    """Per decode step and running response, what neither bytes nor FLOPs explain, on one device (a small
    model on a CPU: sampling, cache updates, small ops; measured). 0 on GPUs (in ``decode_step_s``)."""
    decode_row_scaling: float = Field(1.0, ge=0, le=1)
    """How ``decode_row_s`` falls with an engine's devices: as 1 / devices ** this (1: in proportion; a
    CPU's threads: log2 of a decode step's 1-thread over 2-thread time, measured)."""
    engine_update_s: float = Field(0.5, ge=0)
    """Fixed cost of an engine taking new weights (pause, flush the cache, resume)."""
    kv_share: float = Field(0.85, gt=0, le=1)
    """The share of device memory an engine may fill (SGLang's ``--mem-fraction-static`` default ~0.85)."""
    colocate_switch_gbps: float = Field(25.0, gt=0)
    """Colocate's offload and onload (optimizer state and weights to host and back per step), GB/s: PCIe 5
    x16 is 64 GB/s a direction, pinned copies reach ~40%."""


@dataclass(frozen=True)
class Costs:
    """The cost models of one plan: its model's ``shape``, ``device`` and ``eff``; ``dtype_bytes`` a weight."""

    shape: ModelShape
    device: Device
    eff: Efficiency
    dtype_bytes: int = 2
    tied_embeddings: bool = False

    # -- sizes ------------------------------------------------------------------------------------
    @property
    def params(self) -> int:
        """Every weight (all experts of an MoE)."""
        s = self.shape
        attn = s.hidden * s.heads * s.head_dim * 2 + 2 * s.hidden * s.kv_heads * s.head_dim
        mlp = (
            3 * s.hidden * (s.experts * s.expert_ffn + s.shared_ffn) + s.hidden * s.experts
            if s.experts
            else 3 * s.hidden * s.ffn
        )
        embed = s.hidden * s.vocab * (1 if self.tied_embeddings else 2)
        return s.layers * (attn + mlp) + embed

    @property
    def expert_params(self) -> int:
        s = self.shape
        return s.layers * 3 * s.hidden * s.experts * s.expert_ffn if s.experts else 0

    @property
    def kv_bytes_per_token(self) -> int:
        s = self.shape
        return 2 * s.layers * s.kv_heads * s.head_dim * self.dtype_bytes

    def weight_bytes(self) -> float:
        return self.params * self.dtype_bytes

    def touched_weight_bytes(self, batch: int) -> float:
        """Bytes of weights one decode step of ``batch`` tokens reads: all dense ones, and of an MoE's experts
        the share some token routes to (each token picks ``k`` of ``E``)."""
        s = self.shape
        dense = (self.params - self.expert_params) * self.dtype_bytes
        if not s.experts:
            return dense
        touched = 1.0 - (1.0 - s.experts_per_token / s.experts) ** max(batch, 1)
        return dense + self.expert_params * self.dtype_bytes * touched

    def kv_capacity_tokens(self, gpus: int) -> int:
        """Tokens of KV cache an engine of ``gpus`` holds beside its weights."""
        free = self.device.memory_gb * 1e9 * gpus * self.eff.kv_share - self.weight_bytes()
        if free <= 0:
            raise ValueError(
                f"the model's weights ({self.weight_bytes() / 1e9:.1f} GB) do not fit an engine of {gpus} "
                f"device(s) of {self.device.memory_gb} GB: raise cluster.rollout_tp"
            )
        return int(free / self.kv_bytes_per_token)

    # -- times ------------------------------------------------------------------------------------
    def decode_steps(self, gpus: int, batch: int, context: int, steps: int) -> np.ndarray:
        """Seconds of each of ``steps`` decode steps of ``batch`` running responses holding ``context``
        tokens at the first (one more token each per step)."""
        d, e, s = self.device, self.eff, self.shape
        ctx = context + batch * np.arange(steps, dtype=np.float64)
        mem = (self.touched_weight_bytes(batch) + self.kv_bytes_per_token * ctx) / gpus
        mem_s = mem / (d.hbm_gbps * 1e9 * e.decode_bw_share)
        flops = s.per_token() * batch + s.layers * 4 * s.heads * s.head_dim * ctx
        comp_s = flops / (gpus * d.peak_tflops * 1e12 * e.decode_mfu)
        return (
            np.maximum(mem_s, comp_s) + e.decode_step_s + batch * e.decode_row_s / gpus**e.decode_row_scaling
        )

    def forward_s(self, gpus: int, lengths: list[int]) -> float:
        """A forward pass over sequences of ``lengths`` on ``gpus``: an engine's prefill, a log-prob pass
        (ActorFwd, the reference)."""
        return forward_flops(self.shape, lengths) / (
            gpus * self.device.peak_tflops * 1e12 * self.eff.forward_mfu
        )

    def train_s(self, gpus: int, lengths: list[int]) -> float:
        return train_flops(self.shape, lengths) / (gpus * self.device.peak_tflops * 1e12 * self.eff.train_mfu)

    def load_pause_s(self, nbytes: float, gpus: int) -> float:
        """An engine of ``gpus`` taking a version of ``nbytes`` (its share written in place)."""
        return nbytes / gpus / (self.device.hbm_gbps * 1e9) + self.eff.engine_update_s

    def switch_s(self, gpus: int) -> float:
        """Colocate's offload + onload per step: weights, gradients' and Adam's fp32 state (16 bytes a
        parameter, spread over the GPUs) out and back."""
        return 2 * self.params * 16 / gpus / (self.eff.colocate_switch_gbps * 1e9)
