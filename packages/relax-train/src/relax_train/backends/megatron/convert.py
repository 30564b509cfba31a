"""Hugging Face <-> megatron-core weight conversion for Qwen3 (dense) and Qwen3-MoE.

Pure torch on state dicts: megatron-core is not imported (nor needed). Megatron parameter names are
those of megatron-core's ``GPTModel`` built with the Transformer Engine layer spec
(``get_gpt_layer_with_transformer_engine_spec``), pipeline-parallel size 1 (so ``decoder.layers.{i}``
uses the global layer index) and RMSNorm.

Megatron state dict (every tensor ``[out_features, in_features]`` like ``torch.nn.Linear``)::

    embedding.word_embeddings.weight                          vocab-parallel, dim 0, vocab padded
    decoder.layers.{i}.self_attention.linear_qkv.layer_norm_weight   input RMSNorm, fused into TE linear
    decoder.layers.{i}.self_attention.linear_qkv.weight       column-parallel, per-query-group layout
    decoder.layers.{i}.self_attention.q_layernorm.weight      [head_dim], replicated
    decoder.layers.{i}.self_attention.k_layernorm.weight      [head_dim], replicated
    decoder.layers.{i}.self_attention.linear_proj.weight      row-parallel (dim 1)
    # dense layer
    decoder.layers.{i}.mlp.linear_fc1.layer_norm_weight       post-attention RMSNorm, fused into TE linear
    decoder.layers.{i}.mlp.linear_fc1.weight                  column-parallel, [gate; up] per rank
    decoder.layers.{i}.mlp.linear_fc2.weight                  row-parallel (dim 1)
    # MoE layer
    decoder.layers.{i}.pre_mlp_layernorm.weight               post-attention RMSNorm (separate TENorm)
    decoder.layers.{i}.mlp.router.weight                      [num_experts, hidden], replicated
    decoder.layers.{i}.mlp.experts.local_experts.{j}.linear_fc1.weight   SequentialMLP, or
    decoder.layers.{i}.mlp.experts.linear_fc1.weight{j}                  TEGroupedMLP (grouped GEMM)
    decoder.layers.{i}.mlp.experts.local_experts.{j}.linear_fc2.weight   (resp. linear_fc2.weight{j})
    decoder.final_layernorm.weight
    output_layer.weight                                       vocab-parallel, dim 0; absent when tied

``j`` is the *local* expert index on its expert-parallel rank: EP rank ``e`` holds global experts
``e * E/ep ... (e+1) * E/ep - 1`` (contiguous). Expert weights are split across tensor-parallel ranks
like the dense MLP (expert tensor-parallel size = ``tp_size``, megatron-core's default when
``expert_tensor_parallel_size`` is unset).

Layouts, checked against NVIDIA/Megatron-LM at tag ``core_v0.16.1`` (the ``megatron-core>=0.16.1``
this package pins) and at ``main`` (0.20.0, commit d98e8a6):

* ``megatron/core/models/gpt/gpt_layer_specs.py`` (``get_gpt_layer_with_transformer_engine_submodules``):
  ``linear_qkv=backend.column_parallel_layer_norm_linear()`` (TE ``LayerNormLinear``: the input norm is
  the ``layer_norm_weight`` of ``linear_qkv``), ``q_layernorm``/``k_layernorm`` when ``qk_layernorm``,
  ``pre_mlp_layernorm=backend.layer_norm() if num_experts else IdentityOp``; dense MLP
  (``get_mlp_module_spec_for_backend``) uses a layernorm-fused ``linear_fc1``, the MoE spec a plain
  column-parallel one. ``get_gpt_decoder_layer_specs`` picks MoE/dense per layer from
  ``moe_layer_freq`` (an int or a 0/1 list: see :attr:`MegatronLayout.moe_layer_pattern`).
* ``megatron/core/transformer/attention.py`` (``SelfAttention.get_query_key_value_tensors``): the
  ``linear_qkv`` output is viewed as ``[..., ng, (np/ng + 2) * hn]`` and split per query group into
  ``np/ng`` query heads, then one key head, then one value head ("q1 q2 k1 v1 | q3 q4 k2 v2 | ...");
  with ``num_query_groups >= tp`` each rank holds ``ng/tp`` whole groups, i.e. a contiguous dim-0 slice.
* ``megatron/core/transformer/mlp.py``: with ``gated_linear_unit`` ``linear_fc1`` has ``2 * ffn`` outputs
  and ``glu`` does ``x_glu, x_linear = torch.chunk(x, 2, dim=-1); act(x_glu) * x_linear`` on the *local*
  output, so each rank's shard is ``[gate_shard; up_shard]``; ``apply_swiglu_sharded_factory`` confirms
  the global tensor is ``[gate; up]`` with the two halves sharded separately.
* ``megatron/core/transformer/moe/experts.py``: ``SequentialMLP`` holds ``local_experts`` (a ModuleList of
  ``MLP``), ``TEGroupedMLP`` holds ``linear_fc1``/``linear_fc2`` TE ``GroupedLinear`` with parameters
  ``weight0 .. weight{n-1}``; both ``sharded_state_dict``s map local index ``i`` to global
  ``ep_rank * num_local_experts + i``. ``moe_layer.py``: ``num_local_experts = num_moe_experts // ep``.
* ``megatron/core/transformer/moe/router.py``: ``TopKRouter.weight`` is ``[num_moe_experts, hidden]``
  (not tensor-parallel).
* Vocab padding: ``megatron/training`` pads to a multiple of ``make_vocab_size_divisible_by (128) * tp``;
  ``VocabParallelEmbedding`` / the ``ColumnParallelLinear`` output layer split the padded vocab on dim 0.

Cross-checked (names only) against THUDM/slime ``megatron_to_hf/qwen2.py`` and Megatron-Bridge's
Qwen3-MoE mappings (``mlp.experts.linear_fc1.weight*`` / ``local_experts.*`` <-> ``gate_up_proj``).

The HF side is ``transformers``' ``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM`` ``state_dict()``. For MoE
layers transformers >= 5 stores fused experts (``mlp.experts.gate_up_proj`` ``[E, 2*moe_ffn, hidden]``
= ``[gate; up]`` per expert, ``mlp.experts.down_proj`` ``[E, hidden, moe_ffn]``); hub checkpoints (and
transformers 4) use one module per expert (``mlp.experts.{j}.gate_proj.weight`` ...). Both are accepted
as input; :func:`megatron_to_hf` writes either (``expert_format``).

Not handled: pipeline parallelism (layer-index offsets), attention/MLP biases, ``num_query_groups <
tp_size`` (megatron-core replicates KV heads then), an expert tensor-parallel size other than ``tp_size``,
shared experts, MTP layers. Output tensors may share storage with the input tensors.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

__all__ = [
    "ConversionError",
    "ExpertFormat",
    "MegatronLayout",
    "check_parallel_sizes",
    "hf_state_shapes",
    "hf_to_megatron",
    "hf_to_megatron_rank",
    "megatron_shard_shapes",
    "megatron_to_hf",
]

ExpertFormat = Literal["fused", "per_expert"]
_Split = Literal["rep", "col", "row", "glu"]
_EXTRA_STATE = "._extra_state"  # TE modules' fp8 metadata: not a weight, ignored on input


TEXT_MODEL_TYPES = ("qwen3", "qwen3_moe", "qwen3_vl_text", "qwen3_omni_moe_text")
"""HF ``model_type``s of the decoders this converter maps (Qwen3-VL's and Qwen3-Omni's text models have
Qwen3's and Qwen3-MoE's layers)."""


class ConversionError(ValueError):
    """A state dict, layout or parallel size that the conversion cannot handle (the message says why)."""


# --------------------------------------------------------------------------------------------------
# layout


@dataclass(frozen=True)
class MegatronLayout:
    """The shape facts the conversion needs, read from an HF config by :meth:`from_hf_config`.

    ``moe_layers`` lists the (0-based) layers whose MLP is a mixture of experts; the others are dense
    with ``ffn_hidden_size``. ``num_experts == 0`` means a dense model.
    """

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    qk_layernorm: bool = True
    num_experts: int = 0
    moe_ffn_hidden_size: int | None = None
    moe_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "head_dim"):
            _require_positive(name, getattr(self, name))
        _require_positive("ffn_hidden_size", self.ffn_hidden_size)
        _require_positive("vocab_size", self.vocab_size)
        if self.num_attention_heads % self.num_query_groups:
            raise ConversionError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_query_groups (num_key_value_heads)={self.num_query_groups}"
            )
        moe_layers = tuple(sorted(set(int(i) for i in self.moe_layers)))
        object.__setattr__(self, "moe_layers", moe_layers)
        bad = [i for i in moe_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ConversionError(f"moe_layers {bad} out of range for num_layers={self.num_layers}")
        if moe_layers:
            _require_positive("num_experts (MoE layers are set)", self.num_experts)
            _require_positive("moe_ffn_hidden_size (MoE layers are set)", self.moe_ffn_hidden_size or 0)

    @classmethod
    def from_hf_config(cls, config: Any) -> MegatronLayout:
        """Read a ``transformers`` ``Qwen3Config`` / ``Qwen3MoeConfig`` (or its ``config.json`` dict)."""

        def get(name: str, default: Any = None) -> Any:
            if isinstance(config, Mapping):
                value = config.get(name, default)
            else:
                value = getattr(config, name, default)
            return default if value is None else value

        def need(name: str) -> int:
            value = get(name)
            if value is None:
                raise ConversionError(f"HF config has no {name}; is it a Qwen3 / Qwen3-MoE config?")
            return int(value)

        model_type = get("model_type")
        if model_type is not None and model_type not in TEXT_MODEL_TYPES:
            raise ConversionError(
                f"model_type={model_type!r}: only Qwen3, Qwen3-MoE and the decoders of Qwen3-VL and Qwen3-Omni "
                f"({', '.join(TEXT_MODEL_TYPES)}) are supported by the megatron backend; train other models "
                "(Qwen3-VL-MoE, ...) with --train-backend torch"
            )
        if get("hidden_act", "silu") != "silu":
            raise ConversionError(
                f"hidden_act={get('hidden_act')!r}: only SwiGLU ('silu') MLPs are supported"
            )
        if get("attention_bias", False):
            raise ConversionError("attention_bias=True: biases are not supported by this converter")
        num_layers = need("num_hidden_layers")
        hidden = need("hidden_size")
        heads = need("num_attention_heads")
        num_experts = int(get("num_experts", 0) or get("num_local_experts", 0) or 0)
        moe_layers: tuple[int, ...] = ()
        if num_experts > 0:
            # transformers' Qwen3MoeDecoderLayer: sparse iff not in mlp_only_layers and
            # (layer_idx + 1) % decoder_sparse_step == 0
            mlp_only = set(get("mlp_only_layers", []) or [])
            step = int(get("decoder_sparse_step", 1))
            moe_layers = tuple(i for i in range(num_layers) if i not in mlp_only and (i + 1) % step == 0)
        return cls(
            num_layers=num_layers,
            hidden_size=hidden,
            num_attention_heads=heads,
            num_query_groups=int(get("num_key_value_heads", heads)),
            head_dim=int(get("head_dim", hidden // heads)),
            ffn_hidden_size=need("intermediate_size"),
            vocab_size=need("vocab_size"),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            qk_layernorm=True,  # Qwen3 always has per-head q_norm / k_norm
            num_experts=num_experts,
            moe_ffn_hidden_size=need("moe_intermediate_size") if num_experts > 0 else None,
            moe_layers=moe_layers,
        )

    @property
    def heads_per_group(self) -> int:
        """Query heads per query group (``np/ng`` in megatron-core)."""
        return self.num_attention_heads // self.num_query_groups

    @property
    def is_moe(self) -> bool:
        return bool(self.moe_layers)

    @property
    def moe_layer_pattern(self) -> list[int]:
        """megatron-core's ``moe_layer_freq`` as a list: 1 for a MoE layer, 0 for a dense one."""
        moe = set(self.moe_layers)
        return [1 if i in moe else 0 for i in range(self.num_layers)]

    def padded_vocab_size(self, tp_size: int = 1, vocab_divisible_by: int = 128) -> int:
        """The vocab size megatron pads to: a multiple of ``vocab_divisible_by * tp_size``."""
        _require_positive("vocab_divisible_by", vocab_divisible_by)
        _require_positive("tp_size", tp_size)
        multiple = vocab_divisible_by * tp_size
        return -(-self.vocab_size // multiple) * multiple


def _require_positive(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConversionError(f"{name} must be a positive int, got {value!r}")


def check_parallel_sizes(layout: MegatronLayout, tp_size: int = 1, ep_size: int = 1) -> None:
    """Raise :class:`ConversionError` naming the dimension when ``tp_size``/``ep_size`` cannot split it."""
    _require_positive("tp_size", tp_size)
    _require_positive("ep_size", ep_size)
    divisible = [
        ("num_attention_heads", layout.num_attention_heads, "tp_size", tp_size),
        ("num_query_groups (num_key_value_heads)", layout.num_query_groups, "tp_size", tp_size),
        ("ffn_hidden_size (intermediate_size)", layout.ffn_hidden_size, "tp_size", tp_size),
    ]
    if layout.is_moe:
        divisible += [
            ("num_experts", layout.num_experts, "ep_size", ep_size),
            ("moe_ffn_hidden_size (moe_intermediate_size)", layout.moe_ffn_hidden_size, "tp_size", tp_size),
        ]
    elif ep_size > 1:
        raise ConversionError(f"ep_size={ep_size} needs a MoE model, but the layout has no MoE layers")
    for what, n, size_name, size in divisible:
        if n % size:
            hint = ""
            if what.startswith("num_query_groups"):
                hint = (
                    " (megatron-core can replicate KV heads when tp_size > num_query_groups, but this "
                    "converter only places whole query groups on each rank)"
                )
            raise ConversionError(
                f"{what}={n} is not divisible by {size_name}={size}: choose a {size_name} that divides "
                f"{n}{hint}"
            )


# --------------------------------------------------------------------------------------------------
# names and shapes


def _hf_layer(i: int) -> str:
    return f"model.layers.{i}."


def _mg_layer(i: int) -> str:
    return f"decoder.layers.{i}."


def _expert_name(layer: int, local: int, which: str, grouped: bool) -> str:
    prefix = f"{_mg_layer(layer)}mlp.experts."
    return f"{prefix}{which}.weight{local}" if grouped else f"{prefix}local_experts.{local}.{which}.weight"


def _hf_shapes(
    layout: MegatronLayout, expert_formats: Mapping[int, ExpertFormat], include_lm_head: bool
) -> dict[str, tuple[int, ...]]:
    h, hd, v = layout.hidden_size, layout.head_dim, layout.vocab_size
    q_out, kv_out = layout.num_attention_heads * hd, layout.num_query_groups * hd
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    moe = set(layout.moe_layers)
    for i in range(layout.num_layers):
        p = _hf_layer(i)
        shapes[p + "self_attn.q_proj.weight"] = (q_out, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv_out, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv_out, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, q_out)
        if layout.qk_layernorm:
            shapes[p + "self_attn.q_norm.weight"] = (hd,)
            shapes[p + "self_attn.k_norm.weight"] = (hd,)
        if i in moe:
            e, f = layout.num_experts, layout.moe_ffn_hidden_size
            assert f is not None
            if expert_formats.get(i, "fused") == "fused":
                shapes[p + "mlp.experts.gate_up_proj"] = (e, 2 * f, h)
                shapes[p + "mlp.experts.down_proj"] = (e, h, f)
            else:
                for j in range(e):
                    shapes[p + f"mlp.experts.{j}.gate_proj.weight"] = (f, h)
                    shapes[p + f"mlp.experts.{j}.up_proj.weight"] = (f, h)
                    shapes[p + f"mlp.experts.{j}.down_proj.weight"] = (h, f)
            shapes[p + "mlp.gate.weight"] = (e, h)
        else:
            f = layout.ffn_hidden_size
            shapes[p + "mlp.gate_proj.weight"] = (f, h)
            shapes[p + "mlp.up_proj.weight"] = (f, h)
            shapes[p + "mlp.down_proj.weight"] = (h, f)
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
    shapes["model.norm.weight"] = (h,)
    if include_lm_head:
        shapes["lm_head.weight"] = (v, h)
    return shapes


def hf_state_shapes(
    layout: MegatronLayout, *, expert_format: ExpertFormat = "fused", include_tied_lm_head: bool = True
) -> dict[str, tuple[int, ...]]:
    """The HF state dict's keys and shapes, in ``state_dict()`` order.

    ``include_tied_lm_head``: with tied embeddings ``Module.state_dict()`` still lists ``lm_head.weight``
    (the embedding tensor) while a saved checkpoint does not.
    """
    _check_expert_format(expert_format)
    formats = dict.fromkeys(layout.moe_layers, expert_format)
    return _hf_shapes(layout, formats, include_lm_head=include_tied_lm_head or not layout.tie_word_embeddings)


def _global_megatron_specs(
    layout: MegatronLayout, padded_vocab: int
) -> list[tuple[Any, tuple[int, ...], _Split]]:
    """Every megatron parameter with its unsharded shape and split rule, in model order.

    Keys are names, except experts: ``("expert", layer, global_index, "linear_fc1"|"linear_fc2")``.
    """
    h, hd = layout.hidden_size, layout.head_dim
    q_out = layout.num_attention_heads * hd
    qkv_out = (layout.num_attention_heads + 2 * layout.num_query_groups) * hd
    specs: list[tuple[Any, tuple[int, ...], _Split]] = [
        ("embedding.word_embeddings.weight", (padded_vocab, h), "col")
    ]
    moe = set(layout.moe_layers)
    for i in range(layout.num_layers):
        p = _mg_layer(i)
        specs.append((p + "self_attention.linear_qkv.layer_norm_weight", (h,), "rep"))
        specs.append((p + "self_attention.linear_qkv.weight", (qkv_out, h), "col"))
        if layout.qk_layernorm:
            specs.append((p + "self_attention.q_layernorm.weight", (hd,), "rep"))
            specs.append((p + "self_attention.k_layernorm.weight", (hd,), "rep"))
        specs.append((p + "self_attention.linear_proj.weight", (h, q_out), "row"))
        if i in moe:
            f = layout.moe_ffn_hidden_size
            assert f is not None
            specs.append((p + "pre_mlp_layernorm.weight", (h,), "rep"))
            specs.append((p + "mlp.router.weight", (layout.num_experts, h), "rep"))
            for j in range(layout.num_experts):
                specs.append((("expert", i, j, "linear_fc1"), (2 * f, h), "glu"))
                specs.append((("expert", i, j, "linear_fc2"), (h, f), "row"))
        else:
            f = layout.ffn_hidden_size
            specs.append((p + "mlp.linear_fc1.layer_norm_weight", (h,), "rep"))
            specs.append((p + "mlp.linear_fc1.weight", (2 * f, h), "glu"))
            specs.append((p + "mlp.linear_fc2.weight", (h, f), "row"))
    specs.append(("decoder.final_layernorm.weight", (h,), "rep"))
    if not layout.tie_word_embeddings:
        specs.append(("output_layer.weight", (padded_vocab, h), "col"))
    return specs


def _shard_shape(shape: tuple[int, ...], split: _Split, tp_size: int) -> tuple[int, ...]:
    if split in ("col", "glu"):
        return (shape[0] // tp_size, *shape[1:])
    if split == "row":
        return (shape[0], shape[1] // tp_size)
    return shape


def _rank_names(
    layout: MegatronLayout,
    specs: Iterable[tuple[Any, tuple[int, ...], _Split]],
    ep_rank: int,
    ep_size: int,
    grouped: bool,
) -> Iterable[tuple[str, Any, tuple[int, ...], _Split]]:
    """(local name, spec key, global shape, split) of the parameters on EP rank ``ep_rank``."""
    per_rank = layout.num_experts // ep_size if layout.is_moe else 0
    for key, shape, split in specs:
        if isinstance(key, tuple):
            _, layer, j, which = key
            if j // per_rank != ep_rank:
                continue
            yield _expert_name(layer, j % per_rank, which, grouped), key, shape, split
        else:
            yield key, key, shape, split


def megatron_shard_shapes(
    layout: MegatronLayout,
    *,
    tp_size: int = 1,
    ep_size: int = 1,
    grouped_experts: bool = False,
    vocab_divisible_by: int = 128,
) -> dict[str, tuple[int, ...]]:
    """Keys and shapes of one rank's megatron state dict (the same on every TP/EP rank)."""
    check_parallel_sizes(layout, tp_size, ep_size)
    specs = _global_megatron_specs(layout, layout.padded_vocab_size(tp_size, vocab_divisible_by))
    return {
        name: _shard_shape(shape, split, tp_size)
        for name, _, shape, split in _rank_names(layout, specs, 0, ep_size, grouped_experts)
    }


# --------------------------------------------------------------------------------------------------
# tensor plumbing


def _interleave_qkv(q: Tensor, k: Tensor, v: Tensor, layout: MegatronLayout) -> Tensor:
    g, hd, h = layout.num_query_groups, layout.head_dim, q.shape[-1]
    groups = [q.reshape(g, layout.heads_per_group * hd, h), k.reshape(g, hd, h), v.reshape(g, hd, h)]
    return torch.cat(groups, dim=1).reshape(-1, h)


def _split_qkv(qkv: Tensor, layout: MegatronLayout) -> tuple[Tensor, Tensor, Tensor]:
    g, hd, h = layout.num_query_groups, layout.head_dim, qkv.shape[-1]
    per_group = qkv.reshape(g, (layout.heads_per_group + 2) * hd, h)
    q, k, v = torch.split(per_group, [layout.heads_per_group * hd, hd, hd], dim=1)
    return q.reshape(-1, h), k.reshape(-1, h), v.reshape(-1, h)


def _pad_rows(t: Tensor, rows: int) -> Tensor:
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])], dim=0)


