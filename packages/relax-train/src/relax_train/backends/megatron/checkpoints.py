"""The megatron backend's checkpoints: model and AdamW as a megatron distributed checkpoint (sharded, so it
reloads under other TP / PP / EP sizes), each rank's RNG states, and the HF weights beside them. A part of
:class:`~relax_train.backends.megatron.backend.MegatronBackend`, given the parts whose state it saves."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from relax_train.backends.megatron.net import MegatronNet
from relax_train.backends.megatron.training import MegatronTraining
from relax_train.backends.megatron.weights import MegatronWeights
from relax_train.backends.state import restore_trainer_state, trainer_state


class MegatronCheckpoints:
    """Save and load of a :class:`MegatronNet`'s weights and its training part's optimizer."""

    def __init__(self, net: MegatronNet, weights: MegatronWeights, training: MegatronTraining) -> None:
        self.net, self.weights, self.training = net, weights, training

    def _optimizer_params(self) -> list[torch.nn.Parameter]:
        return [p for group in self.training.adamw().param_groups for p in group["params"]]

    def _sharded_state(self) -> dict[str, Any]:
        """Model and AdamW moments as megatron ``ShardedTensor``s: each rank's shard with its place in the
        global tensor, so a checkpoint reloads under other TP / PP / EP sizes. The moments take their
        parameter's sharding (megatron's own helpers for non-distributed optimizers); AdamW's per-parameter
        step count is kept aside (one number: every parameter steps together)."""
        from megatron.core.dist_checkpointing.optimizer import (
            get_param_id_to_sharded_param_map,
            optim_state_to_sharding_state,
        )

        model = self.net.model.sharded_state_dict()
        state: dict[str, Any] = {"model": model}
        if self.training.optimizer is not None:
            adamw = self.training.optimizer
            for p in self._optimizer_params():  # (before the first step: the zero moments AdamW starts from)
                if not adamw.state[p]:
                    adamw.state[p].update(
                        step=torch.tensor(0.0), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p)
                    )
            optim = adamw.state_dict()
            ids = get_param_id_to_sharded_param_map(model, self._optimizer_params())
            optim_state_to_sharding_state(optim, ids, exclude_keys=("step",))
            if (
                self.training.owned
            ):  # ZeRO-1: the owner's moments are the only copy (DP part of their replica id)
                for moments in optim["state"].values():
                    for key, sh in moments.items():
                        rid = sh.replica_id
                        moments[key] = dataclasses.replace(
                            sh, replica_id=(*rid[:-1], 0) if isinstance(rid, tuple) else 0
                        )
            state["optimizer"] = optim
        return state

    def _adam_step(self) -> float:
        if self.training.optimizer is None:
            return 0.0
        steps = [float(st["step"]) for st in self.training.optimizer.state.values() if "step" in st]
        return max(steps, default=0.0)

    def save(self, path: str | Path, version: int) -> None:
        """A megatron distributed checkpoint under ``dist/`` (model and optimizer, sharded: loads under other
        parallel sizes), each rank's RNG states, the HF weights under ``model/`` and meta.json (``version``)
        from rank 0."""
        from megatron.core import dist_checkpointing

        path = Path(path)
        (path / "dist").mkdir(parents=True, exist_ok=True)
        dist.barrier()
        dist_checkpointing.save(self._sharded_state(), str(path / "dist"))
        rank_state = {k: v for k, v in trainer_state(None).items() if k != "optimizer"}
        rank_state["adam_step"] = self._adam_step()
        torch.save(rank_state, path / f"rng_rank{dist.get_rank():05d}.pt")
        self.weights.export_hf(path / "model")
        if dist.get_rank() == 0:
            (path / "meta.json").write_text(json.dumps({"version": version}, indent=1))
        dist.barrier()

    def load(self, path: str | Path) -> dict[str, Any]:
        """Put back what :meth:`save` wrote (or a relax-train 0.5.0 per-rank checkpoint); its meta."""
        path = Path(path)
        if not (path / "meta.json").is_file():
            raise FileNotFoundError(f"--load {path}: no checkpoint there (meta.json missing)")
        if not (path / "dist").is_dir():
            return self._load_per_rank(path)
        from megatron.core import dist_checkpointing

        loaded = dist_checkpointing.load(self._sharded_state(), str(path / "dist"))
        self.net.model.load_state_dict(
            {k: v for k, v in loaded["model"].items() if not k.endswith("._extra_state")}, strict=False
        )
        mine = path / f"rng_rank{dist.get_rank():05d}.pt"
        # a rank the writing run did not have (other parallel sizes) takes rank 0's RNG states
        rank_state = torch.load(mine if mine.is_file() else path / "rng_rank00000.pt", weights_only=False)
        if self.training.optimizer is not None:
            params, adamw = self._optimizer_params(), self.training.optimizer
            step = torch.tensor(float(rank_state["adam_step"]))
            for pid, st in loaded["optimizer"]["state"].items():
                state = adamw.state[params[pid]]
                state["exp_avg"].copy_(st["exp_avg"])
                state["exp_avg_sq"].copy_(st["exp_avg_sq"])
                state["step"] = step.clone()
        rank_state["optimizer"] = None  # (restored above)
        return restore_trainer_state(rank_state, self.training.optimizer, path, self.net.cfg.train)

    def _load_per_rank(self, path: Path) -> dict[str, Any]:
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
        self.net.model.load_state_dict(state["model"], strict=False)
        return restore_trainer_state(state, self.training.optimizer, path, self.net.cfg.train)
