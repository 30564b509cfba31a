"""What the megatron backend sets up before it has a model: torch.distributed and megatron's parallel groups,
megatron-core's ``TransformerConfig`` from the HF config, and the HF weights read from disk. Apart from
:mod:`~relax_train.backends.megatron.backend` so the backend class holds only what lives on a rank's model.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from relax_core.config import RelaxConfig
from relax_train.backends.megatron.layout import MegatronLayout
from relax_train.backends.megatron.shims import cpu_shims, no_te_shim


def require_psutil() -> None:
    """megatron-core's checkpoint writer forks worker processes that call psutil first; without it each
    worker dies before it reports, and ``dist_checkpointing.save`` waits for them forever (megatron-core
    does not declare psutil). Fail at start-up instead of at the first checkpoint, hours in."""
    try:
        import psutil  # noqa: F401
    except ImportError:
        raise ImportError(
            "the megatron backend needs psutil (megatron-core's checkpoint writer hangs without it): "
            "pip install psutil, or install relax-train[megatron], which brings it"
        ) from None


_PARALLEL_SIZES = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "context_parallel_size",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
)


def _parallel_sizes(config: RelaxConfig) -> dict[str, int | None]:
    """The run's model-parallel sizes, under the names that the train config, megatron's parallel state
    (``initialize_model_parallel``) and its ``TransformerConfig`` all give them."""
    return {name: getattr(config.train, name) for name in _PARALLEL_SIZES}


def init_parallel(config: RelaxConfig) -> None:
    """torch.distributed (from the launcher's env, or one local process) and megatron's parallel groups."""
    from megatron.core import parallel_state as ps

    t = config.train
    cuda = torch.cuda.is_available()
    if not dist.is_initialized():
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        if world == 1 and "MASTER_PORT" not in os.environ:
            import socket

            with socket.socket() as s:  # a process on its own: any free local port
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            init = f"tcp://127.0.0.1:{port}"
        else:
            init = f"tcp://{os.environ.get('MASTER_ADDR', '127.0.0.1')}:{os.environ['MASTER_PORT']}"
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        else:  # gloo binds where the hostname resolves (often 127.0.0.1): the address routing to rank 0
            from relax_core.dcs_transport import parse_tcp
            from relax_core.net import pin_gloo_interface

            pin_gloo_interface(parse_tcp(init)[0])
        dist.init_process_group("nccl" if cuda else "gloo", init_method=init, rank=rank, world_size=world)
    require_psutil()
    cpu_shims()
    no_te_shim()
    need = t.tensor_model_parallel_size * t.pipeline_model_parallel_size
    need = max(
        need,
        t.expert_model_parallel_size * (t.expert_tensor_parallel_size or t.tensor_model_parallel_size),
    )
    if dist.get_world_size() < need or dist.get_world_size() % need:
        raise ValueError(
            f"megatron backend: TP × PP = {t.tensor_model_parallel_size} × {t.pipeline_model_parallel_size} "
            f"(and EP × expert TP) need a multiple of {need} ranks, but this process group has "
            f"{dist.get_world_size()}; start one process per rank (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)"
        )
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(**_parallel_sizes(config))
    if cuda:
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(t.seed)


FUSED_KERNELS = (
    "bias_dropout_fusion apply_rope_fusion masked_softmax_fusion gradient_accumulation_fusion persist_layer_norm"
).split()
"""megatron's fused kernels, all off: they need Apex or Transformer Engine, which this backend does without
(the CPU path, and parity with the torch backend)."""


def transformer_config(hf: Any, layout: MegatronLayout, config: RelaxConfig):
    """megatron-core's TransformerConfig for a Qwen3 / Qwen3-MoE HF config (float32 parameters)."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    t = config.train
    text = hf.get_text_config() if hasattr(hf, "get_text_config") else hf
    moe: dict[str, Any] = {}
    if layout.is_moe:
        moe = dict(
            # norm_topk_prob: top-k, then softmax over those k (renormalised, megatron's default); without
            # it, softmax over every expert, then top-k (megatron's pre-softmax routing)
            moe_router_pre_softmax=not bool(getattr(text, "norm_topk_prob", False)),
            num_moe_experts=layout.num_experts,
            moe_router_topk=int(text.num_experts_per_tok),
            moe_ffn_hidden_size=layout.moe_ffn_hidden_size,
            moe_layer_freq=layout.moe_layer_pattern,
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_grouped_gemm=False,
            moe_enable_routing_replay=config.algo.routing_replay,  # R3: relax_train.backends.megatron.routing
            moe_router_dtype="fp32",
        )
    dtype = compute_dtype(config)
    cuda = torch.cuda.is_available()
    return TransformerConfig(
        **layout.transformer_sizes(),
        normalization="RMSNorm",
        layernorm_epsilon=float(getattr(text, "rms_norm_eps", 1e-6)),
        qk_layernorm=True,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.float32,
        pipeline_dtype=dtype or torch.float32,
        **_parallel_sizes(config),
        sequence_parallel=t.sequence_parallel,
        # micro-batches are padded to their own longest row; the pipeline sends their shapes first, which
        # megatron allows with the all-to-all MoE dispatcher (on CPU too: see cpu_shims)
        variable_seq_lengths=True,
        moe_token_dispatcher_type="alltoall",
        use_cpu_initialization=not cuda,
        # weights come from the HF checkpoint right after, but megatron marks which tensors are TP-sharded
        # (``tensor_model_parallel``, read by the gradient norm) only while initialising them
        perform_initialization=True,
        **dict.fromkeys(FUSED_KERNELS, False),
        calculate_per_token_loss=True,  # our micro-batch losses are already normalised by the batch
        **moe,
    )


def compute_dtype(config: RelaxConfig) -> torch.dtype | None:
    """The autocast dtype of the forward (None: float32 throughout)."""
    return {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(str(config.model.dtype))


def rope_theta_of(text: Any) -> float:
    params = getattr(text, "rope_parameters", None) or {}
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    return float(theta or getattr(text, "rope_theta", None) or 1_000_000.0)


def load_hf_state(model_path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_path}: no *.safetensors weights to build the megatron model from")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state