def _rows(t: Tensor, n: int) -> Tensor:
    return t if t.shape[0] == n else t[:n]


def _own(t: Tensor) -> Tensor:
    """A contiguous tensor that is not a view (safe to save with safetensors next to its siblings)."""
    return (
        t.clone(memory_format=torch.contiguous_format) if t._base is not None or not t.is_contiguous() else t
    )


def _shard(t: Tensor, split: _Split, rank: int, size: int) -> Tensor:
    if split == "rep" or size == 1:
        return t
    if split == "col":
        return t.chunk(size, dim=0)[rank]
    if split == "row":
        return t.chunk(size, dim=1)[rank]
    gate, up = t.chunk(2, dim=0)
    return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]], dim=0)


def _unshard(parts: Sequence[Tensor], split: _Split) -> Tensor:
    if split == "rep" or len(parts) == 1:
        return parts[0]
    if split == "col":
        return torch.cat(list(parts), dim=0)
    if split == "row":
        return torch.cat(list(parts), dim=1)
    halves = [p.chunk(2, dim=0) for p in parts]
    return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)


def _check_expert_format(expert_format: str) -> None:
    if expert_format not in ("fused", "per_expert"):
        raise ConversionError(f"expert_format={expert_format!r}: use 'fused' or 'per_expert'")


