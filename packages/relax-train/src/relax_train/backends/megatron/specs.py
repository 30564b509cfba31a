"""Which parameters each side of the conversion has: HF keys and shapes, megatron names with their unsharded
shapes and tensor-parallel split rules, which expert lands on which EP rank, and the checks of a state dict
against them. Apart so the two directions in :mod:`~relax_train.backends.megatron.convert` share one table.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

from torch import Tensor

from relax_train.backends.megatron.layout import (
    ConversionError,
    ExpertFormat,
    MegatronLayout,
    check_parallel_sizes,
)

Split = Literal["rep", "col", "row", "glu"]


def hf_layer(i: int) -> str:
    return f"model.layers.{i}."


def mg_layer(i: int) -> str:
    return f"decoder.layers.{i}."


def _expert_name(layer: int, local: int, which: str, grouped: bool) -> str:
    prefix = f"{mg_layer(layer)}mlp.experts."
    return f"{prefix}{which}.weight{local}" if grouped else f"{prefix}local_experts.{local}.{which}.weight"


def hf_shapes(
    layout: MegatronLayout, expert_formats: Mapping[int, ExpertFormat], include_lm_head: bool
) -> dict[str, tuple[int, ...]]:
    h, hd, v = layout.hidden_size, layout.head_dim, layout.vocab_size
    q_out, kv_out = layout.num_attention_heads * hd, layout.num_query_groups * hd
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    moe = set(layout.moe_layers)
    for i in range(layout.num_layers):
        p = hf_layer(i)
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
    check_expert_format(expert_format)
    formats = dict.fromkeys(layout.moe_layers, expert_format)
    return hf_shapes(layout, formats, include_lm_head=include_tied_lm_head or not layout.tie_word_embeddings)


def global_megatron_specs(
    layout: MegatronLayout, padded_vocab: int
) -> list[tuple[Any, tuple[int, ...], Split]]:
    """Every megatron parameter with its unsharded shape and split rule, in model order.

    Keys are names, except experts: ``("expert", layer, global_index, "linear_fc1"|"linear_fc2")``.
    """
    h, hd = layout.hidden_size, layout.head_dim
    q_out = layout.num_attention_heads * hd
    qkv_out = (layout.num_attention_heads + 2 * layout.num_query_groups) * hd
    specs: list[tuple[Any, tuple[int, ...], Split]] = [
        ("embedding.word_embeddings.weight", (padded_vocab, h), "col")
    ]
    moe = set(layout.moe_layers)
    for i in range(layout.num_layers):
        p = mg_layer(i)
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


def shard_shape(shape: tuple[int, ...], split: Split, tp_size: int) -> tuple[int, ...]:
    if split in ("col", "glu"):
        return (shape[0] // tp_size, *shape[1:])
    if split == "row":
        return (shape[0], shape[1] // tp_size)
    return shape


def rank_names(
    layout: MegatronLayout,
    specs: Iterable[tuple[Any, tuple[int, ...], Split]],
    ep_rank: int,
    ep_size: int,
    grouped: bool,
) -> Iterable[tuple[str, Any, tuple[int, ...], Split]]:
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
    specs = global_megatron_specs(layout, layout.padded_vocab_size(tp_size, vocab_divisible_by))
    return {
        name: shard_shape(shape, split, tp_size)
        for name, _, shape, split in rank_names(layout, specs, 0, ep_size, grouped_experts)
    }


def check_expert_format(expert_format: str) -> None:
    if expert_format not in ("fused", "per_expert"):
        raise ConversionError(f"expert_format={expert_format!r}: use 'fused' or 'per_expert'")


def check_keys(
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


def check_shape(t: Any, key: str, expected: tuple[int, ...], where: str, hint: str) -> None:
    if not isinstance(t, Tensor):
        raise ConversionError(f"{where}: {key} is a {type(t).__name__}, not a torch.Tensor")
    if tuple(t.shape) != tuple(expected):
        raise ConversionError(
            f"{where}: {key} has shape {tuple(t.shape)}, expected {tuple(expected)} ({hint})"
        )


def _few(keys: Sequence[str], n: int = 5) -> str:
    more = f", ... ({len(keys) - n} more)" if len(keys) > n else ""
    return ", ".join(keys[:n]) + more


def layout_hint(layout: MegatronLayout) -> str:
    return (
        f"does the layout match the weights? num_layers={layout.num_layers}, hidden={layout.hidden_size}, "
        f"heads={layout.num_attention_heads}, query_groups={layout.num_query_groups}, "
        f"head_dim={layout.head_dim}, vocab={layout.vocab_size}, tied={layout.tie_word_embeddings}, "
        f"experts={layout.num_experts}, moe_layers={list(layout.moe_layers)}"
    )
