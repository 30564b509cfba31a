"""The megatron training backend (``--train-backend megatron``; ``pip install 'relax-train[megatron]'``).

A megatron-core ``GPTModel`` built from the HF Qwen3 / Qwen3-MoE config, with tensor, pipeline, context
and expert parallelism from the run config, loaded from and exported to HF weights with our converter
(:mod:`relax_train.backends.megatron.convert`). Losses, log-probs and statistics are the torch backend's own
(:class:`~relax_train.backends.torch_backend.TorchBackend` ``_micro_loss`` / ``_logp_from_logits``), so
both backends optimise the same objective; only the model, the forward and the gradient reductions
differ.

One process per rank: ``torch.distributed`` is initialised from ``RANK`` / ``WORLD_SIZE`` /
``MASTER_ADDR`` / ``MASTER_PORT`` (a single process on its own when they are unset), NCCL on GPU, gloo on
CPU. Parameters are kept in float32 and the forward runs under ``torch.autocast`` in ``--dtype``
(bf16 mixed precision with float32 master weights); AdamW steps each rank's shard; the gradient norm is
reduced over the model-parallel groups (replicated parameters counted once).

Data parallelism: every rank is handed the whole batch; each data-parallel replica runs its share of the
micro-batches (:meth:`MegatronBackend._my_micro`), with the loss normalised by the whole optimizer batch's
token and sequence counts, so the gradients summed over the replicas are the full-batch gradient; the
log-probs and the step's statistics are gathered over them.

The micro-batches go through Megatron's forward-backward schedule (1F1B with pipeline parallelism), on GPU
and on CPU. megatron-core assumes CUDA in a few places; on a machine without it (our CI) this module runs
the same code over gloo, with the CUDA assumptions met on that path patched (see :func:`_cpu_shims`).

Routing replay (R3) goes through megatron-core's own router replay (:mod:`relax_train.backends.megatron.routing`).

Inside a run, a role with several ranks is a :class:`~relax_train.backends.megatron.group.MegatronRankGroup`.

Context parallelism without Transformer Engine: :mod:`relax_train.backends.megatron.context_parallel`. Qwen3-VL
and Qwen3-Omni's thinker: HF's media encoders in front of the megatron decoder
(:mod:`relax_train.backends.megatron.multimodal`).

``--use-distributed-optimizer``: AdamW's moments sharded over the data-parallel replicas (ZeRO-1, ours:
:meth:`MegatronBackend._set_trainable`); weights and gradients stay whole on every replica.

Not yet: Qwen3-VL-MoE.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from relax_core.config import RelaxConfig
from relax_core.models import media_token_ids
from relax_core.offload import onloaded
from relax_train.backends.megatron import multimodal as mm
from relax_train.backends.megatron.convert import MegatronLayout, hf_to_megatron_rank, megatron_to_hf
from relax_train.backends.megatron.norms import use_sequence_parallel_norms
from relax_train.backends.torch_backend import TorchBackend

# The TE layer spec fuses the input / pre-MLP RMSNorm into the following linear (the converter's
# names); the local spec (no Transformer Engine: CPU, or GPUs without TE) keeps separate norms.
_TE_TO_LOCAL = (
    (".self_attention.linear_qkv.layer_norm_weight", ".input_layernorm.weight"),
    (".mlp.linear_fc1.layer_norm_weight", ".pre_mlp_layernorm.weight"),
)
_LAYER = "decoder.layers."


def _no_te_shim() -> None:
    """megatron-core 0.16's MoE router gating tests ``te_general_gemm is not None`` but only defines the
    name when Transformer Engine imports: without TE every MoE forward raises NameError. Define it as
    None (megatron's own fallback, torch.mm, then runs)."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


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


def _cpu_shims() -> None:
    """Let megatron-core's model code run without CUDA (tests, CI). On that path it (1) allocates
    buffers and moves RoPE frequencies to ``torch.cuda.current_device()`` and (2) forks the CUDA RNG
    tracker around attention dropout; (3) its distributed-checkpoint writer synchronises the GPU before
    reading tensors. Without CUDA all three would raise; here the current device is the CPU, the tracker
    a no-op (dropout is off: RL fine-tuning runs without it) and there is nothing to synchronise. Nothing
    changes when CUDA is present."""
    if torch.cuda.is_available():
        return
    import megatron.core.tensor_parallel.random as mrandom

    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]

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
    torch.cuda.current_stream = lambda device=None: stream  # type: ignore[assignment]
    torch.cuda.stream = lambda s=None: contextlib.nullcontext()  # type: ignore[assignment]


@contextlib.contextmanager
def _host_tensors_stay():
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