def _check_keys(
    present: Iterable[str], expected: Mapping[str, tuple[int, ...]], where: str, hint: str
) -> None:
    present = set(present)
    missing = [k for k in expected if k not in present]
    unexpected = sorted(k for k in present if k not in expected)
    problems = []
    if missing:
        problems.append(f"missing {len(missing)} key(s): {_few(missing)}")
    if unexpected:
        problems.append(f"unexpected {len(unexpected)} key(s): {_few(unexpected)}")
    if problems:
        raise ConversionError(f"{where}: {'; '.join(problems)} ({hint})")


def _check_shape(t: Any, key: str, expected: tuple[int, ...], where: str, hint: str) -> None:
    if not isinstance(t, Tensor):
        raise ConversionError(f"{where}: {key} is a {type(t).__name__}, not a torch.Tensor")
    if tuple(t.shape) != tuple(expected):
        raise ConversionError(
            f"{where}: {key} has shape {tuple(t.shape)}, expected {tuple(expected)} ({hint})"
        )


def _few(keys: Sequence[str], n: int = 5) -> str:
    more = f", ... ({len(keys) - n} more)" if len(keys) > n else ""
    return ", ".join(keys[:n]) + more


def _layout_hint(layout: MegatronLayout) -> str:
    return (
        f"does the layout match the weights? num_layers={layout.num_layers}, hidden={layout.hidden_size}, "
        f"heads={layout.num_attention_heads}, query_groups={layout.num_query_groups}, "
        f"head_dim={layout.head_dim}, vocab={layout.vocab_size}, tied={layout.tie_word_embeddings}, "
        f"experts={layout.num_experts}, moe_layers={list(layout.moe_layers)}"
    )


