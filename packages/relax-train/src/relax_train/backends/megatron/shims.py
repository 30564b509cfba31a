"""megatron-core's CUDA and Transformer Engine assumptions, met on a machine without them: patches applied at
start-up (by :func:`~relax_train.backends.megatron.startup.init_parallel`) and while the model is built, so the
same megatron code runs over gloo on CPU in CI. Apart so the backend's own code reads without these workarounds in between; nothing
changes when CUDA and Transformer Engine are present.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch


def no_te_shim() -> None:
    """megatron-core 0.16's MoE router gating tests ``te_general_gemm is not None`` but only defines the
    name when Transformer Engine imports: without TE every MoE forward raises NameError. Define it as
    None (megatron's own fallback, torch.mm, then runs)."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def cpu_shims() -> None:
    """Let megatron-core's model code run without CUDA (tests, CI). On that path it (1) allocates
    buffers and moves RoPE frequencies to ``torch.cuda.current_device()`` and (2) forks the CUDA RNG
    tracker around attention dropout; (3) its distributed-checkpoint writer synchronises the GPU before
    reading tensors. Without CUDA all three would raise; here the current device is the CPU, the tracker
    a no-op (dropout is off: RL fine-tuning runs without it) and there is nothing to synchronise. Nothing
    changes when CUDA is present."""
    if torch.cuda.is_available():
        return
    import megatron.core.tensor_parallel.random as mrandom

    # deliberately "cpu" where torch says an int index: megatron only passes it on as a device
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    torch.cuda.synchronize = lambda device=None: None

    class _NoRngTracker:
        def fork(self, name: str | None = None):
            return contextlib.nullcontext()

        def is_initialized(self) -> bool:
            return True

        def add(self, name: str, seed: int) -> None:
            pass

    mrandom._CUDA_RNG_STATE_TRACKER = _NoRngTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    from relax_train.backends.megatron.context_parallel import cpu_rotary_shim

    cpu_rotary_shim()  # (4) context parallelism slices the rotary table with a CUDA index
    # (5) the forward-backward schedules count tokens in a tensor made on device="cuda"
    from megatron.core.pipeline_parallel import schedules

    if not isinstance(schedules.torch, _CpuTorch):
        schedules.torch = _CpuTorch()
    # (6) the all-to-all MoE dispatcher (the one megatron allows with the pipeline's variable sequence
    # lengths) copies its split sizes to the host on a side CUDA stream, as numpy arrays (what the
    # all-to-all takes; a tensor already on the host stayed a tensor): one stream, the same arrays
    from megatron.core.transformer.moe import token_dispatcher
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    def to_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        return tensor.numpy() if as_numpy and torch.is_tensor(tensor) else tensor

    token_dispatcher.maybe_move_tensor_to_cpu = to_host
    stream = _NoStream()
    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = stream
    # deliberately stand-ins where torch says a cuda Stream / StreamContext: only waited on and entered
    torch.cuda.current_stream = lambda device=None: stream  # type: ignore[assignment,return-value]
    torch.cuda.stream = lambda s=None: contextlib.nullcontext()  # type: ignore[assignment,misc]


@contextlib.contextmanager
def host_tensors_stay():
    """Without CUDA, ``Tensor.cuda()`` returns the tensor itself while megatron builds a model: with tied
    embeddings under pipeline parallelism it moves the last stage's copy of the embedding to the GPU to
    all-reduce it with the first stage's. Nothing changes when CUDA is present."""
    if torch.cuda.is_available():
        yield
        return
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.cuda = original  # type: ignore[method-assign]


class _NoStream:
    """The one stream of a CPU process (what the all-to-all dispatcher waits on and records)."""

    def wait_stream(self, other: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> _NoStream:
        return self

    def synchronize(self) -> None:
        pass


class _CpuTorch:
    """``torch`` as megatron's schedules module sees it on a machine without CUDA: the same module, except
    that tensors asked for on ``"cuda"`` are made on the CPU."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def zeros(*size: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        return torch.zeros(*size, device="cpu" if device == "cuda" else device, **kwargs)
