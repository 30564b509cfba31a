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

This module holds the two directions; what they share lives beside it: the layout read from the HF config
(:mod:`~relax_train.backends.megatron.layout`), the parameter tables (names, shapes, split rules:
:mod:`~relax_train.backends.megatron.specs`) and the per-tensor rules above (QKV interleave, ``[gate; up]``
halves, sharding: :mod:`~relax_train.backends.megatron.tensors`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from relax_train.backends.megatron.layout import (
    ConversionError,
    ExpertFormat,
    MegatronLayout,
    check_parallel_sizes,
)
from relax_train.backends.megatron.specs import (
    Split,
    check_expert_format,
    check_keys,
    check_shape,
    global_megatron_specs,
    hf_layer,
    hf_shapes,
    hf_state_shapes,
    layout_hint,
    megatron_shard_shapes,
    mg_layer,
    rank_names,
    shard_shape,
)
from relax_train.backends.megatron.tensors import (
    first_rows,
    interleave_qkv,
    owned,
    rows_padded_to,
    split_qkv,
    tp_shard,
    unshard,
)

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

_EXTRA_STATE = "._extra_state"  # TE modules' fp8 metadata: not a weight, ignored on input


# --------------------------------------------------------------------------------------------------
# HF -> Megatron


def _validate_hf(hf_state: Mapping[str, Tensor], layout: MegatronLayout) -> dict[int, ExpertFormat]:
    """Check keys and shapes; return the expert format found for each MoE layer."""
    formats: dict[int, ExpertFormat] = {
        i: "fused" if f"{hf_layer(i)}mlp.experts.gate_up_proj" in hf_state else "per_expert"
        for i in layout.moe_layers
    }
    include_lm_head = not layout.tie_word_embeddings or "lm_head.weight" in hf_state
    expected = hf_shapes(layout, formats, include_lm_head)
    hint = layout_hint(layout)
    check_keys(hf_state.keys(), expected, "HF state dict", hint)
    for key, shape in expected.items():
        check_shape(hf_state[key], key, shape, "HF state dict", hint)
    if layout.tie_word_embeddings and "lm_head.weight" in hf_state:
        lm_head, embed = hf_state["lm_head.weight"], hf_state["model.embed_tokens.weight"]
        if lm_head is not embed and not torch.equal(lm_head, embed):
            raise ConversionError(
                "HF state dict: lm_head.weight differs from model.embed_tokens.weight but the layout ties "
                "them (tie_word_embeddings=True); drop lm_head.weight or use an untied layout"
            )
    return formats


def _read(hf: Mapping[str, Tensor], key: str, row: int | None = None) -> Callable[[], Tensor]:
    """A maker of the HF tensor ``key`` (its ``row``-th slice if given), read only when called."""
    return lambda: hf[key] if row is None else hf[key][row]


def _read_cat(hf: Mapping[str, Tensor], *keys: str) -> Callable[[], Tensor]:
    """A maker of the HF tensors ``keys`` stacked along dim 0 (megatron's fused ``[gate; up]``)."""
    return lambda: torch.cat([hf[k] for k in keys], dim=0)


def _read_qkv(hf: Mapping[str, Tensor], a: str, layout: MegatronLayout) -> Callable[[], Tensor]:
    """A maker of one layer's megatron ``linear_qkv`` from the HF q/k/v projections under ``a``."""
    return lambda: interleave_qkv(
        hf[a + "q_proj.weight"], hf[a + "k_proj.weight"], hf[a + "v_proj.weight"], layout
    )


def _hf_global_makers(
    hf: Mapping[str, Tensor], layout: MegatronLayout, padded_vocab: int, formats: Mapping[int, ExpertFormat]
) -> dict[Any, Callable[[], Tensor]]:
    """For each global megatron spec key, a function building the unsharded megatron tensor from HF."""
    makers: dict[Any, Callable[[], Tensor]] = {
        "embedding.word_embeddings.weight": lambda: rows_padded_to(
            hf["model.embed_tokens.weight"], padded_vocab
        ),
        "decoder.final_layernorm.weight": lambda: hf["model.norm.weight"],
    }
    if not layout.tie_word_embeddings:
        makers["output_layer.weight"] = lambda: rows_padded_to(hf["lm_head.weight"], padded_vocab)
    moe = set(layout.moe_layers)
    for i in range(layout.num_layers):
        p, m = hf_layer(i), mg_layer(i)
        a = p + "self_attn."
        makers[m + "self_attention.linear_qkv.layer_norm_weight"] = _read(hf, p + "input_layernorm.weight")
        makers[m + "self_attention.linear_qkv.weight"] = _read_qkv(hf, a, layout)
        makers[m + "self_attention.q_layernorm.weight"] = _read(hf, a + "q_norm.weight")
        makers[m + "self_attention.k_layernorm.weight"] = _read(hf, a + "k_norm.weight")
        makers[m + "self_attention.linear_proj.weight"] = _read(hf, a + "o_proj.weight")
        if i in moe:
            makers[m + "pre_mlp_layernorm.weight"] = _read(hf, p + "post_attention_layernorm.weight")
            makers[m + "mlp.router.weight"] = _read(hf, p + "mlp.gate.weight")
            x = p + "mlp.experts."
            for j in range(layout.num_experts):
                if formats[i] == "fused":
                    fc1 = _read(hf, x + "gate_up_proj", j)
                    fc2 = _read(hf, x + "down_proj", j)
                else:
                    fc1 = _read_cat(hf, f"{x}{j}.gate_proj.weight", f"{x}{j}.up_proj.weight")
                    fc2 = _read(hf, f"{x}{j}.down_proj.weight")
                makers[("expert", i, j, "linear_fc1")] = fc1
                makers[("expert", i, j, "linear_fc2")] = fc2
        else:
            makers[m + "mlp.linear_fc1.layer_norm_weight"] = _read(hf, p + "post_attention_layernorm.weight")
            makers[m + "mlp.linear_fc1.weight"] = _read_cat(
                hf, p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"
            )
            makers[m + "mlp.linear_fc2.weight"] = _read(hf, p + "mlp.down_proj.weight")
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
        self.specs = global_megatron_specs(layout, padded)
        self.makers = _hf_global_makers(hf_state, layout, padded, formats)

    def names(self, ep_rank: int) -> Iterable[tuple[str, Any, tuple[int, ...], Split]]:
        return rank_names(self.layout, self.specs, ep_rank, self.ep_size, self.grouped)

    def shard(self, key: Any, split: Split, tp_ranks: Sequence[int]) -> list[Tensor]:
        full = self.makers[key]()
        return [owned(tp_shard(full, split, t, self.tp_size)) for t in tp_ranks]


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
    check_expert_format(expert_format)
    grid = _as_grid(shards)
    tp_size, ep_size = len(grid), len(grid[0])
    check_parallel_sizes(layout, tp_size, ep_size)
    grouped = _detect_grouped(grid[0][0]) if grouped_experts is None else grouped_experts
    hint = layout_hint(layout) + f"; read as tp_size={tp_size}, ep_size={ep_size}"

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
    specs = global_megatron_specs(layout, padded)

    # keys and shapes of every rank
    for t in range(tp_size):
        for e in range(ep_size):
            sd, where = grid[t][e], f"megatron shards[{t}][{e}]"
            expected = {
                name: shard_shape(shape, split, tp_size)
                for name, _, shape, split in rank_names(layout, specs, e, ep_size, grouped)
            }
            check_keys((k for k in sd if not k.endswith(_EXTRA_STATE)), expected, where, hint)
            for name, shape in expected.items():
                check_shape(sd[name], name, shape, where, hint)

    merged: dict[Any, Tensor] = {}
    for e in range(ep_size):
        for name, key, _, split in rank_names(layout, specs, e, ep_size, grouped):
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
            merged[key] = unshard(parts, split)

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
    hf: dict[str, Tensor] = {
        "model.embed_tokens.weight": first_rows(mg["embedding.word_embeddings.weight"], v)
    }
    moe = set(layout.moe_layers)
    for i in range(layout.num_layers):
        p, m = hf_layer(i), mg_layer(i)
        q, k, vv = split_qkv(mg[m + "self_attention.linear_qkv.weight"], layout)
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
    hf = {k: owned(t) for k, t in hf.items()}
    if not layout.tie_word_embeddings:
        hf["lm_head.weight"] = owned(first_rows(mg["output_layer.weight"], v))
    elif include_tied_lm_head:
        hf["lm_head.weight"] = hf["model.embed_tokens.weight"]  # the same tensor, as in the tied HF model
    order = hf_state_shapes(layout, expert_format=expert_format, include_tied_lm_head=include_tied_lm_head)
    return {key: hf[key] for key in order}