# --------------------------------------------------------------------------------------------------
# HF -> Megatron


def _validate_hf(hf_state: Mapping[str, Tensor], layout: MegatronLayout) -> dict[int, ExpertFormat]:
    """Check keys and shapes; return the expert format found for each MoE layer."""
    formats: dict[int, ExpertFormat] = {
        i: "fused" if f"{_hf_layer(i)}mlp.experts.gate_up_proj" in hf_state else "per_expert"
        for i in layout.moe_layers
    }
    include_lm_head = not layout.tie_word_embeddings or "lm_head.weight" in hf_state
    expected = _hf_shapes(layout, formats, include_lm_head)
    hint = _layout_hint(layout)
    _check_keys(hf_state.keys(), expected, "HF state dict", hint)
    for key, shape in expected.items():
        _check_shape(hf_state[key], key, shape, "HF state dict", hint)
    if layout.tie_word_embeddings and "lm_head.weight" in hf_state:
        lm_head, embed = hf_state["lm_head.weight"], hf_state["model.embed_tokens.weight"]
        if lm_head is not embed and not torch.equal(lm_head, embed):
            raise ConversionError(
                "HF state dict: lm_head.weight differs from model.embed_tokens.weight but the layout ties "
                "them (tie_word_embeddings=True); drop lm_head.weight or use an untied layout"
            )
    return formats