def _contributes_nothing(idx, logp, *rest) -> torch.Tensor:
    return logp.sum() * 0.0


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
        dist.init_process_group("nccl" if cuda else "gloo", init_method=init, rank=rank, world_size=world)
    require_psutil()
    _cpu_shims()
    _no_te_shim()
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
        ps.initialize_model_parallel(
            tensor_model_parallel_size=t.tensor_model_parallel_size,
            pipeline_model_parallel_size=t.pipeline_model_parallel_size,
            context_parallel_size=t.context_parallel_size,
            expert_model_parallel_size=t.expert_model_parallel_size,
            expert_tensor_parallel_size=t.expert_tensor_parallel_size,
        )
    if cuda:
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(t.seed)


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
        num_layers=layout.num_layers,
        hidden_size=layout.hidden_size,
        num_attention_heads=layout.num_attention_heads,
        num_query_groups=layout.num_query_groups,
        kv_channels=layout.head_dim,
        ffn_hidden_size=layout.ffn_hidden_size,
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
        tensor_model_parallel_size=t.tensor_model_parallel_size,
        pipeline_model_parallel_size=t.pipeline_model_parallel_size,
        context_parallel_size=t.context_parallel_size,
        expert_model_parallel_size=t.expert_model_parallel_size,
        expert_tensor_parallel_size=t.expert_tensor_parallel_size,
        sequence_parallel=t.sequence_parallel,
        # micro-batches are padded to their own longest row; the pipeline sends their shapes first, which
        # megatron allows with the all-to-all MoE dispatcher (on CPU too: see _cpu_shims)
        variable_seq_lengths=True,
        moe_token_dispatcher_type="alltoall",
        use_cpu_initialization=not cuda,
        # weights come from the HF checkpoint right after, but megatron marks which tensors are TP-sharded
        # (``tensor_model_parallel``, read by the gradient norm) only while initialising them
        perform_initialization=True,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        calculate_per_token_loss=True,  # our micro-batch losses are already normalised by the batch
        **moe,
    )


