"""The torch training backend: an HF causal LM, AdamW, micro-batches, the policy losses of
:mod:`relax_train.algorithms` chosen by config.

The same class serves three roles: ``actor`` (trains), ``actor_fwd`` (recomputes log-probs with the
latest trainer weights) and ``reference`` (frozen). Log-probs are computed on right-padded
prompt+response sequences at the rollout temperature, so they match the rollout engine's.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from relax_core.config import RelaxConfig
from relax_core.models import MASKED_LOGIT
from relax_core.offload import HostOffload, onloaded
from relax_train.algorithms.aggregation import aggregate_loss, entropy_bonus
from relax_train.algorithms.correction import mismatch_metrics, truncated_is_weights
from relax_train.algorithms.losses import (
    POLICY_LOSSES,
    LossParams,
    entropy_from_logits,
    kl_penalty,
    loss_kl_estimator,
)
from relax_train.backends.micro import plan_micro_batches, sample_lengths


@dataclass
class _StepAcc:
    """What one train_step's micro-batches share: the loss choices for this batch and the statistics
    they add up."""

    loss_fn: Any
    params: LossParams
    old_key: str | None
    """The field the ratio's denominator comes from; None: the training forward's own log-probs (π_prox
    of a batch trained in one optimizer step)."""
    has_prox: bool
    has_behav: bool
    kl_loss: bool
    distill: str | None
    with_entropy: bool
    first_step: bool = True
    """Whether the micro-batches now running belong to the batch's first optimizer step (whose forward runs
    with π_prox's weights: ``train/prox_gap_max`` is measured there)."""
    sums: dict[str, float] = field(default_factory=dict)
    counts: dict[str, float] = field(default_factory=dict)  # fractions of tokens: clipped, dual-clipped, ...
    keep: dict[str, list[torch.Tensor]] = field(default_factory=dict)

    @classmethod
    def start(cls, backend: TorchBackend, samples: dict[str, list]) -> _StepAcc:
        a = backend.cfg.algo
        # π_prox: ActorFwd's log-probs, or (``prox_from_forward``) the training forward's own, or both
        has_prox = "log_probs" in samples or "prox_from_forward" in samples
        distill = a.distill_mode if "teacher_log_probs" in samples else None
        acc = cls(
            loss_fn=POLICY_LOSSES[a.policy_loss],
            params=backend._loss_params(),
            old_key="log_probs" if "log_probs" in samples else None if has_prox else "rollout_log_probs",
            has_prox=has_prox,
            has_behav="rollout_log_probs" in samples,
            kl_loss=a.uses_reference and a.use_kl_loss and "ref_log_probs" in samples,
            distill=distill,
            with_entropy=a.entropy_coef > 0,
            sums={"pg_loss": 0.0, "kl": 0.0, "entropy": 0.0, "tokens": 0.0},
            keep={"ratio": [], "train": [], "rollout": [], "tis": [], "prox_gap": []},
        )
        if distill:
            acc.sums["distill_kl"] = 0.0
        return acc


_DROPOUT_FIELDS = (
    "attention_dropout",
    "hidden_dropout",
    "dropout",
    "attn_pdrop",
    "resid_pdrop",
    "embd_pdrop",
)


def _has_dropout(model: Any) -> bool:
    """Whether ``model`` in train mode is random (a dropout rate > 0 in its text config or a module): its
    training forward then is not π_θ's log-probs, so π_prox cannot come from it."""
    cfg = model.config.get_text_config()
    rates = [getattr(cfg, k, 0.0) for k in _DROPOUT_FIELDS]
    if any(isinstance(r, (int, float)) and r > 0 for r in rates):
        return True
    return any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules())


