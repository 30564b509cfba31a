"""Mixture-of-experts weights in the two HF layouts: fused (transformers >= 5 in memory) and one module per
expert (the checkpoints on the hub, and what SGLang's loaders read).

Why: both trainers export what transformers 5 holds, a MoE layer's experts fused —
``...mlp.experts.gate_up_proj`` ``[E, 2*I, H]`` (each expert's gate rows, then its up rows) and
``...mlp.experts.down_proj`` ``[E, H, I]``. SGLang's Qwen3-MoE loader maps only per-expert names
(``...mlp.experts.{j}.gate_proj.weight`` ``[I, H]``, ``up_proj``, ``down_proj`` ``[H, I]``) and skips any
other name without an error, so a fused update would leave its experts at the old weights; its Qwen3-Omni
loader takes fused tensors only as the hub's Qwen3-VL-MoE checkpoints store them (transposed), and would
split ours along the wrong axis. Per-expert names are what both read (``python/sglang/srt/models/
qwen3_moe.py`` and ``qwen3_omni_moe.py``, ``load_weights``), so the ``sglang`` engine sends those
(:func:`unfuse_experts`), and our engine server's torch engine takes them back (:func:`fuse_experts`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

FUSED = re.compile(r"^(?P<prefix>.*\.mlp\.experts\.)(?P<kind>gate_up_proj|down_proj)$")
PER_EXPERT = re.compile(
    r"^(?P<prefix>.*\.mlp\.experts\.)(?P<j>\d+)\.(?P<kind>gate_proj|up_proj|down_proj)\.weight$"
)


def unfuse_experts(tensors: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """``(name, tensor)`` pairs with every fused expert tensor split into per-expert checkpoint tensors (views,
    no copy); other pairs as they are."""
    for name, t in tensors:
        m = FUSED.match(name)
        if m is None or getattr(t, "ndim", 0) != 3:
            yield name, t
            continue
        prefix = m["prefix"]
        if m["kind"] == "gate_up_proj":
            half = t.shape[1] // 2
            for j in range(t.shape[0]):
                yield f"{prefix}{j}.gate_proj.weight", t[j, :half]
                yield f"{prefix}{j}.up_proj.weight", t[j, half:]
        else:
            for j in range(t.shape[0]):
                yield f"{prefix}{j}.down_proj.weight", t[j]


def fuse_experts(tensors: dict[str, Any], fused_names: Iterable[str]) -> dict[str, Any]:
    """The inverse for a model whose parameters include ``fused_names``: per-expert tensors of a layer
    stacked into its fused ones (all of a layer's experts must be there). Names the model does not hold
    fused pass through."""
    import torch

    fused = set(fused_names)
    out: dict[str, Any] = {}
    groups: dict[str, dict[tuple[str, int], Any]] = {}
    for name, t in tensors.items():
        m = PER_EXPERT.match(name)
        target = m and m["prefix"] + ("down_proj" if m["kind"] == "down_proj" else "gate_up_proj")
        if not m or target not in fused:
            out[name] = t
            continue
        groups.setdefault(target, {})[(m["kind"], int(m["j"]))] = torch.as_tensor(t)
    for target, parts in groups.items():
        kinds = ("down_proj",) if target.endswith("down_proj") else ("gate_proj", "up_proj")
        n = 1 + max(j for _, j in parts)
        missing = [f"{j}.{k}" for j in range(n) for k in kinds if (k, j) not in parts]
        if missing:
            raise KeyError(
                f"{target}: experts {missing[:4]} missing from the update (all of a layer's experts go together)"
            )
        if kinds == ("down_proj",):
            out[target] = torch.stack([parts[("down_proj", j)] for j in range(n)])
        else:
            out[target] = torch.stack(
                [torch.cat([parts[("gate_proj", j)], parts[("up_proj", j)]]) for j in range(n)]
            )
    return out
