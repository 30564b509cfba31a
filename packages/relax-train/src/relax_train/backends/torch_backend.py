"""The torch training backend: an HF causal LM, AdamW, micro-batches, PPO-family losses.

The same class serves three roles: ``actor`` (trains), ``actor_fwd`` (recomputes log-probs with the
latest trainer weights) and ``reference`` (frozen). Log-probs are computed on right-padded
prompt+response sequences at the rollout temperature, so they match the rollout engine's.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from relax_core.config import RelaxConfig
from relax_train.algorithms.losses import entropy_from_logits, kl_k3, ppo_clip_loss


class TorchBackend:
    def __init__(self, config: RelaxConfig, model_path: str, trainable: bool = True) -> None:
        from transformers import AutoModelForCausalLM

        self.cfg = config
        torch.manual_seed(config.train.seed)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, config.model.dtype))
        self.pad_token_id = self.model.config.pad_token_id or 0
        self.temperature = config.rollout.rollout_temperature
        self.trainable = trainable
        self.version = 0
        if trainable:
            t = config.train
            self.optimizer = torch.optim.AdamW(
                self.model.parameters(), lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), weight_decay=t.weight_decay
            )
            self.model.train()
        else:
            self.model.eval()
            self.model.requires_grad_(False)

    # -- forward -------------------------------------------------------------------------------
    def _pad(self, samples: dict[str, list], idx: list[int]) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int]]:
        seqs = [np.asarray(samples["tokens"][i]) for i in idx]
        plens = [int(samples["prompt_len"][i]) for i in idx]
        rlens = [len(s) - p for s, p in zip(seqs, plens)]
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for row, s in enumerate(seqs):
            ids[row, : len(s)] = torch.from_numpy(s.astype(np.int64))
            mask[row, : len(s)] = 1
        return ids, mask, plens, rlens

    def _response_logp(self, samples, idx, with_entropy=False):
        """Padded [B, Rmax] log-probs of each response token (and entropies), plus response lengths."""
        ids, mask, plens, rlens = self._pad(samples, idx)
        logits = self.model(input_ids=ids, attention_mask=mask).logits.float() / self.temperature
        rmax = max(rlens)
        rows = torch.arange(len(idx)).unsqueeze(1)
        cols = torch.tensor([[p - 1 + j for j in range(rmax)] for p in plens]).clamp(max=ids.shape[1] - 2)
        resp_logits = logits[rows, cols]  # [B, Rmax, V]
        targets = ids[rows, cols + 1]
        logp = torch.log_softmax(resp_logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        valid = torch.tensor([[j < r for j in range(rmax)] for r in rlens])
        ent = entropy_from_logits(resp_logits) if with_entropy else None
        return logp, valid, rlens, ent

    @torch.no_grad()
    def compute_log_probs(self, samples: dict[str, list]) -> list[np.ndarray]:
        """Per-sample float32 log-probs of the response tokens under the current weights."""
        was_training = self.model.training
        self.model.eval()
        out: list[np.ndarray] = []
        n = len(samples["tokens"])
        mbs = self.cfg.train.micro_batch_size
        for start in range(0, n, mbs):
            idx = list(range(start, min(n, start + mbs)))
            logp, _, rlens, _ = self._response_logp(samples, idx)
            out.extend(logp[k, :r].numpy().astype(np.float32) for k, r in enumerate(rlens))
        self.model.train(was_training)
        return out

    # -- training ------------------------------------------------------------------------------
    def train_step(self, samples: dict[str, list]) -> dict[str, float]:
        """One rollout batch: one or more optimizer steps of --global-batch-size samples each."""
        if not self.trainable:
            raise RuntimeError("this backend was built frozen (actor_fwd/reference); it cannot train")
        a = self.cfg.algo
        n = len(samples["tokens"])
        gbs = min(self.cfg.effective_global_batch_size, n)
        mbs = self.cfg.train.micro_batch_size
        old_key = "log_probs" if "log_probs" in samples else "rollout_log_probs"
        sums: dict[str, float] = {"loss": 0.0, "pg_loss": 0.0, "kl": 0.0, "entropy": 0.0, "clipfrac": 0.0,
                                  "ratio_mean": 0.0, "grad_norm": 0.0, "tokens": 0.0}
        n_opt = 0
        self.model.train()
        for gstart in range(0, n, gbs):
            gidx = list(range(gstart, min(n, gstart + gbs)))
            total_tokens = float(sum(float(np.sum(samples["loss_mask"][i])) for i in gidx)) or 1.0
            self.optimizer.zero_grad(set_to_none=True)
            for mstart in range(0, len(gidx), mbs):
                idx = gidx[mstart : mstart + mbs]
                logp, valid, rlens, ent = self._response_logp(samples, idx, with_entropy=a.entropy_coef > 0)
                old = self._padded(samples[old_key], idx, logp.shape[1])
                adv = self._padded(samples["advantages"], idx, logp.shape[1])
                lmask = self._padded(samples["loss_mask"], idx, logp.shape[1]) * valid
                pg, st = ppo_clip_loss(logp, old, adv, a.eps_clip, a.eps_clip_high)
                tok_loss = pg
                if a.kl_coef > 0:
                    kl = kl_k3(logp, self._padded(samples["ref_log_probs"], idx, logp.shape[1]))
                    tok_loss = tok_loss + a.kl_coef * kl
                    sums["kl"] += float((kl.detach() * lmask).sum())
                if ent is not None:
                    tok_loss = tok_loss - a.entropy_coef * ent
                    sums["entropy"] += float((ent.detach() * lmask).sum())
                loss = (tok_loss * lmask).sum() / total_tokens
                loss.backward()
                sums["loss"] += float(loss.detach()) * total_tokens
                sums["pg_loss"] += float((pg.detach() * lmask).sum())
                sums["clipfrac"] += float((st["clipped"] * lmask).sum())
                sums["ratio_mean"] += float((st["ratio"] * lmask).sum())
                sums["tokens"] += float(lmask.sum())
            gn = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.train.clip_grad)
            sums["grad_norm"] += float(gn)
            self.optimizer.step()
            n_opt += 1
        self.version += 1
        tokens = sums.pop("tokens") or 1.0
        metrics = {k: v / tokens for k, v in sums.items() if k != "grad_norm"}
        metrics["grad_norm"] = sums["grad_norm"] / max(n_opt, 1)
        metrics["optimizer_steps"] = float(n_opt)
        return metrics

    @staticmethod
    def _padded(values: list, idx: list[int], width: int) -> torch.Tensor:
        out = torch.zeros((len(idx), width), dtype=torch.float32)
        for row, i in enumerate(idx):
            v = torch.tensor(np.asarray(values[i], dtype=np.float32))[:width]
            out[row, : len(v)] = v
        return out

    # -- weights and checkpoints ---------------------------------------------------------------
    def named_weights(self) -> list[tuple[str, torch.Tensor]]:
        return [(n, p.detach()) for n, p in self.model.named_parameters()]

    def load_weights(self, tensors: dict[str, Any], version: int) -> None:
        with torch.no_grad():
            params = dict(self.model.named_parameters())
            for name, value in tensors.items():
                params[name].copy_(torch.as_tensor(value))
        self.version = version

    def save_checkpoint(self, path: str | Path, extra: dict[str, Any] | None = None) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(path / "model")
        state = {"optimizer": self.optimizer.state_dict() if self.trainable else None,
                 "torch_rng": torch.get_rng_state(), "py_rng": random.getstate(), "np_rng": np.random.get_state()}
        torch.save(state, path / "trainer_state.pt")
        (path / "meta.json").write_text(json.dumps({"version": self.version, **(extra or {})}, indent=1))

    def load_checkpoint(self, path: str | Path) -> dict[str, Any]:
        from safetensors.torch import load_file

        path = Path(path)
        if not (path / "meta.json").is_file():
            raise FileNotFoundError(f"--load {path}: no checkpoint there (meta.json missing)")
        weights = load_file(str(path / "model" / "model.safetensors"))
        self.model.load_state_dict(weights, strict=False)
        state = torch.load(path / "trainer_state.pt", weights_only=False)
        if self.trainable and state["optimizer"] is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["torch_rng"])
        random.setstate(state["py_rng"])
        np.random.set_state(state["np_rng"])
        meta = json.loads((path / "meta.json").read_text())
        self.version = int(meta["version"])
        return meta