def _hf_global_makers(
    hf: Mapping[str, Tensor], layout: MegatronLayout, padded_vocab: int, formats: Mapping[int, ExpertFormat]
) -> dict[Any, Callable[[], Tensor]]:
    """For each global megatron spec key, a function building the unsharded megatron tensor from HF."""
    makers: dict[Any, Callable[[], Tensor]] = {
        "embedding.word_embeddings.weight": lambda: _pad_rows(hf["model.embed_tokens.weight"], padded_vocab),
        "decoder.final_layernorm.weight": lambda: hf["model.norm.weight"],
    }
    if not layout.tie_word_embeddings:
        makers["output_layer.weight"] = lambda: _pad_rows(hf["lm_head.weight"], padded_vocab)
    moe = set(layout.moe_layers)
    for i in range(layout.num_layers):
        p, m = _hf_layer(i), _mg_layer(i)
        a = p + "self_attn."
        makers[m + "self_attention.linear_qkv.layer_norm_weight"] = lambda p=p: hf[
            p + "input_layernorm.weight"
        ]
        makers[m + "self_attention.linear_qkv.weight"] = lambda a=a: _interleave_qkv(
            hf[a + "q_proj.weight"], hf[a + "k_proj.weight"], hf[a + "v_proj.weight"], layout
        )
        makers[m + "self_attention.q_layernorm.weight"] = lambda a=a: hf[a + "q_norm.weight"]
        makers[m + "self_attention.k_layernorm.weight"] = lambda a=a: hf[a + "k_norm.weight"]
        makers[m + "self_attention.linear_proj.weight"] = lambda a=a: hf[a + "o_proj.weight"]
        if i in moe:
            makers[m + "pre_mlp_layernorm.weight"] = lambda p=p: hf[p + "post_attention_layernorm.weight"]
            makers[m + "mlp.router.weight"] = lambda p=p: hf[p + "mlp.gate.weight"]
            x = p + "mlp.experts."
            for j in range(layout.num_experts):
                if formats[i] == "fused":
                    fc1 = lambda x=x, j=j: hf[x + "gate_up_proj"][j]  # noqa: E731
                    fc2 = lambda x=x, j=j: hf[x + "down_proj"][j]  # noqa: E731
                else:
                    fc1 = lambda x=x, j=j: torch.cat(  # noqa: E731
                        [hf[f"{x}{j}.gate_proj.weight"], hf[f"{x}{j}.up_proj.weight"]], dim=0
                    )
                    fc2 = lambda x=x, j=j: hf[f"{x}{j}.down_proj.weight"]  # noqa: E731
                makers[("expert", i, j, "linear_fc1")] = fc1
                makers[("expert", i, j, "linear_fc2")] = fc2
        else:
            makers[m + "mlp.linear_fc1.layer_norm_weight"] = lambda p=p: hf[
                p + "post_attention_layernorm.weight"
            ]
            makers[m + "mlp.linear_fc1.weight"] = lambda p=p: torch.cat(
                [hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]], dim=0
            )
            makers[m + "mlp.linear_fc2.weight"] = lambda p=p: hf[p + "mlp.down_proj.weight"]
    return makers


