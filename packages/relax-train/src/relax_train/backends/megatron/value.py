"""The critic's value model on megatron-core: PPO's learned V(s) for ``--advantage-estimator gae`` with
``--train-backend megatron``.

Why its own class, holding the policy backend's parts rather than being one: the value model is the
policy's decoder (a megatron-core ``GPTModel`` built, loaded from HF weights and run exactly as
:class:`~relax_train.backends.megatron.backend.MegatronBackend` builds, loads and runs it) whose output
layer is a scalar head (hidden -> 1) instead of the vocabulary; everything else a policy backend offers
(log-probs, HF weights for the rollout, the policy loss) means nothing for it. So it builds the policy's
:class:`~relax_train.backends.megatron.net.MegatronNet` and holds the parts it needs — the weights in HF
names, the micro-batch forward (``forward_rows``) and megatron schedule, the gradient reductions and
clipping (:func:`~relax_train.backends.megatron.training.clip_and_step`) — swaps the output layer for
:class:`ScalarHead`, and steps an AdamW of its own at ``--critic-lr``. The loss is
:func:`~relax_train.algorithms.value_loss.clipped_value_loss`, the same the torch value backend fits.

V(s_t) for response token t is the head on the final (normed) hidden state at position
``prompt_len + t − 1``: the state just before the token is sampled.

Parallelism: one rank, or data parallelism (each replica its share of the micro-batches, gradients summed
as the policy's); tensor, pipeline, context and expert parallelism are refused at start-up.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from relax_core import sample
from relax_core.config import RelaxConfig
from relax_core.offload import onloaded
from relax_core.sample import TrainBatch
from relax_train.algorithms.value_loss import clipped_value_loss
from relax_train.backends.logprobs import pad_rows, padded_field, response_positions
from relax_train.backends.megatron.training import clip_and_step
from relax_train.backends.micro import plan_micro_batches, sample_lengths
from relax_train.backends.state import HostTurns, restore_trainer_state, trainer_state
from relax_train.backends.step import build_adamw
from relax_train.backends.value import CRITIC_DIR, META_FILE, OPTIMIZER_FILE

HEAD_ARCH = "ForTokenClassification"
"""A critic directory's architecture suffix (transformers' token classification with one label)."""
HEAD_PREFIX = "score."
"""The head's weights in a critic directory (transformers' token-classification ``score`` layer)."""

BACKEND = "megatron"
"""What ``optimizer.pt`` of this backend's checkpoints says wrote it (a torch critic's AdamW is of other tensors)."""

_REFUSED = (
    ("tensor_model_parallel_size", "--tensor-model-parallel-size"),
    ("pipeline_model_parallel_size", "--pipeline-model-parallel-size"),
    ("context_parallel_size", "--context-parallel-size"),
    ("expert_model_parallel_size", "--expert-model-parallel-size"),
)


def check_value_parallelism(config: RelaxConfig) -> None:
    """Refuse model parallelism for the megatron critic (its head and checkpoints are one-rank), naming the
    flags to change."""
    t = config.train
    bad = [f"{flag} {getattr(t, name)}" for name, flag in _REFUSED if getattr(t, name) > 1]
    if (t.expert_tensor_parallel_size or 1) > 1:
        bad.append(f"--expert-tensor-parallel-size {t.expert_tensor_parallel_size}")
    if bad:
        raise ValueError(
            f"the megatron critic runs on one rank or data-parallel replicas only, not with {', '.join(bad)}: "
            "set these to 1, or run the critic with --train-backend torch"
        )


def _split_head(hf: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """HF-named weights -> (the trunk's, the head's as ``{"weight", "bias"}``: a critic's ``score.*``)."""
    trunk = {k: v for k, v in hf.items() if not k.startswith(HEAD_PREFIX)}
    return trunk, {k[len(HEAD_PREFIX) :]: v for k, v in hf.items() if k.startswith(HEAD_PREFIX)}


def _with_lm_head_stub(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A value model's trunk has no ``lm_head``; the converter maps one onto the output layer that the
    :class:`ScalarHead` replaces: zeros of its shape stand in (a tied model's is dropped anyway)."""
    if "lm_head.weight" in hf:
        return hf
    emb = hf["model.embed_tokens.weight"]
    return {**hf, "lm_head.weight": torch.zeros(1, 1, dtype=emb.dtype).expand(emb.shape)}


class ScalarHead(torch.nn.Module):
    """hidden -> 1 in place of ``GPTModel.output_layer``, called as megatron calls that layer
    (``(hidden, weight=, runtime_gather_output=) -> (output, bias)``). Zero-initialised (every value 0 until
    trained); computed in float32, outside the forward's autocast."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size))
        self.bias = torch.nn.Parameter(torch.zeros(1))

    def forward(
        self, hidden: torch.Tensor, weight: Any = None, runtime_gather_output: Any = None
    ) -> tuple[torch.Tensor, None]:
        """Hidden states [S, B, H] -> values [S, B, 1] (``weight``: the tied embedding megatron passes, unused)."""
        with torch.autocast(hidden.device.type, enabled=False):
            return torch.nn.functional.linear(hidden.float(), self.weight, self.bias), None


class MegatronValueBackend(HostTurns):
    """The ``ValueBackend`` protocol (``compute_values``, ``train_values``, checkpoints, offload) over a
    megatron-core decoder with a :class:`ScalarHead`: the policy backend's net, weights and forward parts,
    its gradient reductions and clipping (:func:`clip_and_step`), an AdamW of its own."""

    optimizer: torch.optim.Optimizer

    def __init__(self, config: RelaxConfig, model_path: str) -> None:
        """``model_path``: a text causal LM (its trunk gets a zero head) or a critic checkpoint's ``critic/``
        directory, the torch value backend's or this one's (its head comes back)."""
        from transformers import AutoConfig

        from relax_train.backends.megatron import multimodal as mm
        from relax_train.backends.megatron.forward import MegatronForward
        from relax_train.backends.megatron.net import build_net
        from relax_train.backends.megatron.startup import load_hf_state
        from relax_train.backends.megatron.weights import MegatronWeights

        check_value_parallelism(config)
        if mm.is_multimodal(AutoConfig.from_pretrained(model_path)):
            raise ValueError(
                f"critic model {model_path} is multimodal: critics are text-only for now; give a text causal "
                "LM as --critic-checkpoint"
            )
        self.cfg, self.model_path = config, model_path
        hf, head = _split_head(load_hf_state(model_path))
        # the trunk as the policy backend builds and loads it; routing replay replays the policy's routes,
        # not the critic's
        self.net = build_net(config, model_path)
        self.net.routing = None
        trunk = dict(_with_lm_head_stub(hf))
        if self.net.layout.tie_word_embeddings:  # (as the policy backend loads a tied model)
            trunk.pop("lm_head.weight", None)
        self.weights = MegatronWeights(self.net)
        self.weights.load_weights(trunk)
        self.forward = MegatronForward(self.net)
        self.model = self.net.model
        self.head = ScalarHead(self.net.layout.hidden_size)
        with torch.no_grad():
            for name, value in head.items():
                getattr(self.head, name).copy_(value.reshape(getattr(self.head, name).shape))
        if self.net.device is not None:
            self.head.to(self.net.device)
        self.model.output_layer = self.head
        self.model.requires_grad_(True)
        self.optimizer_settings = config.train.model_copy(update={"lr": config.critic_lr})
        """The critic's AdamW settings (the run's, with --critic-lr)."""
        self.optimizer = build_adamw(self.model.parameters(), self.optimizer_settings)
        self.version = 0

    # -- forward ------------------------------------------------------------------------------------
    def _step_fn(self, samples: TrainBatch, on_values):
        """Megatron's ``forward_step_func`` for values: one micro-batch through the model; its loss function
        hands the response tokens' values [B, Rmax] (with which are real, and the response lengths) to
        ``on_values``, which returns the micro-batch's loss."""
        net = self.net

        def step(data_iterator, model):
            idx, real = next(data_iterator)
            ids, _, plens, rlens = pad_rows(samples, idx, net.pad_token_id)
            dev = net.device or torch.device("cpu")
            out, ids = self.forward.forward_rows(model, samples, idx, ids, dev, real)

            def loss_func(output: torch.Tensor):
                rows, cols, valid = response_positions(plens, rlens, ids.shape[1], output.device)
                values = output[..., 0].float()[rows, cols]
                # a stand-in micro-batch (a replica short of one) goes through and contributes nothing
                loss = on_values(idx, values, valid, rlens) if real else values.sum() * 0.0
                return loss, torch.ones((), dtype=torch.int, device=dev), {}

            return out, loss_func

        return step

    def _micro(self, samples: TrainBatch, idx: list[int]) -> list[list[int]]:
        return plan_micro_batches(sample_lengths(samples), idx, self.cfg.train)

    @torch.no_grad()
    @onloaded
    def compute_values(self, samples: TrainBatch) -> list[np.ndarray]:
        """V(s_t) for every response token of every sample (float32, one per token), no gradients."""
        from megatron.core import parallel_state as ps

        was_training = self.model.training
        self.model.eval()
        n = len(samples[sample.TOKENS])
        out: dict[int, np.ndarray] = {}

        def keep(idx, values, valid, rlens):
            for k, (i, r) in enumerate(zip(idx, rlens)):
                out[i] = values[k, :r].cpu().numpy().astype(np.float32)
            return values.sum() * 0.0

        self.forward.schedule(self._step_fn(samples, keep), self._micro(samples, list(range(n))), True)
        self.model.train(was_training)
        if ps.get_data_parallel_world_size() > 1:  # each replica computed its micro-batches
            parts: list[Any] = [None] * ps.get_data_parallel_world_size()
            dist.all_gather_object(parts, out, group=ps.get_data_parallel_group())
            out = {i: v for part in parts for i, v in part.items()}
        return [out[i] for i in range(n)]

    # -- training -----------------------------------------------------------------------------------
    @onloaded
    def train_values(self, samples: TrainBatch) -> dict[str, float]:
        """Fit the values to ``samples``' RETURNS: --critic-epochs passes, each optimizer steps of
        --critic-global-batch-size samples, on the clipped value loss (VALUES: the values the batch was
        scored with) token-averaged over each step's LOSS_MASK tokens. The version counts up by one."""
        from megatron.core import parallel_state as ps

        cfg = self.cfg
        n = len(samples[sample.TOKENS])
        gbs = min(cfg.critic_global_batch_size, n)
        sums = torch.zeros(4, dtype=torch.float64)  # value loss, clipped tokens, Σ vpred, masked tokens
        grad_norm, n_opt, skipped = 0.0, 0, 0

        def fit(total_tokens: float):
            def loss(idx, values, valid, rlens):
                width, dev = values.shape[1], values.device
                old = padded_field(samples[sample.VALUES], idx, width).to(dev)
                returns = padded_field(samples[sample.RETURNS], idx, width).to(dev)
                mask = padded_field(samples[sample.LOSS_MASK], idx, width).to(dev) * valid
                value, clipped = clipped_value_loss(
                    values,
                    old,
                    returns,
                    mask,
                    cfg.critic.value_clip,
                    total_tokens,
                    cfg.critic.value_loss_coef,
                )
                step = [
                    float(value.detach()),
                    float(clipped),
                    float((values.detach() * mask).sum()),
                    float(mask.sum()),
                ]
                sums.add_(torch.tensor(step, dtype=torch.float64))
                return value

            return loss

        self.model.train()
        for _ in range(cfg.critic.critic_epochs):
            for start in range(0, n, gbs):
                idx = list(range(start, min(n, start + gbs)))
                total = float(sum(float(np.sum(samples[sample.LOSS_MASK][i])) for i in idx)) or 1.0
                self.optimizer.zero_grad(set_to_none=True)
                self.forward.schedule(self._step_fn(samples, fit(total)), self._micro(samples, idx), False)
                norm = clip_and_step(self.net, self.optimizer)  # (a non-finite one: the update is skipped)
                grad_norm += norm
                skipped += not math.isfinite(norm)
                n_opt += 1
        if ps.get_data_parallel_world_size() > 1:  # each replica fitted its micro-batches
            dist.all_reduce(sums, group=ps.get_data_parallel_group())
        self.version += 1
        loss_sum, clipped, vsum, tokens = (float(v) for v in sums)
        return {
            "value_loss": loss_sum / max(n_opt, 1),
            "value_clipfrac": clipped / tokens if tokens else 0.0,
            "vpred_mean": vsum / tokens if tokens else 0.0,
            "grad_norm": grad_norm / max(n_opt, 1),
            "lr": float(self.optimizer.param_groups[0]["lr"]),
            "optimizer_steps": float(n_opt),
            "nonfinite_updates_skipped": float(skipped),
        }

    # -- checkpoints --------------------------------------------------------------------------------
    def _hf_weights(self) -> dict[str, torch.Tensor]:
        """The trunk in HF names (the converter's, as the policy exports it) and the head as ``score.*``:
        the weights of a ``*ForTokenClassification`` with one label, what the torch value backend loads."""
        from relax_train.backends.megatron.convert import megatron_to_hf

        layout = self.net.layout
        state = self.weights.to_global(
            {
                n: p.detach().cpu()
                for n, p in self.model.named_parameters()
                if not n.startswith("output_layer.")
            }
        )
        if not layout.tie_word_embeddings:  # (the converter wants an output layer: a stand-in, dropped)
            state["output_layer.weight"] = torch.zeros(1, 1).expand(
                layout.padded_vocab_size(1), layout.hidden_size
            )
        hf = megatron_to_hf(state, layout, include_tied_lm_head=False)
        hf.pop("lm_head.weight", None)
        hf.update({f"score.{n}": p.detach().cpu().clone() for n, p in self.head.named_parameters()})
        return {k: v.contiguous() for k, v in hf.items()}

    def _load_hf_weights(self, hf: dict[str, torch.Tensor]) -> None:
        """Put ``critic/``'s weights (trunk in HF names, head as ``score.*``) into the model, exactly."""
        from relax_train.backends.megatron.convert import hf_to_megatron_rank

        hf, head = _split_head(hf)
        if set(head) != {"weight", "bias"}:
            raise ValueError(
                f"critic weights without a whole head (score.weight, score.bias): {sorted(head)}"
            )
        if self.net.layout.tie_word_embeddings:  # (as the policy backend loads a tied model)
            hf.pop("lm_head.weight", None)
        else:
            hf = _with_lm_head_stub(hf)
        local = self.weights.to_local(
            hf_to_megatron_rank(hf, self.net.layout, tp_rank=0, ep_rank=0, tp_size=1, ep_size=1)
        )
        local.update({f"output_layer.{n}": v for n, v in head.items()})
        params = dict(self.model.named_parameters())
        missing = sorted(set(params) - set(local))
        if missing:
            raise ValueError(
                f"critic weights lack {missing[:5]} (of {len(missing)}): they are of another model"
            )
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(local[name].reshape(p.shape).to(p.dtype))

    @onloaded
    def save_checkpoint(self, path: str | Path) -> None:
        """As the torch value backend writes one: ``critic/`` (an HF ``*ForTokenClassification`` directory
        with one label: config, trunk and head weights, the source's tokenizer files; either value backend
        loads it), ``optimizer.pt`` (this backend's AdamW and the RNG states) and ``meta.json`` (the version),
        from rank 0 (every replica holds the same)."""
        from safetensors.torch import save_file
        from transformers import AutoConfig

        from relax_core.hf_files import copy_serving_files

        path = Path(path)
        weights = self._hf_weights()
        dist.barrier()
        if dist.get_rank() == 0:
            (path / CRITIC_DIR).mkdir(parents=True, exist_ok=True)
            config = AutoConfig.from_pretrained(self.model_path, num_labels=1)
            arch = (config.architectures or ["Qwen3ForCausalLM"])[0]
            base = arch.removesuffix("ForCausalLM").removesuffix(HEAD_ARCH)
            config.architectures = [base + HEAD_ARCH]
            config.save_pretrained(path / CRITIC_DIR)
            save_file(weights, str(path / CRITIC_DIR / "model.safetensors"), metadata={"format": "pt"})
            copy_serving_files(self.model_path, path / CRITIC_DIR)
            state = {**trainer_state(self.optimizer), "backend": BACKEND}
            torch.save(state, path / OPTIMIZER_FILE)
            (path / META_FILE).write_text(json.dumps({"version": self.version}, indent=1))
        dist.barrier()

    @onloaded
    def load_checkpoint(self, path: str | Path) -> dict[str, Any]:
        """Put back what :meth:`save_checkpoint` wrote (weights, AdamW's moments and step, RNG states) and
        take its version; its meta. A torch value backend's checkpoint is refused (its optimizer state is
        of other tensors): its ``critic/`` directory starts a megatron critic as --critic-checkpoint."""
        from relax_train.backends.value import read_weights

        path = Path(path)
        for name in (META_FILE, OPTIMIZER_FILE, f"{CRITIC_DIR}/config.json"):
            if not (path / name).is_file():
                raise FileNotFoundError(
                    f"critic checkpoint {path}: {name} missing; it is no critic checkpoint"
                )
        state = torch.load(path / OPTIMIZER_FILE, weights_only=False, map_location="cpu")
        if not isinstance(state, dict) or state.get("backend") != BACKEND:
            raise ValueError(
                f"critic checkpoint {path} was written by the torch value backend: resume it with "
                f"--train-backend torch, or start a megatron critic from its weights with --critic-checkpoint "
                f"{path / CRITIC_DIR} (a new optimizer)"
            )
        self._load_hf_weights(read_weights(path / CRITIC_DIR))
        meta = restore_trainer_state(state, self.optimizer, path, self.optimizer_settings)
        self.version = int(meta["version"])
        return meta

    def close(self) -> None:
        """Drop the model and optimizer (the process group stays: other roles of the process may use it)."""
        del self.optimizer, self.model, self.net, self.forward, self.weights
