"""Give a role's device memory back while another role uses the device, and take it again (colocate).

In colocate mode the rollout engine and the trainer take turns on the same GPUs: while one works, the
other must hold (next to) nothing there. :class:`HostOffload` copies tensors to host memory and shrinks
their storages to zero bytes; :meth:`HostOffload.onload` grows them back and copies the bytes in. The
tensor objects stay the same — parameters, the optimizer's references to them, views into shared buffers
(tied embeddings, megatron's contiguous buffers) — so nothing that holds a tensor needs to be told.
That is how slime's torch_memory_saver and FSDP's parameter freeing keep references valid, without a
custom CUDA allocator.

On a CPU device the copy moves host memory to host memory: it frees nothing useful, but it runs the same
code, which is how the tests check it. Storages that cannot shrink (a checkpoint mapped from disk) are
copied into ordinary memory once, by giving the parameter a new storage (its object stays the same).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Concatenate, ParamSpec, Protocol, TypeVar

if TYPE_CHECKING:  # (torch is imported where it runs: this module imports without it)
    import torch


class HostOffload:
    """The tensors of one role (or engine) moved to host memory, by storage."""

    def __init__(self, name: str = "model") -> None:
        self.name = name
        self._saved: list[tuple[torch.UntypedStorage, int, torch.Tensor | None]] = []
        """(storage, its size in bytes, the host copy of its bytes or None)"""
        self.bytes = 0
        """Bytes given back by the last :meth:`offload`."""

    @property
    def offloaded(self) -> bool:
        return bool(self._saved)

    def offload(self, tensors: Iterable[torch.Tensor], keep: bool = True) -> int:
        """Free the storages of ``tensors``. ``keep``: copy their bytes to host memory first (a trainer's
        weights and optimizer state); without it the contents are lost and must be written again after
        :meth:`onload` (an engine's weights, which the trainer sends anyway). Returns the bytes freed."""
        import torch

        if self._saved:
            raise RuntimeError(f"{self.name} is already offloaded; onload() it first")
        seen: set[int] = set()
        device_used = False
        for t in tensors:
            if not t.untyped_storage().resizable():
                # memory this tensor does not own (mapped from a file, numpy's, or torch.load's: an
                # optimizer state restored by --load): give it memory of its own, once
                with torch.no_grad():
                    t.data = t.data.clone()
            s = t.untyped_storage()
            if s.nbytes() == 0 or s.data_ptr() in seen:
                continue
            seen.add(s.data_ptr())
            host = None
            if keep:
                pin = s.device.type == "cuda"
                host = torch.empty(s.nbytes(), dtype=torch.uint8, pin_memory=pin)
                host.copy_(_bytes(s), non_blocking=pin)
            self._saved.append((s, s.nbytes(), host))
            device_used |= s.device.type == "cuda"
        if device_used:
            torch.cuda.synchronize()  # the copies must land before the memory is reused
        self.bytes = sum(n for _, n, _ in self._saved)
        for s, _, _ in self._saved:
            s.resize_(0)
        if device_used:
            _give_back_cached_device_memory()
        return self.bytes

    def onload(self) -> int:
        """Grow the storages back and copy their bytes in (kept ones; the others hold garbage until
        written). Returns the bytes restored; 0 when nothing was offloaded."""
        import torch

        saved, self._saved = self._saved, []
        restored = 0
        for s, n, host in saved:
            s.resize_(n)
            if host is not None:
                _bytes(s).copy_(host, non_blocking=host.is_pinned())
            restored += n
        if any(s.device.type == "cuda" for s, _, _ in saved):
            torch.cuda.synchronize()
        return restored


def _give_back_cached_device_memory() -> None:
    """Back to the device, for the other role's allocator: the allocator's free blocks, and cuBLAS's
    workspaces, which torch keeps per stream (32 MiB each on Hopper; a megatron trainer held 64 MiB of them
    on an H100 after its weights had gone) and allocates again at the next matrix product."""
    import torch

    torch.cuda.synchronize()
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)  # (private; absent: the workspaces stay)
    if clear is not None:
        clear()
    torch.cuda.empty_cache()


def _bytes(s: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole storage."""
    import torch

    return torch.empty(0, dtype=torch.uint8, device=s.device).set_(s)


class _Onloads(Protocol):
    def onload(self) -> object: ...


_S = TypeVar("_S", bound=_Onloads)
_P = ParamSpec("_P")
_R = TypeVar("_R")


def onloaded(method: Callable[Concatenate[_S, _P], _R]) -> Callable[Concatenate[_S, _P], _R]:
    """For a method that needs the tensors on the device: take them back first if they were offloaded
    (the object's ``_host`` is its :class:`HostOffload`; its ``onload()`` is called). The colocate loop
    onloads explicitly before training; this covers the rest (a checkpoint at a signal, the last eval)."""

    @functools.wraps(method)
    def wrapper(self: _S, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        host = getattr(self, "_host", None)
        if host is not None and host.offloaded:
            self.onload()
        return method(self, *args, **kwargs)

    return wrapper