class _Converter:
    """One validated HF -> megatron conversion: builds each unsharded tensor on demand and shards it."""

    def __init__(
        self,
        hf_state: Mapping[str, Tensor],
        layout: MegatronLayout,
        tp_size: int,
        ep_size: int,
        grouped_experts: bool,
        vocab_divisible_by: int,
    ) -> None:
        check_parallel_sizes(layout, tp_size, ep_size)
        formats = _validate_hf(hf_state, layout)
        padded = layout.padded_vocab_size(tp_size, vocab_divisible_by)
        self.layout, self.tp_size, self.ep_size, self.grouped = layout, tp_size, ep_size, grouped_experts
        self.specs = _global_megatron_specs(layout, padded)
        self.makers = _hf_global_makers(hf_state, layout, padded, formats)

    def names(self, ep_rank: int) -> Iterable[tuple[str, Any, tuple[int, ...], _Split]]:
        return _rank_names(self.layout, self.specs, ep_rank, self.ep_size, self.grouped)

    def shard(self, key: Any, split: _Split, tp_ranks: Sequence[int]) -> list[Tensor]:
        full = self.makers[key]()
        return [_own(_shard(full, split, t, self.tp_size)) for t in tp_ranks]


def hf_to_megatron(
    hf_state: Mapping[str, Tensor],
    layout: MegatronLayout,
    tp_size: int = 1,
    ep_size: int = 1,
    grouped_experts: bool = False,
    vocab_divisible_by: int = 128,
) -> list[list[dict[str, Tensor]]]:
    """Convert an HF Qwen3 / Qwen3-MoE state dict to megatron-core shards.

    Returns ``shards[tp_rank][ep_rank]``: the complete local state dict of that rank (non-expert
    tensors depend on ``tp_rank`` only and are the same objects for every ``ep_rank``; expert tensors
    use local indices). ``grouped_experts`` picks TEGroupedMLP names (``linear_fc1.weight{j}``) over
    SequentialMLP's (``local_experts.{j}.linear_fc1.weight``). The embedding and output layer are padded
    with zero rows to a multiple of ``vocab_divisible_by * tp_size`` (megatron's
    ``--make-vocab-size-divisible-by``). ``hf_state`` may omit ``lm_head.weight`` when embeddings are tied
    and may hold MoE experts fused (transformers >= 5) or per expert (hub checkpoints).
    """
    conv = _Converter(hf_state, layout, tp_size, ep_size, grouped_experts, vocab_divisible_by)
    tp_ranks = range(tp_size)
    per_key: dict[Any, list[Tensor]] = {}  # every TP shard of a tensor, built from one unsharded copy
    shards: list[list[dict[str, Tensor]]] = [[{} for _ in range(ep_size)] for _ in tp_ranks]
    for e in range(ep_size):
        for name, key, _, split in conv.names(e):
            if key not in per_key:
                per_key[key] = conv.shard(key, split, tp_ranks)
            for t in tp_ranks:
                shards[t][e][name] = per_key[key][t]
    return shards


