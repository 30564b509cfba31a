"""The value model backends: what the Critic role (PPO with GAE) calls on its model, and the torch one.

Why apart from :mod:`.base`: a value model is not a policy. It scores states with one scalar each (no
log-probs, no weights sent to engines, no streamed steps) and trains on a regression target, so it has a
protocol of its own; what it shares with the policy backends it takes as components: right-padded rows
(:func:`~relax_train.backends.logprobs.pad_rows`), micro-batch plans (:mod:`.micro`), the non-finite
update guard (:func:`~relax_train.backends.step.update_if_finite`), the offload (:mod:`relax_core.offload`),
and the loss every value backend fits (:func:`~relax_train.algorithms.value_loss.clipped_value_loss`).

The torch value model is the policy checkpoint's trunk with a scalar head: transformers'
``AutoModelForTokenClassification`` with one label (the causal LM's ``lm_head`` is left out, its ``score``
layer is the head; veRL builds its critics the same way). A new head starts at zero, so V = 0 and the first
GAE advantages with γ = λ = 1 are the Monte-Carlo returns. V(s_t) of response token t is the head on the
hidden state of the position before it (prompt_len + t − 1): the state the token was generated from.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np
import torch

from relax_core import sample
from relax_core.config import RelaxConfig
from relax_core.offload import onloaded
from relax_core.registry import Registry
from relax_core.sample import TrainBatch
from relax_train.algorithms.value_loss import clipped_value_loss
from relax_train.backends.base import MEGATRON_HINT
from relax_train.backends.logprobs import pad_rows, padded_field, response_positions
from relax_train.backends.micro import plan_micro_batches, sample_lengths
from relax_train.backends.state import HostTurns
from relax_train.backends.step import apply_adamw_settings, build_adamw, update_if_finite

if TYPE_CHECKING:
    from transformers import PreTrainedModel

CRITIC_DIR = "critic"
"""A critic checkpoint's HF directory (config, weights with the head, tokenizer files)."""
OPTIMIZER_FILE = "optimizer.pt"
META_FILE = "meta.json"

_HEAD_ARCH = "ForTokenClassification"
"""How a value model written by :meth:`TorchValueBackend.save_checkpoint` names its architecture."""
_MM_CONFIG_KEYS = ("vision_config", "audio_config", "thinker_config")
"""config.json keys that only a multimodal checkpoint has."""


@runtime_checkable
class ValueBackend(Protocol):
    """What the Critic role calls on a value model (the torch backend, one process; the megatron one).

    ``samples`` is the bus's column dict (``sample.TOKENS``, ``sample.PROMPT_LEN``, ``sample.LOSS_MASK``,
    and for training ``sample.VALUES`` and ``sample.RETURNS``; one entry per sample)."""

    version: int
    """Critic updates taken: +1 per :meth:`train_values` call (restored by :meth:`load_checkpoint`)."""

    def compute_values(self, samples: TrainBatch) -> list[np.ndarray]:
        """Each sample's float32 V(s_t), one per response token (no gradient)."""

    def train_values(self, samples: TrainBatch) -> dict[str, float]:
        """--critic-epochs passes of clipped value-loss steps over the batch; the metrics (unprefixed)."""

    def save_checkpoint(self, path: str | Path) -> None:
        """``critic/`` (HF directory), ``optimizer.pt`` and ``meta.json`` (the version) under ``path``."""

    def load_checkpoint(self, path: str | Path) -> dict[str, Any]:
        """Restore what :meth:`save_checkpoint` wrote; its ``meta.json``. Refuses a missing or damaged one."""

    def offload(self) -> int:
        """Move weights, gradients and optimizer state to host memory; bytes freed on the device."""

    def onload(self) -> int:
        """Bring back what :meth:`offload` moved (a no-op when nothing is offloaded); bytes moved."""


