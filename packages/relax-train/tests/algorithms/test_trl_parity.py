"""Our GRPO-family losses against TRL's own code, float64, random inputs with masks and uneven lengths.

TRL keeps its loss inside ``GRPOTrainer._compute_loss``. We call that method *unbound* on a minimal
stand-in object (:func:`_trl_stub`) that provides only the attributes the method reads — loss type,
clip epsilons, beta, SAPO temperatures, an identity accelerator, a metrics dict — and a
``_get_per_token_logps_and_entropies`` that returns our log-probs instead of running a model. No trainer,
model or dataset is built. ``model.training`` is False so TRL takes its no-accumulation branch. Both the
loss and its gradient with respect to the log-probs must match to 1e-6.
"""

import types
from collections import defaultdict

import pytest

torch = pytest.importorskip("torch")
GRPOTrainer = pytest.importorskip("trl.trainer.grpo_trainer").GRPOTrainer

from relax_train.algorithms.aggregation import TRL_LOSS_TYPES, aggregate_loss, entropy_bonus  # noqa: E402
from relax_train.algorithms.correction import truncated_is_weights  # noqa: E402
from relax_train.algorithms.losses import POLICY_LOSSES, LossParams, kl_k3  # noqa: E402

B, T = 6, 9
TOL = 1e-6


class _IdentityAccelerator:
    num_processes = 1
    sync_gradients = True

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        return x


def _trl_stub(loss_type, level, eps, eps_high, beta, tau_pos, tau_neg, entropy_coef, logp, entropies, use_is):
    return types.SimpleNamespace(
        loss_type=loss_type,
        importance_sampling_level=level,
        epsilon_low=eps,
        epsilon_high=eps_high,
        beta=beta,
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        use_vllm=use_is,
        vllm_importance_sampling_correction=use_is,
        model=types.SimpleNamespace(training=False),
        accelerator=_IdentityAccelerator(),
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _entropy_bonus_enabled=entropy_coef != 0.0,
        entropy_coef=entropy_coef,
        use_adaptive_entropy=False,
        aux_loss_enabled=False,
        max_completion_length=T,
        current_gradient_accumulation_steps=1,
        args=types.SimpleNamespace(
            delta=None,
            use_bias_correction_kl=False,
            sapo_temperature_pos=tau_pos,
            sapo_temperature_neg=tau_neg,
            steps_per_generation=1,
        ),
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp, entropies, None),
    )


def _inputs(seed, noise):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, T + 1, (B,), generator=g)
    lens[0] = T  # at least one full-length response
    mask = (torch.arange(T)[None, :] < lens[:, None]).to(torch.float64)
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2.0
    old = logp + torch.randn(B, T, generator=g, dtype=torch.float64) * noise
    rollout = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3
    ref = logp + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.5
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    entropies = torch.rand(B, T, generator=g, dtype=torch.float64) * 3.0
    return mask, logp, old, rollout, ref, adv, entropies


# (TRL loss_type, TRL importance_sampling_level, our POLICY_LOSSES name, extra LossParams, old-logp noise)
CASES = {
    "grpo": ("grpo", "token", "ppo", {}, 0.3),
    "bnpo": ("bnpo", "token", "ppo", {}, 0.3),
    "dapo": ("dapo", "token", "ppo", {}, 0.3),
    "dr_grpo": ("dr_grpo", "token", "ppo", {}, 0.3),
    "gspo": ("grpo", "sequence", "gspo", {}, 0.3),
    "gspo_luspo": ("luspo", "sequence", "gspo", {}, 0.3),
    "sapo": ("sapo", "token", "sapo", {}, 0.6),
    "sapo_sequence": ("sapo", "sequence", "sapo", {"sequence_level": True}, 0.6),
    "cispo": ("cispo", "token", "cispo", {}, 1.5),
}
EXTRAS = ["plain", "kl_k3", "entropy", "tis_token_truncate", "tis_sequence_mask"]


@pytest.mark.parametrize("extra", EXTRAS)
@pytest.mark.parametrize("case", list(CASES))
def test_matches_trl(case, extra):
    torch.set_num_threads(1)
    loss_type, level, ours, extra_params, noise = CASES[case]
    mask, logp0, old, rollout, ref, adv, entropies = _inputs(
        seed=len(case) * 7 + EXTRAS.index(extra), noise=noise
    )
    eps, eps_high = (0.2, 0.28) if loss_type != "cispo" else (0.2, 5.0)
    beta = 0.04 if extra == "kl_k3" else 0.0
    entropy_coef = 0.01 if extra == "entropy" else 0.0
    is_ratio = None
    if extra.startswith("tis"):
        _, lvl, mode = extra.split("_")
        is_ratio = truncated_is_weights(old, rollout, mask, level=lvl, mode=mode, clip_min=0.5, clip_max=1.5)
    tau_pos, tau_neg = 1.0, 1.05

    # TRL
    logp_trl = logp0.clone().requires_grad_(True)
    stub = _trl_stub(
        loss_type,
        level,
        eps,
        eps_high,
        beta,
        tau_pos,
        tau_neg,
        entropy_coef,
        logp_trl,
        entropies,
        is_ratio is not None,
    )
    inputs = {
        "prompt_ids": torch.zeros(B, 1, dtype=torch.long),
        "prompt_mask": torch.ones(B, 1, dtype=torch.long),
        "completion_ids": torch.zeros(B, T, dtype=torch.long),
        "completion_mask": mask,
        "advantages": adv,
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
        "num_items_in_batch": mask.sum(),
        "importance_sampling_ratio": is_ratio,
    }
    trl_loss = GRPOTrainer._compute_loss(stub, None, inputs)
    trl_loss.backward()

    # ours
    logp = logp0.clone().requires_grad_(True)
    params = LossParams(
        eps_clip=eps,
        eps_clip_high=eps_high,
        tau_pos=tau_pos,
        tau_neg=tau_neg,
        cispo_ratio_max=eps_high,
        **extra_params,
    )
    adv_tok = adv[:, None].expand(B, T)
    per_token, _ = POLICY_LOSSES[ours](logp, old, adv_tok, mask, params)
    if is_ratio is not None:
        per_token = per_token * is_ratio
    if beta:
        per_token = per_token + beta * kl_k3(logp, ref)
    loss = aggregate_loss(per_token, mask, TRL_LOSS_TYPES[loss_type], max_len=T)
    if entropy_coef:
        loss = loss + entropy_bonus(entropies, mask, entropy_coef)
    loss.backward()

    loss_diff = abs(float(loss.detach()) - float(trl_loss.detach()))
    grad_diff = float((logp.grad - logp_trl.grad).abs().max())
    print(
        f"TRL-PARITY {case:14s} {extra:20s} loss={float(loss): .6f} |dloss|={loss_diff:.1e} |dgrad|={grad_diff:.1e}"
    )
    assert loss_diff <= TOL
    assert grad_diff <= TOL
    assert float(logp.grad.abs().sum()) > 0  # the case exercises a gradient at all