def hf_to_megatron_rank(
    hf_state: Mapping[str, Tensor],
    layout: MegatronLayout,
    *,
    tp_rank: int,
    ep_rank: int = 0,
    tp_size: int = 1,
    ep_size: int = 1,
    grouped_experts: bool = False,
    vocab_divisible_by: int = 128,
) -> dict[str, Tensor]:
    """One rank's state dict, equal to ``hf_to_megatron(...)[tp_rank][ep_rank]`` without building the
    others (for loading on each rank)."""
    conv = _Converter(hf_state, layout, tp_size, ep_size, grouped_experts, vocab_divisible_by)
    if not 0 <= tp_rank < tp_size:
        raise ConversionError(f"tp_rank={tp_rank} is out of range for tp_size={tp_size}")
    if not 0 <= ep_rank < ep_size:
        raise ConversionError(f"ep_rank={ep_rank} is out of range for ep_size={ep_size}")
    return {name: conv.shard(key, split, [tp_rank])[0] for name, key, _, split in conv.names(ep_rank)}


# --------------------------------------------------------------------------------------------------
# Megatron -> HF

_SEQUENTIAL_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.\d+\.")
_GROUPED_EXPERT = re.compile(r"\.mlp\.experts\.linear_fc[12]\.weight\d+$")


def _as_grid(shards: Any) -> list[list[Mapping[str, Tensor]]]:
    if isinstance(shards, Mapping):
        return [[shards]]
    grid = list(shards)
    if not grid:
        raise ConversionError("megatron shards: empty; expected shards[tp_rank][ep_rank] state dicts")
    if all(isinstance(row, Mapping) for row in grid):
        return [[row] for row in grid]  # one state dict per TP rank, no expert parallelism
    grid = [list(row) for row in grid]
    ep_size = len(grid[0])
    for t, row in enumerate(grid):
        if len(row) != ep_size or not all(isinstance(sd, Mapping) for sd in row):
            raise ConversionError(
                f"megatron shards: shards[{t}] must be a list of {ep_size} state dicts (one per EP rank), "
                f"like shards[0]"
            )
    return grid


def _detect_grouped(sd: Mapping[str, Tensor]) -> bool:
    sequential = any(_SEQUENTIAL_EXPERT.search(k) for k in sd)
    grouped = any(_GROUPED_EXPERT.search(k) for k in sd)
    if sequential and grouped:
        raise ConversionError(
            "megatron shards mix SequentialMLP (local_experts.{j}.linear_fc1.weight) and TEGroupedMLP "
            "(linear_fc1.weight{j}) expert names; pass grouped_experts to say which is meant"
        )
    return grouped


def megatron_to_hf(
    shards: Sequence[Sequence[Mapping[str, Tensor]]] | Sequence[Mapping[str, Tensor]] | Mapping[str, Tensor],
    layout: MegatronLayout,
    *,
    vocab_divisible_by: int | None = 128,
    grouped_experts: bool | None = None,
    expert_format: ExpertFormat = "fused",
    include_tied_lm_head: bool = True,
    check_replicas: bool = True,
) -> dict[str, Tensor]:
    """Merge megatron-core shards back into an HF Qwen3 / Qwen3-MoE state dict.

    ``shards[tp_rank][ep_rank]`` as returned by :func:`hf_to_megatron` (a list of per-TP-rank dicts or
    a single dict are accepted too); tp/ep sizes are the grid's dimensions. ``grouped_experts=None``
    detects the expert naming from the keys. ``vocab_divisible_by=None`` accepts any vocab padding.
    Keys ending in ``._extra_state`` (Transformer Engine metadata) are ignored. With
    ``check_replicas`` every replicated copy (norms, router, non-expert weights on each EP rank) must
    equal the first. The result has exactly the keys of the HF model's ``state_dict()``
    (``expert_format="per_expert"`` for one module per expert; ``include_tied_lm_head=False`` to leave
    out ``lm_head.weight`` like a saved tied checkpoint).
    """
    _check_expert_format(expert_format)
    grid = _as_grid(shards)
    tp_size, ep_size = len(grid), len(grid[0])
    check_parallel_sizes(layout, tp_size, ep_size)
    grouped = _detect_grouped(grid[0][0]) if grouped_experts is None else grouped_experts
    hint = _layout_hint(layout) + f"; read as tp_size={tp_size}, ep_size={ep_size}"

    first = grid[0][0]
    if vocab_divisible_by is None:
        emb = first.get("embedding.word_embeddings.weight")
        if not isinstance(emb, Tensor) or emb.ndim != 2:
            raise ConversionError(
                f"megatron shards[0][0]: missing key embedding.word_embeddings.weight ({hint})"
            )
        padded = emb.shape[0] * tp_size
        if padded < layout.vocab_size:
            raise ConversionError(
                f"megatron shards: embedding.word_embeddings.weight has {padded} rows over {tp_size} TP "
                f"rank(s), fewer than vocab_size={layout.vocab_size}"
            )
    else:
        padded = layout.padded_vocab_size(tp_size, vocab_divisible_by)
        hint += f", vocab padded to {padded} (vocab_divisible_by={vocab_divisible_by})"
    specs = _global_megatron_specs(layout, padded)

    # keys and shapes of every rank
    for t in range(tp_size):
        for e in range(ep_size):
            sd, where = grid[t][e], f"megatron shards[{t}][{e}]"
            expected = {
                name: _shard_shape(shape, split, tp_size)
                for name, _, shape, split in _rank_names(layout, specs, e, ep_size, grouped)
            }
            _check_keys((k for k in sd if not k.endswith(_EXTRA_STATE)), expected, where, hint)
            for name, shape in expected.items():
                _check_shape(sd[name], name, shape, where, hint)

    merged: dict[Any, Tensor] = {}
    for e in range(ep_size):
        for name, key, _, split in _rank_names(layout, specs, e, ep_size, grouped):
            is_expert = isinstance(key, tuple)
            if not is_expert and e > 0:
                if check_replicas:
                    for t in range(tp_size):
                        _check_replica(
                            grid[t][e][name], grid[t][0][name], name, f"shards[{t}][{e}]", f"shards[{t}][0]"
                        )
                continue
            parts = [grid[t][e][name] for t in range(tp_size)]
            if split == "rep" and check_replicas:
                for t in range(1, tp_size):
                    _check_replica(parts[t], parts[0], name, f"shards[{t}][{e}]", f"shards[0][{e}]")
            merged[key] = _unshard(parts, split)

    return _global_to_hf(merged, layout, expert_format, include_tied_lm_head)