class TorchBackend:
    stochastic_forward: bool = False
    """The training forward draws dropout masks (see :func:`_has_dropout`); megatron runs without dropout."""
    before_update: Callable[[], None] | None = None
    """Called just before the optimizer writes the weights: the trainer's fence for a weight broadcast
    still reading them (:class:`~relax_train.roles.actor.ActorWorker` with ``overlap_weight_sync``)."""

    def __init__(self, config: RelaxConfig, model_path: str, trainable: bool = True) -> None:
        from relax_core.models import load_model, media_token_ids
        from relax_core.routing import install_routing

        self.cfg = config
        self.model_path = model_path  # (its tokenizer and configs go into every checkpoint's model/)
        torch.manual_seed(config.train.seed)
        self.model = load_model(model_path, config.model.dtype)  # causal LM, or a Qwen-VL/Omni model
        self.masked_token_ids = media_token_ids(self.model)
        self.takes_token_types = "mm_token_type_ids" in inspect.signature(self.model.forward).parameters
        self.routing = install_routing(self.model)  # MoE blocks: routing replay (R3); None for dense models
        self._r3_counts = {"replayed": 0.0, "expected": 0.0, "differ": 0.0}
        cfg = self.model.config  # multimodal configs keep text settings in text_config
        self.pad_token_id = (
            getattr(cfg, "pad_token_id", None) or getattr(cfg.get_text_config(), "pad_token_id", 0) or 0
        )
        self.temperature = config.rollout.rollout_temperature
        self.stochastic_forward = _has_dropout(self.model)
        self._set_trainable(trainable)

    def _set_trainable(self, trainable: bool) -> None:
        """AdamW over the model's parameters and train mode, or a frozen model in eval mode."""
        self.trainable = trainable
        self.version = 0
        if trainable:
            self.optimizer = self._adamw(self.model.parameters())
            self.model.train()
        else:
            self.model.eval()
            self.model.requires_grad_(False)

    def _adamw(self, params) -> torch.optim.AdamW:
        """AdamW over ``params`` with the run's learning rate, betas and weight decay."""
        t = self.cfg.train
        return torch.optim.AdamW(
            params, lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), weight_decay=t.weight_decay
        )

    # -- forward -------------------------------------------------------------------------------
    def _pad(
        self, samples: dict[str, list], idx: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int]]:
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

    def _media(self, samples: dict[str, list], idx: list[int], ids: torch.Tensor) -> dict[str, Any]:
        """Multimodal inputs of a micro-batch (``mm`` field: media tensors + prompt token types), batched
        as the rollout engine batches them (``relax_core.mm``); {} for text."""
        items = [samples["mm"][i] for i in idx] if "mm" in samples else []
        if not any(items):
            return {}
        from relax_core.mm import collate_mm, token_types

        extra = collate_mm(items)
        if self.takes_token_types:
            lengths = [len(samples["tokens"][i]) for i in idx]
            extra["mm_token_type_ids"] = token_types(items, lengths, ids.shape[1], left=False)
        return extra

    def _response_logp(self, samples, idx, with_entropy=False):
        """Padded [B, Rmax] log-probs of each response token (and entropies), plus response lengths."""
        ids, mask, plens, rlens = self._pad(samples, idx)
        with self._routing_replay(samples, idx, ids.shape[1]):
            logits = self.model(input_ids=ids, attention_mask=mask, **self._media(samples, idx, ids)).logits
        return self._logp_from_logits(logits, ids, plens, rlens, with_entropy)

    def _logp_from_logits(self, logits, ids, plens, rlens, with_entropy=False):
        """[B, S, V] logits of right-padded prompt+response rows -> ([B, Rmax] response-token log-probs at the
        rollout temperature, validity mask, response lengths, entropies or None). Shared by the backends."""
        rows, cols, valid = self._response_positions(plens, rlens, ids.shape[1], logits.device)
        targets = ids.to(logits.device)[rows, cols + 1]
        logp, ent = self._token_logp(logits[rows, cols], targets, with_entropy)  # over [B, Rmax, V]
        return logp, valid, rlens, ent

    def _token_logp(self, logits, targets, with_entropy=False):
        """Logits [..., V] -> log-prob of ``targets`` [...] at the rollout temperature (and entropies)."""
        logits = logits.float()
        if self.masked_token_ids:  # the rollout engine never samples these: same distribution here
            logits[..., self.masked_token_ids] = MASKED_LOGIT
        logits = logits / self.temperature
        logp = torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        return logp, entropy_from_logits(logits) if with_entropy else None

    @staticmethod
    def _response_positions(plens, rlens, width: int, dev):
        """Row and column indices [B, Rmax] of the positions that predict each response token (right-
        padded rows of ``width``), and which of them are real tokens."""
        steps = torch.arange(max(rlens), device=dev)
        rows = torch.arange(len(rlens), device=dev).unsqueeze(1)
        cols = (torch.tensor(plens, device=dev).unsqueeze(1) - 1 + steps).clamp(max=width - 2)
        valid = steps.unsqueeze(0) < torch.tensor(rlens, device=dev).unsqueeze(1)
        return rows, cols, valid

    @contextlib.contextmanager
    def _routing_replay(self, samples: dict[str, list], idx: list[int], width: int, cols=None):
        """R3: the micro-batch's forward routes each token to the experts the rollout engine used
        (``routed_experts``, [len(tokens) - 1, layers, k] per sample); positions without a record (each
        sequence's last token, right padding) route normally. ``cols``: the positions whose tokens this
        process routes, in the order its routers see them (a megatron rank under context or sequence
        parallelism; default all ``width``). A no-op without --routing-replay."""
        r = self.routing
        if not (self.cfg.algo.routing_replay and "routed_experts" in samples and r is not None):
            yield
            return
        experts = torch.full((len(idx), width, r.num_layers, r.top_k), -1, dtype=torch.long)
        for row, i in enumerate(idx):
            rec = torch.from_numpy(np.asarray(samples["routed_experts"][i]).astype(np.int64))[:width]
            if rec.dim() != 3 or tuple(rec.shape[1:]) != (r.num_layers, r.top_k):
                raise ValueError(
                    f"routed_experts of sample {i} has shape {list(rec.shape)}; this model needs "
                    f"[tokens, {r.num_layers}, {r.top_k}] (MoE layers, top-k): rollout and trainer models differ"
                )
            experts[row, : len(rec)] = rec
        if cols is not None:
            experts = experts[:, cols]
        with r.replay(experts) as stats:
            yield
        if self.model.training:  # train_step's metrics (r3_*)
            st = stats.as_dict()
            self._r3_counts["replayed"] += st["replayed"]
            self._r3_counts["differ"] += st["differ"]
            self._r3_counts["expected"] += sum(len(samples["tokens"][i]) - 1 for i in idx) * r.num_layers

    def _r3_metrics(self) -> dict[str, float]:
        """Routing-replay metrics of the train_step forwards since the last call: the fraction of token-layer
        pairs that had a record, and of those, the fraction whose own top-k set differs (what R3 fixed)."""
        c, self._r3_counts = self._r3_counts, {k: 0.0 for k in self._r3_counts}
        if not c["replayed"]:
            return {}
        return {
            "r3_replayed_frac": c["replayed"] / max(c["expected"], 1.0),
            "r3_expert_differ_frac": c["differ"] / c["replayed"],
        }

    @torch.no_grad()
    @onloaded
    def compute_log_probs(self, samples: dict[str, list]) -> list[np.ndarray]:
        """Per-sample float32 log-probs of the response tokens under the current weights."""
        was_training = self.model.training
        self.model.eval()
        out: dict[int, np.ndarray] = {}
        n = len(samples["tokens"])
        for idx in plan_micro_batches(sample_lengths(samples), list(range(n)), self.cfg.train):
            logp, _, rlens, _ = self._response_logp(samples, idx)
            for k, (i, r) in enumerate(zip(idx, rlens)):
                out[i] = logp[k, :r].cpu().numpy().astype(np.float32)
        self.model.train(was_training)
        return [out[i] for i in range(n)]

    # -- training ------------------------------------------------------------------------------
    def _loss_params(self) -> LossParams:
        a = self.cfg.algo
        return LossParams(
            eps_clip=a.eps_clip,
            eps_clip_high=a.eps_clip_high,
            clip_ratio_c=a.eps_clip_c,
            tau_pos=a.sapo_tau_pos,
            tau_neg=a.sapo_tau_neg,
            cispo_ratio_max=a.cispo_ratio_max,
        )

    def _behaviour_weights(
        self, prox: torch.Tensor, behav: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor | None:
        """π_prox / π_behaviour per token ([B, T]) or per response ([B, 1]); None when no correction is on."""
        a = self.cfg.algo
        if a.tis_mode == "none":
            if not a.decoupled_ppo:
                return None
            return truncated_is_weights(prox, behav, mask, "token", "mask", None, None)  # untruncated
        level, mode = a.tis_mode.split("_")
        return truncated_is_weights(prox, behav, mask, level, mode, None, a.tis_cap)

    @onloaded
    def train_step(self, samples: dict[str, list]) -> dict[str, float]:
        """One rollout batch: one or more optimizer steps of --global-batch-size samples each.

        Per micro-batch: the chosen policy loss against the proximal policy (ActorFwd log-probs, or the
        rollout's without ActorFwd), times the behaviour weight (decoupled PPO / TIS) if on, plus β·KL if
        the KL is a loss, aggregated with the optimizer batch's token and sequence counts, so accumulating
        micro-batches gives exactly the full-batch gradient. Entropy is a token-mean bonus on top.
        """
        if not self.trainable:
            raise RuntimeError("this backend was built frozen (actor_fwd/reference); it cannot train")
        n = len(samples["tokens"])
        gbs = min(self.cfg.effective_global_batch_size, n)
        lengths = sample_lengths(samples)
        acc = _StepAcc.start(self, samples)
        loss_total, grad_norm, n_opt, skipped = 0.0, 0.0, 0, 0
        self.model.train()
        for gstart in range(0, n, gbs):
            gidx = list(range(gstart, min(n, gstart + gbs)))
            total_tokens = float(sum(float(np.sum(samples["loss_mask"][i])) for i in gidx)) or 1.0
            self.optimizer.zero_grad(set_to_none=True)
            acc.first_step = gstart == 0
            micro = plan_micro_batches(lengths, gidx, self.cfg.train)
            loss_total += self._forward_backward(samples, micro, total_tokens, len(gidx), acc)
            norm = self._clip_and_step()
            grad_norm += norm
            skipped += not math.isfinite(norm)
            n_opt += 1
        self.version += 1
        metrics = self._step_metrics(acc.sums, acc.counts, acc.keep, loss_total, grad_norm, n_opt)
        metrics["nonfinite_updates_skipped"] = float(skipped)
        metrics["lr"] = float(self.optimizer.param_groups[0]["lr"])  # (its last optimizer step's)
        return {**metrics, **self._r3_metrics()}

    def _forward_backward(
        self, samples, micro: list[list[int]], total_tokens: float, n_seqs: int, acc
    ) -> float:
        """Forward and backward every micro-batch of one optimizer step (gradients accumulate); the summed
        loss. The megatron backend runs the same :meth:`_micro_loss` through Megatron's schedule instead."""
        total = 0.0
        for idx in micro:
            logp, valid, _, ent = self._response_logp(samples, idx, with_entropy=acc.with_entropy)
            loss = self._micro_loss(samples, idx, logp, valid, ent, total_tokens, n_seqs, acc)
            loss.backward()
            total += float(loss.detach())
        return total

    def _clip_and_step(self) -> float:
        """Clip the accumulated gradients to --clip-grad, step the optimizer; the pre-clip gradient norm."""
        gn = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.train.clip_grad))
        self._update_if_finite(gn)
        return gn

    def _update_if_finite(self, grad_norm: float) -> bool:
        """Step the optimizer, unless the gradient norm is NaN or infinite: that step would write NaN into
        every weight (and, through AdamW's moments, into every later step). It is skipped instead, its
        gradients dropped, and counted (``train/nonfinite_updates_skipped``). True when it stepped."""
        if not math.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            return False
        if self.before_update is not None:
            self.before_update()
        self.optimizer.step()
        return True

    def _micro_loss(
        self, samples, idx, logp, valid, ent, total_tokens: float, n_seqs: int, acc
    ) -> torch.Tensor:
        """The loss of one micro-batch (a summand of the optimizer batch's loss) from its response-token
        log-probs; its statistics are added to ``acc``."""
        a = self.cfg.algo
        width, dev = logp.shape[1], logp.device

        def padded(key: str) -> torch.Tensor:
            return self._padded(samples[key], idx, width).to(dev)

        if acc.old_key is None:  # π_prox is the weights this forward runs with, for every sample
            old = logp.detach()
        else:
            old = padded(acc.old_key)
            if "prox_from_forward" in samples:  # ... for these samples (see relax_train.roles.prox)
                live = torch.tensor([bool(samples["prox_from_forward"][i]) for i in idx], device=dev)
                old = torch.where(live[:, None], logp.detach(), old)
        behav = padded("rollout_log_probs") if acc.has_behav else old
        adv = padded("advantages")
        lmask = padded("loss_mask") * valid
        sums, counts, keep = acc.sums, acc.counts, acc.keep
        if acc.has_prox and acc.first_step:  # π_θ is π_prox here by definition: any gap is a stale π_prox
            keep["prox_gap"].append(((old - logp.detach()).abs() * lmask).max().reshape(1).cpu())
        if acc.distill:  # on-policy distillation: reverse KL to the teacher on the student's own tokens
            teacher = padded("teacher_log_probs")
            sums["distill_kl"] += float(((old - teacher) * lmask).sum())  # k1 estimate
            if acc.distill == "advantage":  # per-token reward log π_T − log π_old (no gradient)
                adv = adv + a.distill_coef * (teacher - old)
        pg, st = acc.loss_fn(logp, old, adv, lmask, acc.params)
        tok_loss = pg
        w = self._behaviour_weights(old, behav, lmask) if acc.has_prox and acc.has_behav else None
        if w is not None:
            tok_loss = tok_loss * w
            keep["tis"].append(w.expand_as(logp)[lmask.bool()].cpu())
        if acc.kl_loss:
            kl = kl_penalty(logp, padded("ref_log_probs"), loss_kl_estimator(a))
            tok_loss = tok_loss + a.kl_coef * kl
            sums["kl"] += float((kl.detach() * lmask).sum())
        if acc.distill == "loss":
            tok_loss = tok_loss + a.distill_coef * kl_penalty(
                logp, teacher, loss_kl_estimator(a, distill=True)
            )
        loss = aggregate_loss(
            tok_loss,
            lmask,
            a.loss_agg_mode,
            global_tokens=total_tokens,
            global_seqs=n_seqs,
            max_len=self.cfg.rollout.rollout_max_response_len,
        )
        if ent is not None:
            loss = loss + entropy_bonus(ent, lmask, a.entropy_coef, total_tokens=total_tokens)
            sums["entropy"] += float((ent.detach() * lmask).sum())
        sel = lmask.bool()
        sums["pg_loss"] += float((pg.detach() * lmask).sum())
        sums["tokens"] += float(lmask.sum())
        for key in ("clipped", "dual_clipped", "gate"):
            if key in st:
                counts[key] = counts.get(key, 0.0) + float((st[key] * lmask).sum())
        if a.policy_loss in ("ppo", "gspo"):
            high = a.eps_clip if a.eps_clip_high is None else a.eps_clip_high
            r = st["ratio"]
            low_c = ((r < 1.0 - a.eps_clip) & (adv < 0)).float()
            high_c = ((r > 1.0 + high) & (adv > 0)).float()
            counts["clipped_low"] = counts.get("clipped_low", 0.0) + float((low_c * lmask).sum())
            counts["clipped_high"] = counts.get("clipped_high", 0.0) + float((high_c * lmask).sum())
        keep["ratio"].append(st["ratio"][sel].detach().cpu())
        if acc.has_behav:  # the rollout-vs-trainer gap: π_prox (the trainer's policy the batch is clipped
            # against; π_θ moves with each optimizer step of the batch) against the rollout's
            keep["train"].append((old if acc.has_prox else logp.detach())[sel].cpu())
            keep["rollout"].append(behav[sel].cpu())
        return loss

    @staticmethod
    def _step_metrics(sums, counts, keep, loss_total, grad_norm, n_opt) -> dict[str, float]:
        tokens = sums.pop("tokens") or 1.0
        names = {
            "clipped": "clipfrac",
            "dual_clipped": "dual_clipfrac",
            "gate": "sapo_gate_mean",
            "clipped_low": "clipfrac_low",
            "clipped_high": "clipfrac_high",
        }
        metrics = {k: v / tokens for k, v in sums.items()}
        metrics.update({names[k]: v / tokens for k, v in counts.items()})
        metrics["loss"] = loss_total / max(n_opt, 1)
        metrics["grad_norm"] = grad_norm / max(n_opt, 1)
        metrics["optimizer_steps"] = float(n_opt)
        ratio = torch.cat(keep["ratio"]) if keep["ratio"] else torch.ones(1)
        if ratio.numel():
            metrics.update(
                ratio_mean=float(ratio.mean()),
                ratio_min=float(ratio.min()),
                ratio_max=float(ratio.max()),
                ratio_std=float(ratio.std()) if ratio.numel() > 1 else 0.0,
            )
        if keep["train"]:
            train, rollout = torch.cat(keep["train"]), torch.cat(keep["rollout"])
            mm = mismatch_metrics(train, rollout, torch.ones_like(train, dtype=torch.bool))
            metrics.update({"rollout_" + k.removeprefix("mismatch/"): v for k, v in mm.items()})
        if keep["prox_gap"]:
            metrics["prox_gap_max"] = float(torch.cat(keep["prox_gap"]).max())
        if keep["tis"]:
            w = torch.cat(keep["tis"])
            if w.numel():
                metrics.update(
                    tis_weight_mean=float(w.mean()),
                    tis_weight_min=float(w.min()),
                    tis_weight_max=float(w.max()),
                    tis_zero_frac=float((w == 0).float().mean()),
                )
        return metrics

    @staticmethod
    def _padded(values: list, idx: list[int], width: int) -> torch.Tensor:
        out = torch.zeros((len(idx), width), dtype=torch.float32)
        for row, i in enumerate(idx):
            v = torch.tensor(np.asarray(values[i], dtype=np.float32))[:width]
            out[row, : len(v)] = v
        return out

    # -- device memory (colocate: the rollout engine uses the devices in between) ---------------
    _host: HostOffload | None = None

    def _device_tensors(self):
        """What this role holds on its device: weights, gradients, the optimizer's moments."""
        for p in self.model.parameters():
            yield p
            for g in (p.grad, getattr(p, "main_grad", None)):
                if g is not None:
                    yield g
        if self.trainable:
            for state in self.optimizer.state.values():
                yield from (v for v in state.values() if torch.is_tensor(v))

    def offload(self) -> int:
        """Move weights, gradients and optimizer state to host memory, freeing the device for the
        rollout engine (the tensor objects stay; :meth:`onload` refills them). Returns bytes freed."""
        if self._host is None:
            self._host = HostOffload(type(self).__name__)
        return self._host.offload(self._device_tensors())

    def onload(self) -> int:
        """Bring back what :meth:`offload` moved (a no-op when nothing is offloaded). Returns bytes."""
        return self._host.onload() if self._host is not None else 0

    # -- weights and checkpoints ---------------------------------------------------------------
    @onloaded
    def eval_model(self):
        """The HF model the evaluator generates with (this backend's own)."""
        return self.model

    @onloaded
    def named_weights(self) -> list[tuple[str, torch.Tensor]]:
        return [(n, p.detach()) for n, p in self.model.named_parameters()]

    @onloaded
    def load_weights(self, tensors: dict[str, Any], version: int) -> None:
        with torch.no_grad():
            params = dict(self.model.named_parameters())
            for name, value in tensors.items():
                params[name].copy_(torch.as_tensor(value))
        self.version = version

    @onloaded
    def save_checkpoint(self, path: str | Path) -> None:
        """``model/`` (an HF directory that serves: weights, config, and the tokenizer, processor and generation
        config of the checkpoint trained from), the optimizer and RNG states, meta.json."""
        from relax_core.hf_files import copy_serving_files

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(path / "model")
        copy_serving_files(self.model_path, path / "model", getattr(self.model, "generation_config", None))
        state = self._trainer_state()
        torch.save(state, path / "trainer_state.pt")
        (path / "meta.json").write_text(json.dumps({"version": self.version}, indent=1))

    @onloaded
    def load_checkpoint(self, path: str | Path) -> dict[str, Any]:
        from safetensors.torch import load_file

        path = Path(path)
        if not (path / "meta.json").is_file():
            raise FileNotFoundError(f"--load {path}: no checkpoint there (meta.json missing)")
        weights = load_file(str(path / "model" / "model.safetensors"))
        missing = self.model.load_state_dict(weights, strict=False).missing_keys
        loaded = {t.data_ptr() for name, t in self.model.state_dict().items() if name in weights}
        state = self.model.state_dict()  # (a tied weight saved once under its other name is not missing)
        missing = [name for name in missing if state[name].data_ptr() not in loaded]
        if missing:
            raise ValueError(
                f"--load {path}: the checkpoint lacks {len(missing)} of the model's tensors ({', '.join(missing[:3])}"
                f"{', …' if len(missing) > 3 else ''}): it is damaged or of another model; load another one"
            )
        state = torch.load(path / "trainer_state.pt", weights_only=False)
        return self._restore_trainer_state(state, path)

    def _trainer_state(self) -> dict[str, Any]:
        """Optimizer and RNG states: what a checkpoint holds besides the weights."""
        return {
            "optimizer": self.optimizer.state_dict() if self.trainable else None,
            "torch_rng": torch.get_rng_state(),
            "py_rng": random.getstate(),
            "np_rng": np.random.get_state(),
        }

    def _restore_trainer_state(self, state: dict[str, Any], path: Path) -> dict[str, Any]:
        """Put back :meth:`_trainer_state`'s states and the version in ``path``'s meta.json; the meta."""
        if self.trainable and state["optimizer"] is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["torch_rng"])
        random.setstate(state["py_rng"])
        np.random.set_state(state["np_rng"])
        meta = json.loads((path / "meta.json").read_text())
        self.version = int(meta["version"])
        return meta