VALUE_BACKENDS = Registry(
    "value backend (--train-backend)",
    "relax.value_backends",
    {
        "torch": "relax_train.backends.value:TorchValueBackend",
        "megatron": "relax_train.backends.megatron.value:MegatronValueBackend",
    },
    hints={"megatron": MEGATRON_HINT},
)
"""The critic's value backends, by the run's --train-backend."""


def build_value_backend(name: str, **kwargs: Any) -> ValueBackend:
    """The ``name`` value backend built with ``kwargs`` (its module imported only now)."""
    return VALUE_BACKENDS.load(name)(**kwargs)


def _text_config(path: Path) -> dict[str, Any]:
    """``path``'s config.json, refused (an error naming the path) where it is missing or multimodal."""
    from relax_core.models import mm_family

    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(
            f"critic model {path}: no config.json there; give an HF causal LM directory (--critic-checkpoint, "
            f"default --hf-checkpoint) or a critic checkpoint's {CRITIC_DIR}/ directory"
        )
    try:
        cfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"critic model {path}: config.json is not valid JSON ({e}); it is damaged") from e
    if mm_family(path) is not None or any(k in cfg for k in _MM_CONFIG_KEYS):
        raise ValueError(
            f"critic model {path} is multimodal ({cfg.get('model_type')!r}): critics are text-only for now; "
            "give a text causal LM as --critic-checkpoint"
        )
    archs = cfg.get("architectures") or []
    if not archs or not (archs[0].endswith("ForCausalLM") or archs[0].endswith(_HEAD_ARCH)):
        raise ValueError(
            f"critic model {path}: architecture {archs[:1] or 'unnamed'} is neither a causal LM (*ForCausalLM) "
            f"nor a critic ({_HEAD_ARCH}, a {CRITIC_DIR}/ directory); give a text causal LM"
        )
    return cfg


def load_value_model(path: str | Path, dtype: str = "float32") -> PreTrainedModel:
    """The value model of ``path``: a causal LM's trunk with a new zero head, or a critic directory written
    by :meth:`TorchValueBackend.save_checkpoint` with its own head. Refuses a path whose trunk does not load
    whole (a missing tensor other than the head's)."""
    import transformers

    from relax_core.models import LOAD_LOCK, attention_for, ensure_tied

    path = Path(path)
    cfg = _text_config(path)
    arch = cfg["architectures"][0]
    is_critic = arch.endswith(_HEAD_ARCH)
    if is_critic and cfg.get("id2label") is not None and len(cfg["id2label"]) != 1:
        raise ValueError(
            f"critic model {path}: a {arch} with {len(cfg['id2label'])} labels is no value model"
        )
    config = transformers.AutoConfig.from_pretrained(str(path), num_labels=1)
    config.classifier_dropout = 0.0  # (its default, 0.1, would make V(s) random in train mode)
    causal_name = arch.removesuffix(_HEAD_ARCH) + "ForCausalLM"  # (same kernels as the policy's roles)
    attn = attention_for(causal_name, cfg.get("max_position_embeddings"))
    extra = {"attn_implementation": attn} if attn else {}
    with LOAD_LOCK:  # (its load report lists the LM head as unused and the new head as missing: expected,
        # and checked below, so it is not printed as if something were wrong)
        verbosity = transformers.logging.get_verbosity()
        transformers.logging.set_verbosity_error()
        try:
            model, info = transformers.AutoModelForTokenClassification.from_pretrained(
                str(path), config=config, dtype=getattr(torch, dtype), output_loading_info=True, **extra
            )
        finally:
            transformers.logging.set_verbosity(verbosity)
    head = {"score.weight", "score.bias"}
    missing = set(info["missing_keys"]) - (set() if is_critic else head)
    if missing:
        raise ValueError(
            f"critic model {path}: {len(missing)} tensors were not in the checkpoint ({', '.join(sorted(missing)[:3])}"
            f"{', …' if len(missing) > 3 else ''}): it is damaged or not a {'critic' if is_critic else 'causal LM'}"
        )
    if not is_critic:
        with torch.no_grad():
            model.score.weight.zero_()
            if model.score.bias is not None:
                model.score.bias.zero_()
    return ensure_tied(model, str(path))


