"""The megatron backend's weights in HF names: this rank's shards loaded from full HF weights, and every
weight gathered back to rank 0 (for the rollout engines, the evaluator and HF exports). A part of
:class:`~relax_train.backends.megatron.backend.MegatronBackend` (and of the critic's value backend), apart so
the model's forward and training read on their own; the name mapping and tensor layouts are :mod:`~relax_train.backends.megatron.convert`'s.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from relax_core.hf_files import copy_serving_files
from relax_train.backends.megatron import multimodal as mm
from relax_train.backends.megatron.convert import hf_to_megatron_rank, megatron_to_hf
from relax_train.backends.megatron.net import MegatronNet

# The TE layer spec fuses the input / pre-MLP RMSNorm into the following linear (the converter's
# names); the local spec (no Transformer Engine: CPU, or GPUs without TE) keeps separate norms.
_TE_TO_LOCAL = (
    (".self_attention.linear_qkv.layer_norm_weight", ".input_layernorm.weight"),
    (".mlp.linear_fc1.layer_norm_weight", ".pre_mlp_layernorm.weight"),
)
_LAYER = "decoder.layers."


class MegatronWeights:
    """Load / gather / export of HF-named weights of a :class:`MegatronNet` (the policy backend's and the
    critic's part)."""

    def __init__(self, net: MegatronNet) -> None:
        self.net = net
        self._hf_eval: Any = None
        """The HF model :meth:`eval_model` fills (built on its first call)."""

    # -- layout -------------------------------------------------------------------------------------
    def to_local(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Converter (TE-spec, global-layer) names -> this stage's module names."""
        n_local = len(self.net.model.decoder.layers)
        out: dict[str, torch.Tensor] = {}
        for name, value in state.items():
            for te, local in _TE_TO_LOCAL:
                name = name.replace(te, local)
            if name.startswith(_LAYER):
                i, rest = name[len(_LAYER) :].split(".", 1)
                j = int(i) - self.net.layer_offset
                if not 0 <= j < n_local:
                    continue
                name = f"{_LAYER}{j}.{rest}"
            elif name.startswith("embedding.") and not self.net.pre:
                continue
            elif name.startswith(("decoder.final_layernorm", "output_layer")) and not self.net.post:
                continue
            out[name] = value
        return out

    def to_global(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for name, value in state.items():
            if name.endswith("._extra_state"):
                continue
            if name.startswith(_LAYER):
                i, rest = name[len(_LAYER) :].split(".", 1)
                name = f"{_LAYER}{int(i) + self.net.layer_offset}.{rest}"
            for te, local in _TE_TO_LOCAL:
                if local in name and (local != ".pre_mlp_layernorm.weight" or not self._moe_layer(name)):
                    name = name.replace(local, te)
            out[name] = value
        return out

    def _moe_layer(self, name: str) -> bool:
        i = int(name[len(_LAYER) :].split(".", 1)[0])
        return i in set(self.net.layout.moe_layers)

    # -- weights ------------------------------------------------------------------------------------
    def load_weights(self, tensors: dict[str, Any]) -> None:
        """Full HF-named weights (the trainer's broadcast, or a checkpoint) -> this rank's shards."""
        from megatron.core import parallel_state as ps

        hf = {k: torch.as_tensor(v) for k, v in tensors.items()}
        towers: dict[str, torch.Tensor] = {}
        if self.net.front is not None:
            hf, towers = mm.to_text_names(hf, self.net.front.family)
        mine = hf_to_megatron_rank(
            hf,
            self.net.layout,
            tp_rank=ps.get_tensor_model_parallel_rank(),
            ep_rank=ps.get_expert_model_parallel_rank(),
            tp_size=self.net.tp,
            ep_size=self.net.ep,
        )
        local = {**self.to_local(mine), **towers}
        if (
            self.net.layout.tie_word_embeddings and self.net.post and not self.net.pre
        ):  # the last stage's copy
            local["output_layer.weight"] = mine["embedding.word_embeddings.weight"]
        params = dict(self.net.model.named_parameters())
        missing = sorted(set(params) - set(local))
        if missing:
            raise ValueError(
                f"megatron backend: the converted weights lack {missing[:5]} (of {len(missing)}); the HF "
                f"checkpoint and the megatron model built from its config disagree"
            )
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(local[name].to(p.dtype))

    def _gather(self, t: torch.Tensor, group) -> list[torch.Tensor]:
        size = dist.get_world_size(group)
        if size == 1:
            return [t]
        parts = [torch.empty_like(t) for _ in range(size)]
        dist.all_gather(parts, t.contiguous(), group=group)
        return parts

    def named_weights(self) -> list[tuple[str, torch.Tensor]]:
        """Every weight in HF names (the rollout engines' and ActorFwd's format) on rank 0, in the dtype the
        rollout serves (``--dtype``); the other ranks return ``[]`` (they take part in the gathers).

        TP and EP shards are gathered per tensor within each stage; with PP, each stage's share goes to
        rank 0 bucket by bucket (:mod:`relax_train.backends.megatron.gather`), so no rank but rank 0 ever holds
        the whole model, and it holds it once, in host memory."""
        from megatron.core import parallel_state as ps

        from relax_train.backends.megatron.gather import gather_to_rank0

        dtype = getattr(torch, str(self.net.cfg.model.dtype))
        pp_group = ps.get_pipeline_model_parallel_group() if self.net.pp > 1 else None
        # the ranks whose shards reach rank 0: stage by stage, the members of rank 0's pipeline
        keep = dist.get_rank() == 0 if pp_group is None else 0 in dist.get_process_group_ranks(pp_group)
        state = self.to_global({n: p.detach() for n, p in self.net.model.named_parameters()})
        if (
            self.net.layout.tie_word_embeddings
        ):  # (under PP the last stage's copy of the first stage's embedding)
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
        grid: list[list[dict[str, torch.Tensor]]] = [
            [{} for _ in range(self.net.ep)] for _ in range(self.net.tp)
        ]
        towers: dict[str, torch.Tensor] = {}
        for key, t in items:
            if key[0] == "tower":
                towers[key[1]] = t
                continue
            t_rank, e_rank, name = key
            for e in range(self.net.ep) if e_rank is None else [e_rank]:
                grid[t_rank][e][name] = t
        hf = megatron_to_hf(grid, self.net.layout, include_tied_lm_head=False)  # as HF names tied params
        if self.net.front is not None:  # (the media encoders are replicated: every rank holds all of them)
            hf = mm.to_hf_names(hf, towers, self.net.front.family)
        return list(hf.items())

    def eval_model(self):
        """An HF model with the current weights, for the evaluator (which generates with HF models)."""
        from relax_core.models import load_model

        if self._hf_eval is None:
            self._hf_eval = load_model(self.net.model_path).eval()
        params = dict(self._hf_eval.named_parameters())
        with torch.no_grad():
            for name, value in self.named_weights():
                params[name].copy_(value)
        return self._hf_eval

    def export_hf(self, out_dir: str | Path) -> Path:
        """HF safetensors + the source config and tokenizer files (what rollout engines load)."""
        from safetensors.torch import save_file

        out = Path(out_dir)
        weights = {k: v.contiguous() for k, v in self.named_weights()}
        if dist.get_rank() == 0:
            out.mkdir(parents=True, exist_ok=True)
            if self.net.layout.tie_word_embeddings:
                weights.pop("lm_head.weight", None)
            save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
            copy_serving_files(self.net.model_path, out)  # config, tokenizer, processor, generation config
        return out
