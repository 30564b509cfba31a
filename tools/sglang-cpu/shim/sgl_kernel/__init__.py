"""An import shim named ``sgl_kernel``, written by Relax, for running the real SGLang server on a CPU
without AMX (the relax real-SGLang test tier). It is not SGLang's kernel package and holds no kernel.

Why: SGLang's CPU engine (``SGLANG_USE_CPU_ENGINE=1``, ``--device cpu``) imports ``sgl_kernel`` at start,
but on a CPU without AMX it never calls its kernels: attention, norms, rotary and activations fall back to
SGLang's torch-native code. ``sglang-kernel``'s wheel needs CUDA libraries, so this module stands in. It
defines only the names SGLang 0.5.23 imports unconditionally at start (:data:`NAMES`), each a function that
raises ``NotImplementedError`` naming itself if called: a code path that does need a kernel fails loudly.
Every other ``from sgl_kernel import name`` raises ImportError, which SGLang's optional-kernel imports
handle (e.g. its mock ``scalar_types``). It also makes pinned host memory a no-op on a machine without CUDA
(:func:`_host_memory_is_never_pinned`), which SGLang's LoRA serving (``--enable-lora``) needs there.
"""

__version__ = "0.0.0+relax.cpu.shim"

# the names SGLang 0.5.23's CPU start-up imports without a fallback (found by starting it)
NAMES: list[str] = [
    "copy_all_layer_kv_cache_cpu",
    "assign_req_to_token_pool_cpu",
    "build_tree_kernel_efficient_cpu",
    "verify_tree_greedy_cpu",
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
]


def _stub(name: str):
    def kernel(*_args, **_kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name}: relax's CPU import shim has no kernels; this SGLang code path needs the real "
            "sglang-kernel (a GPU, or a CPU with AMX)"
        )

    kernel.__name__ = kernel.__qualname__ = name
    return kernel


globals().update({_n: _stub(_n) for _n in NAMES})


def _host_memory_is_never_pinned() -> None:
    """Make pinned host memory a no-op when there is no accelerator: SGLang's LoRA layers and adapter cache
    (``srt/lora/layers.py``' ``torch.tensor(..., pin_memory=True)``, ``lora.py``'s ``pin_weights_in_cpu``,
    the torch-native backend's ``.pin_memory()``) pin staging buffers unconditionally, which torch refuses
    without CUDA, so ``--enable-lora`` could not serve on a CPU. Pinning only speeds host-to-device copies,
    and on a CPU there are none: the tensors are the same either way. Done here because SGLang's CPU
    start-up imports this module in every server process before it builds LoRA layers."""
    import functools

    import torch

    if torch.cuda.is_available():
        return

    def unpinned(factory):
        @functools.wraps(factory)
        def make(*args, **kwargs):
            kwargs.pop("pin_memory", None)
            return factory(*args, **kwargs)

        return make

    for name in ("tensor", "empty", "zeros", "ones", "full"):
        factory = getattr(torch, name, None)
        if factory is not None and not hasattr(factory, "__wrapped__"):
            setattr(torch, name, unpinned(factory))
    torch.Tensor.pin_memory = lambda self, *_args, **_kwargs: self


_host_memory_is_never_pinned()