def read_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF directory's safetensors (one file, or the shards of its index)."""
    from safetensors.torch import load_file

    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(model_dir / f)))
    return out


class TorchValueBackend(HostTurns):
    """An HF value model (trunk + scalar head) with its AdamW on this process: the whole
    :class:`ValueBackend`."""

    model: PreTrainedModel
    optimizer: torch.optim.Optimizer

    def __init__(self, config: RelaxConfig, model_path: str) -> None:
        """``model_path``: a text causal LM (its trunk gets a zero head) or a critic checkpoint's
        ``critic/`` directory (its head comes back)."""
        self.cfg = config
        self.model_path = model_path  # (its tokenizer files go into every checkpoint's critic/)
        self.model = load_value_model(model_path, config.model.dtype)
        cfg = self.model.config
        self.pad_token_id = getattr(cfg, "pad_token_id", None) or 0
        self.model.train()
        self.optimizer_settings = config.train.model_copy(update={"lr": config.critic_lr})
        """The critic's AdamW settings (the run's, with --critic-lr)."""
        self.optimizer = build_adamw(self.model.parameters(), self.optimizer_settings)
        self.version = 0

    # -- forward -------------------------------------------------------------------------------
    def _values(self, samples: TrainBatch, idx: list[int]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """Padded [B, Rmax] float32 V(s_t) of each response token of samples ``idx`` (the head on the
        position before the token), which are real tokens, and the response lengths."""
        ids, mask, plens, rlens = pad_rows(samples, idx, self.pad_token_id)
        dev = self.model.device
        scores = self.model(input_ids=ids.to(dev), attention_mask=mask.to(dev)).logits[..., 0]
        rows, cols, valid = response_positions(plens, rlens, ids.shape[1], scores.device)
        return scores[rows, cols].float(), valid, rlens

    @torch.no_grad()
    @onloaded
    def compute_values(self, samples: TrainBatch) -> list[np.ndarray]:
        """Per-sample float32 V(s_t) of the response tokens under the current weights (eval mode)."""
        was_training = self.model.training
        self.model.eval()
        out: dict[int, np.ndarray] = {}
        n = len(samples[sample.TOKENS])
        for idx in plan_micro_batches(sample_lengths(samples), list(range(n)), self.cfg.train):
            values, _, rlens = self._values(samples, idx)
            for k, (i, r) in enumerate(zip(idx, rlens)):
                out[i] = values[k, :r].cpu().numpy().astype(np.float32)
        self.model.train(was_training)
        return [out[i] for i in range(n)]

    # -- training ------------------------------------------------------------------------------
    @onloaded
    def train_values(self, samples: TrainBatch) -> dict[str, float]:
        """--critic-epochs passes over the batch, each a sweep of optimizer steps of
        --critic-global-batch-size samples: the clipped value loss (--value-clip, --value-loss-coef) over the
        LOSS_MASK tokens, normalised by the optimizer batch's LOSS_MASK token count, gradients accumulated
        over micro-batches, clipped to --clip-grad; a non-finite update is skipped. One version more."""
        n = len(samples[sample.TOKENS])
        gbs = min(self.cfg.critic_global_batch_size, n)
        lengths = sample_lengths(samples)
        crit = self.cfg.critic
        losses: list[float] = []
        norms: list[float] = []
        skipped = 0
        tokens = clipped = vsum = 0.0
        self.model.train()
        for _ in range(crit.critic_epochs):
            for gstart in range(0, n, gbs):
                gidx = list(range(gstart, min(n, gstart + gbs)))
                total = float(sum(float(np.sum(samples[sample.LOSS_MASK][i])) for i in gidx)) or 1.0
                self.optimizer.zero_grad(set_to_none=True)
                step_loss = 0.0
                for idx in plan_micro_batches(lengths, gidx, self.cfg.train):
                    vpred, valid, _ = self._values(samples, idx)
                    width, dev = vpred.shape[1], vpred.device
                    old = padded_field(samples[sample.VALUES], idx, width).to(dev)
                    ret = padded_field(samples[sample.RETURNS], idx, width).to(dev)
                    m = padded_field(samples[sample.LOSS_MASK], idx, width).to(dev) * valid
                    loss, n_clip = clipped_value_loss(
                        vpred, old, ret, m, crit.value_clip, total, crit.value_loss_coef
                    )
                    loss.backward()
                    step_loss += float(loss.detach())
                    clipped += float(n_clip)
                    tokens += float(m.sum())
                    vsum += float((vpred.detach() * m).sum())
                gn = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.train.clip_grad))
                update_if_finite(self.optimizer, gn, None)
                skipped += not math.isfinite(gn)
                losses.append(step_loss)
                norms.append(gn)
        self.version += 1
        return {
            "value_loss": float(np.mean(losses)),
            "value_clipfrac": clipped / tokens if tokens else 0.0,
            "vpred_mean": vsum / tokens if tokens else 0.0,
            "grad_norm": float(np.mean(norms)),
            "lr": float(self.optimizer.param_groups[0]["lr"]),
            "optimizer_steps": float(len(losses)),
            "nonfinite_updates_skipped": float(skipped),
        }

    # -- checkpoints ---------------------------------------------------------------------------
    @onloaded
    def save_checkpoint(self, path: str | Path) -> None:
        """``critic/`` (an HF directory this class loads back: config, weights with the head, and the
        tokenizer files of the checkpoint it was built from), ``optimizer.pt`` (AdamW's state) and
        ``meta.json`` (the version). The process's RNGs are not saved: the value model draws none (no dropout)
        and the roles sharing the process keep theirs."""
        from relax_core.hf_files import copy_serving_files

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(path / CRITIC_DIR)
        copy_serving_files(self.model_path, path / CRITIC_DIR)
        torch.save({"optimizer": self.optimizer.state_dict()}, path / OPTIMIZER_FILE)
        (path / META_FILE).write_text(json.dumps({"version": self.version}, indent=1))

    @onloaded
    def load_checkpoint(self, path: str | Path) -> dict[str, Any]:
        """Restore :meth:`save_checkpoint`'s weights, optimizer state and version; the meta. Refuses a
        missing or damaged checkpoint (an error naming the path) before changing anything."""
        path = Path(path)
        for name in (META_FILE, OPTIMIZER_FILE, f"{CRITIC_DIR}/config.json"):
            if not (path / name).is_file():
                raise FileNotFoundError(
                    f"critic checkpoint {path}: {name} missing; it is no critic checkpoint"
                )
        try:
            meta = json.loads((path / META_FILE).read_text())
            version = int(meta["version"])
            weights = read_weights(path / CRITIC_DIR)
            state = torch.load(path / OPTIMIZER_FILE, weights_only=False)["optimizer"]
        except Exception as e:  # (a truncated or foreign file: any of json's, safetensors', torch's errors)
            raise ValueError(
                f"critic checkpoint {path} is damaged ({type(e).__name__}: {e}); load another"
            ) from e
        own = self.model.state_dict()
        missing = sorted(set(own) - set(weights))
        if missing or any(weights[k].shape != own[k].shape for k in own):
            raise ValueError(
                f"critic checkpoint {path}: its weights do not fit this value model (missing: "
                f"{', '.join(missing[:3]) or 'none'}; or other shapes): it is of another model"
            )
        self.model.load_state_dict({k: weights[k] for k in own})
        self.optimizer.load_state_dict(state)
        apply_adamw_settings(self.optimizer, self.optimizer_settings)  # (the settings given win)
        self.version = version
        return meta