def _check_replica(t: Tensor, ref: Tensor, name: str, where: str, ref_where: str) -> None:
    if t is not ref and not torch.equal(t, ref):
        raise ConversionError(
            f"megatron {where}: {name} differs from its replica in {ref_where}; replicated weights must be "
            f"identical on every rank (pass check_replicas=False to take the first copy)"
        )


def _global_to_hf(
    mg: Mapping[Any, Tensor], layout: MegatronLayout, expert_format: ExpertFormat, include_tied_lm_head: bool
) -> dict[str, Tensor]:
    v = layout.vocab_size
    hf: dict[str, Tensor] = {"model.embed_tokens.weight": _rows(mg["embedding.word_embeddings.weight"], v)}
    moe = set(layout.moe_layers)
    for i in range(layout.num_layers):
        p, m = _hf_layer(i), _mg_layer(i)
        q, k, vv = _split_qkv(mg[m + "self_attention.linear_qkv.weight"], layout)
        hf[p + "self_attn.q_proj.weight"] = q
        hf[p + "self_attn.k_proj.weight"] = k
        hf[p + "self_attn.v_proj.weight"] = vv
        hf[p + "self_attn.o_proj.weight"] = mg[m + "self_attention.linear_proj.weight"]
        if layout.qk_layernorm:
            hf[p + "self_attn.q_norm.weight"] = mg[m + "self_attention.q_layernorm.weight"]
            hf[p + "self_attn.k_norm.weight"] = mg[m + "self_attention.k_layernorm.weight"]
        hf[p + "input_layernorm.weight"] = mg[m + "self_attention.linear_qkv.layer_norm_weight"]
        if i in moe:
            fc1 = [mg["expert", i, j, "linear_fc1"] for j in range(layout.num_experts)]
            fc2 = [mg["expert", i, j, "linear_fc2"] for j in range(layout.num_experts)]
            if expert_format == "fused":
                hf[p + "mlp.experts.gate_up_proj"] = torch.stack(fc1)
                hf[p + "mlp.experts.down_proj"] = torch.stack(fc2)
            else:
                for j in range(layout.num_experts):
                    gate, up = fc1[j].chunk(2, dim=0)
                    hf[p + f"mlp.experts.{j}.gate_proj.weight"] = gate
                    hf[p + f"mlp.experts.{j}.up_proj.weight"] = up
                    hf[p + f"mlp.experts.{j}.down_proj.weight"] = fc2[j]
            hf[p + "mlp.gate.weight"] = mg[m + "mlp.router.weight"]
            hf[p + "post_attention_layernorm.weight"] = mg[m + "pre_mlp_layernorm.weight"]
        else:
            gate, up = mg[m + "mlp.linear_fc1.weight"].chunk(2, dim=0)
            hf[p + "mlp.gate_proj.weight"] = gate
            hf[p + "mlp.up_proj.weight"] = up
            hf[p + "mlp.down_proj.weight"] = mg[m + "mlp.linear_fc2.weight"]
            hf[p + "post_attention_layernorm.weight"] = mg[m + "mlp.linear_fc1.layer_norm_weight"]
    hf["model.norm.weight"] = mg["decoder.final_layernorm.weight"]
    hf = {k: _own(t) for k, t in hf.items()}
    if not layout.tie_word_embeddings:
        hf["lm_head.weight"] = _own(_rows(mg["output_layer.weight"], v))
    elif include_tied_lm_head:
        hf["lm_head.weight"] = hf["model.embed_tokens.weight"]  # the same tensor, as in the tied HF model
    order = hf_state_shapes(layout, expert_format=expert_format, include_tied_lm_head=include_tied_lm_head)
    return {key: hf[key] for key in order}