def compute_dtype(config: RelaxConfig) -> torch.dtype | None:
    """The autocast dtype of the forward (None: float32 throughout)."""
    return {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(str(config.model.dtype))


def _rope_theta(text: Any) -> float:
    params = getattr(text, "rope_parameters", None) or {}
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    return float(theta or getattr(text, "rope_theta", None) or 1_000_000.0)


def _load_hf_state(model_path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_path}: no *.safetensors weights to build the megatron model from")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


class MegatronBackend(TorchBackend):
    """Same protocol as :class:`TorchBackend` (``compute_log_probs``, ``train_step``, ``named_weights``
    in HF names, ``load_weights``, checkpoints) over a megatron-core model on this rank."""

    def __init__(self, config: RelaxConfig, model_path: str, trainable: bool = True) -> None:
        from megatron.core import parallel_state as ps
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
        from transformers import AutoConfig

        t = config.train
        self.cp = t.context_parallel_size
        init_parallel(config)
        torch.manual_seed(config.train.seed)
        self.cfg, self.model_path = config, model_path
        self.hf_config = AutoConfig.from_pretrained(model_path)
        text = self.hf_config.get_text_config()
        mm.check_supported(self.hf_config, model_path)
        self.layout = MegatronLayout.from_hf_config(text)
        multimodal = mm.is_multimodal(self.hf_config)
        if multimodal:  # Qwen3-VL / Omni keep tie_word_embeddings at the top of their config
            tied = bool(getattr(self.hf_config, "tie_word_embeddings", False))
            self.layout = dataclasses.replace(self.layout, tie_word_embeddings=tied)
        self.tp, self.ep = t.tensor_model_parallel_size, t.expert_model_parallel_size
        if t.expert_tensor_parallel_size not in (None, self.tp):
            raise ValueError(
                "--expert-tensor-parallel-size other than --tensor-model-parallel-size is not supported by "
                "the weight converter yet; leave it unset"
            )
        self.pp = t.pipeline_model_parallel_size
        self.mcfg = transformer_config(self.hf_config, self.layout, config)
        if multimodal:
            self.mcfg.mrope_section = mm.mrope_section(text)
        self.pre, self.post = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
        spec = get_gpt_decoder_block_spec(self.mcfg, use_transformer_engine=False, normalization="RMSNorm")
        use_sequence_parallel_norms(spec)  # (torch's own norms refuse --sequence-parallel)
        if self.cp > 1:  # megatron's own CP needs Transformer Engine: ours gathers keys and values
            from relax_train.backends.megatron.context_parallel import use_context_parallel_attention

            use_context_parallel_attention(spec)
        with _host_tensors_stay():  # (tied embeddings under PP: megatron syncs the two copies on CUDA)
            self.model = GPTModel(
                self.mcfg,
                transformer_layer_spec=spec,
                vocab_size=self.layout.padded_vocab_size(self.tp),
                max_sequence_length=int(getattr(text, "max_position_embeddings", 4096)),
                pre_process=self.pre,
                post_process=self.post,
                share_embeddings_and_output_weights=self.layout.tie_word_embeddings,
                position_embedding_type="mrope" if multimodal else "rope",
                rotary_base=_rope_theta(text),
            )
        # Qwen3-VL / Omni: the media encoders, interleaved M-RoPE and DeepStack hooks go onto the model
        self.front = mm.MediaFront(self.hf_config, self.model, self.tp, self.pre) if multimodal else None
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        if self.device is not None:
            self.model.cuda()
        self._layer_offset = self._offset()
        hf_state = _load_hf_state(model_path)
        if self.layout.tie_word_embeddings:  # as transformers loads it: the embedding is the output layer
            hf_state.pop("lm_head.weight", None)
        self.load_weights(hf_state, version=0)
        # what the shared TorchBackend code reads
        self.masked_token_ids: list[int] = media_token_ids(self.hf_config) if multimodal else []
        self.takes_token_types = False  # (multimodal rows: _mm_forward builds their token types)
        self.routing = None
        if config.algo.routing_replay and self.layout.is_moe:
            from relax_train.backends.megatron.routing import MegatronRouting

            self.routing = MegatronRouting(self.model, self.layout.moe_layers, int(text.num_experts_per_tok))
        self._r3_counts = {"replayed": 0.0, "expected": 0.0, "differ": 0.0}
        self.pad_token_id = getattr(text, "pad_token_id", None) or 0
        self.temperature = config.rollout.rollout_temperature
        self._set_trainable(trainable)

    # -- layout -------------------------------------------------------------------------------------
    def _offset(self) -> int:
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

        return int(get_transformer_layer_offset(self.mcfg)) if self.pp > 1 else 0

    def _to_local(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Converter (TE-spec, global-layer) names -> this stage's module names."""
        n_local = len(self.model.decoder.layers)
        out: dict[str, torch.Tensor] = {}
        for name, value in state.items():
            for te, local in _TE_TO_LOCAL:
                name = name.replace(te, local)
            if name.startswith(_LAYER):
                i, rest = name[len(_LAYER) :].split(".", 1)
                j = int(i) - self._layer_offset
                if not 0 <= j < n_local:
                    continue
                name = f"{_LAYER}{j}.{rest}"
            elif name.startswith("embedding.") and not self.pre:
                continue
            elif name.startswith(("decoder.final_layernorm", "output_layer")) and not self.post:
                continue
            out[name] = value
        return out

    def _to_global(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for name, value in state.items():
            if name.endswith("._extra_state"):
                continue
            if name.startswith(_LAYER):
                i, rest = name[len(_LAYER) :].split(".", 1)
                name = f"{_LAYER}{int(i) + self._layer_offset}.{rest}"
            for te, local in _TE_TO_LOCAL:
                if local in name and (local != ".pre_mlp_layernorm.weight" or not self._moe_layer(name)):
                    name = name.replace(local, te)
            out[name] = value
        return out

    def _moe_layer(self, name: str) -> bool:
        i = int(name[len(_LAYER) :].split(".", 1)[0])
        return i in set(self.layout.moe_layers)

    # -- weights ------------------------------------------------------------------------------------
    @onloaded
    def load_weights(self, tensors: dict[str, Any], version: int) -> None:
        """Full HF-named weights (the trainer's broadcast, or a checkpoint) -> this rank's shards."""
        from megatron.core import parallel_state as ps

        hf = {k: torch.as_tensor(v) for k, v in tensors.items()}
        towers: dict[str, torch.Tensor] = {}
        if self.front is not None:
            hf, towers = mm.to_text_names(hf, self.front.family)
        mine = hf_to_megatron_rank(
            hf,
            self.layout,
            tp_rank=ps.get_tensor_model_parallel_rank(),
            ep_rank=ps.get_expert_model_parallel_rank(),
            tp_size=self.tp,
            ep_size=self.ep,
        )
        local = {**self._to_local(mine), **towers}
        if self.layout.tie_word_embeddings and self.post and not self.pre:  # the last stage's copy
            local["output_layer.weight"] = mine["embedding.word_embeddings.weight"]
        params = dict(self.model.named_parameters())
        missing = sorted(set(params) - set(local))
        if missing:
            raise ValueError(
                f"megatron backend: the converted weights lack {missing[:5]} (of {len(missing)}); the HF "
                f"checkpoint and the megatron model built from its config disagree"
            )
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(local[name].to(p.dtype))
        self.version = version

    def _gather(self, t: torch.Tensor, group) -> list[torch.Tensor]:
        size = dist.get_world_size(group)
        if size == 1:
            return [t]
        parts = [torch.empty_like(t) for _ in range(size)]
        dist.all_gather(parts, t.contiguous(), group=group)
        return parts

    @onloaded
    def named_weights(self) -> list[tuple[str, torch.Tensor]]:
        """Every weight in HF names (the rollout engines' and ActorFwd's format) on rank 0, in the dtype the
        rollout serves (``--dtype``); the other ranks return ``[]`` (they take part in the gathers).

        TP and EP shards are gathered per tensor within each stage; with PP, each stage's share goes to
        rank 0 bucket by bucket (:mod:`relax_train.backends.megatron.gather`), so no rank but rank 0 ever holds
        the whole model, and it holds it once, in host memory."""
        from megatron.core import parallel_state as ps

        from relax_train.backends.megatron.gather import gather_to_rank0

        dtype = getattr(torch, str(self.cfg.model.dtype))
        pp_group = ps.get_pipeline_model_parallel_group() if self.pp > 1 else None
        # the ranks whose shards reach rank 0: stage by stage, the members of rank 0's pipeline
        keep = dist.get_rank() == 0 if pp_group is None else 0 in dist.get_process_group_ranks(pp_group)
        state = self._to_global({n: p.detach() for n, p in self.model.named_parameters()})
        if self.layout.tie_word_embeddings:  # (under PP the last stage's copy of the first stage's embedding)
            state.pop("output_layer.weight", None)
        # keys: ("tower", HF name) for a media encoder's weight (replicated: not converted), (tp rank, ep
        # rank, name) for an expert's shard, (tp rank, None, name) for a shard every EP rank holds alike
        items: list[tuple[Any, torch.Tensor]] = []
        for name in [n for n in state if mm.is_tower(n)]:
            items.append((("tower", name), state.pop(name)))
        tp_group, ep_group = ps.get_tensor_model_parallel_group(), ps.get_expert_model_parallel_group()
        for name, value in state.items():
            expert = ".mlp.experts." in name
            tp_parts = self._gather(value, ps.get_expert_tensor_parallel_group() if expert else tp_group)
            for t_rank, part in enumerate(tp_parts):
                ep_parts = self._gather(part, ep_group) if expert else [part]
                for e_rank, shard in enumerate(ep_parts):
                    if keep:
                        items.append(((t_rank, e_rank if expert else None, name), shard))
        if not keep:
            return []
        if pp_group is not None:
            items = gather_to_rank0(items, pp_group, dtype)
            if dist.get_rank() != 0:
                return []
        else:
            items = [(key, t.to(dtype).cpu()) for key, t in items]
        grid: list[list[dict[str, torch.Tensor]]] = [[{} for _ in range(self.ep)] for _ in range(self.tp)]
        towers: dict[str, torch.Tensor] = {}
        for key, t in items:
            if key[0] == "tower":
                towers[key[1]] = t
                continue
            t_rank, e_rank, name = key
            for e in range(self.ep) if e_rank is None else [e_rank]:
                grid[t_rank][e][name] = t
        hf = megatron_to_hf(grid, self.layout, include_tied_lm_head=False)  # as HF names tied params
        if self.front is not None:  # (the media encoders are replicated: every rank holds all of them)
            hf = mm.to_hf_names(hf, towers, self.front.family)
        return list(hf.items())

    @onloaded
    def eval_model(self):
        """An HF model with the current weights, for the evaluator (which generates with HF models)."""
        from relax_core.models import load_model

        if getattr(self, "_hf_eval", None) is None:
            self._hf_eval = load_model(self.model_path).eval()
        params = dict(self._hf_eval.named_parameters())
        with torch.no_grad():
            for name, value in self.named_weights():
                params[name].copy_(value)
        return self._hf_eval

    @onloaded
    def export_hf(self, out_dir: str | Path) -> Path:
        """HF safetensors + the source config and tokenizer files (what rollout engines load)."""
        from safetensors.torch import save_file

        out = Path(out_dir)
        weights = {k: v.contiguous() for k, v in self.named_weights()}
        if dist.get_rank() == 0:
            out.mkdir(parents=True, exist_ok=True)
            if self.layout.tie_word_embeddings:
                weights.pop("lm_head.weight", None)
            save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
            for f in Path(self.model_path).iterdir():
                if (
                    f.is_file()
                    and not f.name.endswith((".safetensors", ".bin"))
                    and f.name != "model.safetensors.index.json"
                ):
                    shutil.copy2(f, out / f.name)
        return out

    # -- forward ------------------------------------------------------------------------------------
    def _autocast(self):
        dtype = compute_dtype(self.cfg)
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast("cuda" if self.device is not None else "cpu", dtype=dtype)

    def _full_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """[B, S, V/tp] vocab-parallel logits -> [B, S, vocab] (all ranks of the TP group, padding cut)."""
        if self.tp > 1:
            from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

            logits = gather_from_tensor_model_parallel_region(logits)
        return logits[..., : self.layout.vocab_size]

    def _step_fn(self, samples: dict[str, list], with_entropy: bool, on_logp):
        """Megatron's ``forward_step_func``: one micro-batch (a list of sample indices) through the model;
        its loss function turns the logits into response log-probs and hands them to ``on_logp``, which
        returns the micro-batch's loss."""

        def step(data_iterator, model):
            idx, real = next(data_iterator)
            # a stand-in (see _my_micro) goes through the model and back, contributing nothing
            use = on_logp if real else _contributes_nothing
            ids, _, plens, rlens = self._pad(samples, idx)
            dev = self.device or torch.device("cpu")
            if self.cp > 1:
                return self._cp_step(model, samples, idx, ids, plens, rlens, with_entropy, use, dev, real)
            if self.mcfg.sequence_parallel and ids.shape[1] % self.tp:  # SP splits the sequence over TP
                ids = self._pad_to(ids, -(-ids.shape[1] // self.tp) * self.tp)
            width = ids.shape[1]
            pos = torch.arange(width, device=dev).unsqueeze(0).expand(len(idx), -1)
            causal = torch.triu(torch.ones(width, width, dtype=torch.bool, device=dev), 1)[None, None]
            cols = self._sp_shard(torch.arange(width))
            replay = self._routing_replay(samples, idx, width, cols) if real else contextlib.nullcontext()
            with self._autocast(), replay:
                if self.front is not None:
                    out = self._mm_forward(model, samples, idx, ids, None, causal, dev)
                else:
                    out = model(input_ids=ids.to(dev), position_ids=pos, attention_mask=causal)

            def loss_func(output):
                logp, valid, _, ent = self._logp_from_logits(
                    self._full_vocab(output), ids, plens, rlens, with_entropy
                )
                loss = use(idx, logp, valid, rlens, ent)
                return loss, torch.ones((), dtype=torch.int, device=dev), {}

            return out, loss_func

        return step

    def _pad_to(self, ids: torch.Tensor, width: int) -> torch.Tensor:
        padded = torch.full((ids.shape[0], width), self.pad_token_id, dtype=ids.dtype)
        padded[:, : ids.shape[1]] = ids
        return padded

    def _mm_forward(self, model, samples, idx, ids, loc, mask, dev):
        """Qwen3-VL / Omni: the decoder on embeddings with the media features in place, 3-D positions and the
        DeepStack additions, built on the full (padded) rows ``ids`` and cut to this CP rank's positions
        ``loc`` (None: all of them)."""
        from relax_core.mm import collate_mm, token_types

        items = [samples["mm"][i] for i in idx] if "mm" in samples else [None] * len(idx)
        lengths = [len(samples["tokens"][i]) for i in idx]
        media = collate_mm(items) if any(items) else {}
        types = token_types(items, lengths, ids.shape[1], left=False)
        if self.pre:
            emb, pos, additions = self.front.inputs(ids, media, types, lengths, dev)
        else:  # a later pipeline stage: hidden states come from the previous one
            emb, additions = None, []
            pos = self.front.positions(ids, types, lengths, media).to(dev)
        if loc is not None:
            cut = loc.to(dev)
            pos, additions = pos[:, :, cut], [a[:, cut] for a in additions]
            emb = emb[:, cut] if emb is not None else None
        sp = self.mcfg.sequence_parallel
        self.front.additions = [self.front.decoder_input(a, sp) for a in additions]
        try:
            return model(
                input_ids=(ids if loc is None else ids[:, loc]).to(dev),
                position_ids=pos,
                attention_mask=mask,
                decoder_input=self.front.decoder_input(emb, sp) if emb is not None else None,
            )
        finally:
            self.front.additions = None

    def _sp_shard(self, cols: torch.Tensor) -> torch.Tensor:
        """The positions (of ``cols``, the rows' positions this rank feeds the model) whose tokens this rank's
        MoE routers see: under sequence parallelism its contiguous share of them, else all. What routing
        replay's records are cut to."""
        if not (self.mcfg.sequence_parallel and self.tp > 1):
            return cols
        from megatron.core import parallel_state as ps

        n = len(cols) // self.tp
        r = ps.get_tensor_model_parallel_rank()
        return cols[r * n : (r + 1) * n]

    def _cp_step(self, model, samples, idx, ids, plens, rlens, with_entropy, on_logp, dev, real=True):
        """One micro-batch under context parallelism: this rank's two chunks of every (padded) row go
        through the model, attending to the keys of the whole CP group; its per-token log-probs (and
        entropies) are gathered into whole rows, from which every CP rank computes the same loss."""
        from megatron.core import parallel_state as ps

        from relax_train.backends.megatron.context_parallel import (
            gather_token_values,
            gathered_positions,
            local_positions,
        )

        group = ps.get_context_parallel_group()
        multiple = 2 * self.cp * (self.tp if self.mcfg.sequence_parallel else 1)
        width = -(-ids.shape[1] // multiple) * multiple
        padded = self._pad_to(ids, width)
        loc = local_positions(width, self.cp, ps.get_context_parallel_rank())
        order = gathered_positions(width, self.cp)
        masked = (order[None, :] > loc[:, None])[None, None].to(dev)  # causal, in global positions
        pos = loc.to(dev).unsqueeze(0).expand(len(idx), -1)
        replay = (
            self._routing_replay(samples, idx, width, self._sp_shard(loc))
            if real
            else contextlib.nullcontext()
        )
        with self._autocast(), replay:
            if self.front is not None:
                out = self._mm_forward(model, samples, idx, padded, loc, masked, dev)
            else:
                out = model(input_ids=padded[:, loc].to(dev), position_ids=pos, attention_mask=masked)

        def loss_func(output):
            # the token each position predicts (the last one predicts padding: never a response token)
            targets = torch.cat([padded[:, 1:], padded[:, -1:]], dim=1)[:, loc].to(dev)
            logp, ent = self._token_logp(self._full_vocab(output), targets, with_entropy)
            logp = gather_token_values(logp, order, group)
            ent = gather_token_values(ent, order, group) if ent is not None else None
            rows, cols, valid = self._response_positions(plens, rlens, width, logp.device)
            resp_ent = ent[rows, cols] if ent is not None else None
            loss = on_logp(idx, logp[rows, cols], valid, rlens, resp_ent)
            return loss, torch.ones((), dtype=torch.int, device=dev), {}

        return out, loss_func

    def _my_micro(self, micro: list[list[int]]) -> list[tuple[list[int], bool]]:
        """This data-parallel replica's micro-batches of one batch: every ``dp``-th, from its rank on, each
        as ``(indices, real)``. Every replica runs the same number (at least one): with expert parallelism
        the replicas exchange tokens inside each MoE layer, so they must step together; a replica short of
        one runs a stand-in (a real micro-batch, ``real=False``) whose loss is zero."""
        from megatron.core import parallel_state as ps

        if not micro:
            return []
        dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        mine = [(m, True) for m in micro[rank::dp]]
        return mine + [(micro[0], False)] * (-(-len(micro) // dp) - len(mine))

    def _schedule(self, step, micro: list[list[int]], forward_only: bool) -> None:
        """Megatron's forward-backward schedule over this replica's share of ``micro``."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        mine = self._my_micro(micro)
        if not mine:
            return
        get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=iter(mine),
            model=[self.model],
            num_microbatches=len(mine),
            seq_length=0,  # variable_seq_lengths: shapes travel with each micro-batch
            micro_batch_size=max(len(m) for m, _ in mine),
            forward_only=forward_only,
        )

    @torch.no_grad()
    @onloaded
    def compute_log_probs(self, samples: dict[str, list]) -> list[np.ndarray]:
        from megatron.core import parallel_state as ps

        was_training = self.model.training
        self.model.eval()
        n, mbs = len(samples["tokens"]), self.cfg.train.micro_batch_size
        micro = [list(range(s, min(n, s + mbs))) for s in range(0, n, mbs)]
        out: dict[int, np.ndarray] = {}

        def keep(idx, logp, valid, rlens, ent):
            for k, (i, r) in enumerate(zip(idx, rlens)):
                out[i] = logp[k, :r].float().cpu().numpy().astype(np.float32)
            return logp.sum() * 0.0

        self._schedule(self._step_fn(samples, False, keep), micro, forward_only=True)
        self.model.train(was_training)
        if ps.get_data_parallel_world_size() > 1:  # each replica computed its micro-batches
            parts: list[Any] = [None] * ps.get_data_parallel_world_size()
            dist.all_gather_object(parts, out, group=ps.get_data_parallel_group())
            out = {i: v for part in parts for i, v in part.items()}
        out = self._from_last_stage(out)  # (the last stage computed them)
        return [out[i] for i in range(n)]

    def _from_last_stage(self, value: Any) -> Any:
        """Under pipeline parallelism, the last stage's ``value`` on every stage."""
        if self.pp == 1:
            return value
        from megatron.core import parallel_state as ps

        box = [value]
        group = ps.get_pipeline_model_parallel_group()
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, self.pp - 1), group=group)
        return box[0]

    # -- training -----------------------------------------------------------------------------------
    def train_step(self, samples: dict[str, list]) -> dict[str, float]:
        # the loss and its statistics exist on the last stage (the norm on all)
        return self._from_last_stage(super().train_step(samples))

    def _step_metrics(self, sums, counts, keep, loss_total, grad_norm, n_opt) -> dict[str, float]:
        """The step's statistics over every data-parallel replica's micro-batches."""
        from megatron.core import parallel_state as ps

        dp = ps.get_data_parallel_world_size()
        if dp > 1:
            parts: list[Any] = [None] * dp
            dist.all_gather_object(
                parts, (sums, counts, keep, loss_total), group=ps.get_data_parallel_group()
            )
            sums = {k: sum(p[0][k] for p in parts) for k in sums}
            counts = {k: sum(p[1].get(k, 0.0) for p in parts) for k in {k for p in parts for k in p[1]}}
            keep = {k: [t for p in parts for t in p[2][k]] for k in keep}
            loss_total = sum(p[3] for p in parts)
        return TorchBackend._step_metrics(sums, counts, keep, loss_total, grad_norm, n_opt)

    def _r3_metrics(self) -> dict[str, float]:
        """Routing replay's counts over the ranks that routed disjoint tokens: context-parallel ranks (each
        its chunks), tensor-parallel ranks under sequence parallelism (each its share of the sequence), the
        pipeline stages (each its own MoE layers) and the data-parallel replicas (each its micro-batches)."""
        from megatron.core import parallel_state as ps

        c = self._r3_counts
        split = [ps.get_context_parallel_group()] if self.cp > 1 else []
        if self.mcfg.sequence_parallel and self.tp > 1:
            split.append(ps.get_tensor_model_parallel_group())
        if self.pp > 1:
            split.append(ps.get_pipeline_model_parallel_group())
        for group in split:
            both = torch.tensor([c["replayed"], c["differ"]], dtype=torch.float64)
            dist.all_reduce(both, group=group)
            c["replayed"], c["differ"] = (float(v) for v in both)
        if ps.get_data_parallel_world_size() > 1:
            every = torch.tensor([c["replayed"], c["differ"], c["expected"]], dtype=torch.float64)
            dist.all_reduce(every, group=ps.get_data_parallel_group())
            c["replayed"], c["differ"], c["expected"] = (float(v) for v in every)
        return super()._r3_metrics()

    def _forward_backward(self, samples, micro, total_tokens, n_seqs, acc) -> float:
        total = [0.0]

        def loss(idx, logp, valid, rlens, ent):
            value = self._micro_loss(samples, idx, logp, valid, ent, total_tokens, n_seqs, acc)
            total[0] += float(value.detach())
            return value

        self._schedule(self._step_fn(samples, acc.with_entropy, loss), micro, forward_only=False)
        return total[0]

    def _fill_missing_grads(self) -> None:
        """Zero gradients where this data-parallel replica has none but another has one: its micro-batches
        never reached the parameter (a media encoder on text-only rows), and every replica must join the
        same gradient reductions. A parameter no replica reached keeps none (AdamW skips it, as it would
        on one rank)."""
        from megatron.core import parallel_state as ps

        group = ps.get_data_parallel_group(with_context_parallel=True)
        if dist.get_world_size(group) == 1:
            return
        params = [p for p in self.model.parameters() if p.requires_grad]
        has = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=self.device)
        dist.all_reduce(has, op=dist.ReduceOp.MAX, group=group)  # (the replicas' parameter lists align)
        for p, anywhere in zip(params, has.tolist()):
            if anywhere and p.grad is None:
                p.grad = torch.zeros_like(p)

    def _clip_and_step(self) -> float:
        """Megatron's gradient finalisation, then clip by the whole model's norm and step: QK-norm (and
        sequence-parallel norm) gradients are partial per TP rank and summed over TP; gradients are summed
        over the data-parallel replicas (each back-propagated its share of the batch: the expert-data-parallel
        group for experts, whose all-to-all already brought them the rest of their expert-parallel group's
        tokens); in the norm, TP-sharded and expert tensors are summed over their groups and replicated ones
        counted once."""
        from megatron.core import parallel_state as ps

        self._fill_missing_grads()
        if self.layout.tie_word_embeddings and self.pp > 1 and (self.pre or self.post):
            # tied embeddings under PP: the first stage's table and the last stage's output layer are one
            # weight; each copy gets the sum of both gradients (megatron's embedding group)
            shared = self.model.shared_embedding_or_output_weight()
            if shared.grad is None:
                shared.grad = torch.zeros_like(shared)
            dist.all_reduce(shared.grad, group=ps.get_embedding_group())
        named = [(n, p) for n, p in self.model.named_parameters() if p.grad is not None]
        if self.tp > 1:
            for name, p in named:
                seq_par = self.mcfg.sequence_parallel and getattr(p, "sequence_parallel", False)
                if seq_par or "q_layernorm" in name or "k_layernorm" in name:
                    dist.all_reduce(p.grad, group=ps.get_tensor_model_parallel_group())
        # context-parallel ranks hold parts of one gradient (their tokens), data-parallel replicas parts of
        # the batch's (their micro-batches, normalised by the whole batch): both summed
        dense = ps.get_data_parallel_group(with_context_parallel=True)
        for _, p in named:
            group = ps.get_expert_data_parallel_group() if not getattr(p, "allreduce", True) else dense
            if dist.get_world_size(group) > 1:
                dist.all_reduce(p.grad, group=group)
        dev = named[0][1].grad.device if named else None
        sq = {k: torch.zeros(1, dtype=torch.float64, device=dev) for k in ("tp", "rep", "expert")}
        for _, p in named:
            if getattr(p, "shared", False) and not self.pre:  # the tied weight's second copy: counted once
                continue
            kind = (
                "expert"
                if not getattr(p, "allreduce", True)
                else "tp"
                if getattr(p, "tensor_model_parallel", False)
                else "rep"
            )
            sq[kind] += p.grad.detach().double().pow(2).sum()
        if self.tp > 1:
            dist.all_reduce(sq["tp"], group=ps.get_tensor_model_parallel_group())
        if self.tp * self.ep > 1:
            dist.all_reduce(sq["expert"], group=ps.get_expert_tensor_and_model_parallel_group())
        total = sq["tp"] + sq["rep"] + sq["expert"]
        if self.pp > 1:
            dist.all_reduce(total, group=ps.get_pipeline_model_parallel_group())
        norm = float(total.sqrt())
        coef = self.cfg.train.clip_grad / (norm + 1e-6)
        if coef < 1.0:
            for _, p in named:
                p.grad.mul_(coef)
        if self._update_if_finite(norm):  # (the norm is the same on every rank: all skip, or none)
            self._share_owned()
        return norm

    # -- the optimizer ------------------------------------------------------------------------------
    def _set_trainable(self, trainable: bool) -> None:
        """AdamW as the torch backend builds it; with --use-distributed-optimizer, over the parameters this
        data-parallel replica owns (ZeRO-1). Each parameter is owned by one member of its replica group (the
        expert data-parallel group for experts), assigned greedily by size in the model's parameter order,
        which every member shares; after each step the owners send their parameters to the others."""
        super()._set_trainable(trainable)
        self._owned: list[tuple[torch.nn.Parameter, Any, int]] = []  # (param, group, owner's global rank)
        if not (trainable and self.cfg.train.use_distributed_optimizer):
            return
        from megatron.core import parallel_state as ps

        dense = ps.get_data_parallel_group(with_context_parallel=True)
        expert = ps.get_expert_data_parallel_group()
        loads = {id(dense): [0] * dist.get_world_size(dense), id(expert): [0] * dist.get_world_size(expert)}
        mine = []
        for p in self.model.parameters():
            group = dense if getattr(p, "allreduce", True) else expert
            load = loads[id(group)]
            owner = min(range(len(load)), key=lambda r: (load[r], r))
            load[owner] += p.numel()
            if len(load) > 1:
                self._owned.append((p, group, dist.get_global_rank(group, owner)))
            if owner == dist.get_rank(group):
                mine.append(p)
        self.optimizer = self._adamw(mine)

    def _share_owned(self) -> None:
        """After a distributed-optimizer step: every parameter from the replica that stepped it; gradients
        dropped (the optimizer's zero_grad reaches only the parameters it owns)."""
        for p, group, src in self._owned:
            dist.broadcast(p.data, src=src, group=group)
            p.grad = None

    # -- checkpoints --------------------------------------------------------------------------------
    def _optimizer_params(self) -> list[torch.nn.Parameter]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def _sharded_state(self) -> dict[str, Any]:
        """Model and AdamW moments as megatron ``ShardedTensor``s: each rank's shard with its place in the
        global tensor, so a checkpoint reloads under other TP / PP / EP sizes. The moments take their
        parameter's sharding (megatron's own helpers for non-distributed optimizers); AdamW's per-parameter
        step count is kept aside (one number: every parameter steps together)."""
        from megatron.core.dist_checkpointing.optimizer import (
            get_param_id_to_sharded_param_map,
            optim_state_to_sharding_state,
        )

        model = self.model.sharded_state_dict()
        state: dict[str, Any] = {"model": model}
        if self.trainable:
            for p in self._optimizer_params():  # (before the first step: the zero moments AdamW starts from)
                if not self.optimizer.state[p]:
                    self.optimizer.state[p].update(
                        step=torch.tensor(0.0), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p)
                    )
            optim = self.optimizer.state_dict()
            ids = get_param_id_to_sharded_param_map(model, self._optimizer_params())
            optim_state_to_sharding_state(optim, ids, exclude_keys=("step",))
            if self._owned:  # ZeRO-1: the owner's moments are the only copy (the DP part of their replica id)
                for moments in optim["state"].values():
                    for key, sh in moments.items():
                        rid = sh.replica_id
                        moments[key] = dataclasses.replace(
                            sh, replica_id=(*rid[:-1], 0) if isinstance(rid, tuple) else 0
                        )
            state["optimizer"] = optim
        return state

    def _adam_step(self) -> float:
        steps = [float(st["step"]) for st in self.optimizer.state.values() if "step" in st]
        return max(steps, default=0.0)

    @onloaded
    def save_checkpoint(self, path: str | Path, extra: dict[str, Any] | None = None) -> None:
        """A megatron distributed checkpoint under ``dist/`` (model and optimizer, sharded: loads under other
        parallel sizes), each rank's RNG states, the HF weights under ``model/`` and meta.json from rank 0."""
        from megatron.core import dist_checkpointing

        path = Path(path)
        (path / "dist").mkdir(parents=True, exist_ok=True)
        dist.barrier()
        dist_checkpointing.save(self._sharded_state(), str(path / "dist"))
        rank_state = {k: v for k, v in self._trainer_state().items() if k != "optimizer"}
        rank_state["adam_step"] = self._adam_step() if self.trainable else 0.0
        torch.save(rank_state, path / f"rng_rank{dist.get_rank():05d}.pt")
        self.export_hf(path / "model")
        if dist.get_rank() == 0:
            (path / "meta.json").write_text(json.dumps({"version": self.version, **(extra or {})}, indent=1))
        dist.barrier()

    @onloaded
    def load_checkpoint(self, path: str | Path) -> dict[str, Any]:
        path = Path(path)
        if not (path / "meta.json").is_file():
            raise FileNotFoundError(f"--load {path}: no checkpoint there (meta.json missing)")
        if not (path / "dist").is_dir():
            return self._load_per_rank_checkpoint(path)
        from megatron.core import dist_checkpointing

        loaded = dist_checkpointing.load(self._sharded_state(), str(path / "dist"))
        self.model.load_state_dict(
            {k: v for k, v in loaded["model"].items() if not k.endswith("._extra_state")}, strict=False
        )
        mine = path / f"rng_rank{dist.get_rank():05d}.pt"
        # a rank the writing run did not have (other parallel sizes) takes rank 0's RNG states
        rank_state = torch.load(mine if mine.is_file() else path / "rng_rank00000.pt", weights_only=False)
        if self.trainable:
            params = self._optimizer_params()
            step = torch.tensor(float(rank_state["adam_step"]))
            for pid, st in loaded["optimizer"]["state"].items():
                state = self.optimizer.state[params[pid]]
                state["exp_avg"].copy_(st["exp_avg"])
                state["exp_avg_sq"].copy_(st["exp_avg_sq"])
                state["step"] = step.clone()
        rank_state["optimizer"] = None  # (restored above)
        return self._restore_trainer_state(rank_state, path)

    def _load_per_rank_checkpoint(self, path: Path) -> dict[str, Any]:
        """Checkpoints of relax-train 0.5.0: one file per rank, same parallel sizes to reload."""
        mine = path / f"megatron_rank{dist.get_rank():05d}.pt"
        if not mine.is_file():
            raise FileNotFoundError(f"--load {path}: no megatron checkpoint for rank {dist.get_rank()} there")
        state = torch.load(mine, weights_only=False)
        if state["world_size"] != dist.get_world_size():
            raise ValueError(
                f"--load {path}: written by {state['world_size']} ranks, loading with {dist.get_world_size()}; "
                f"use the same parallel sizes (or load its HF weights from {path / 'model'})"
            )
        self.model.load_state_dict(state["model"], strict=False)
        return self._restore_trainer_state(state, path)
