"""Other frameworks' flag names, as a slime or veRL user types them.

Three kinds, each a table: a name that is the same knob as one of ours under another name is an alias
(slime's ``--kl-loss-coef`` is our ``--kl-coef``); a name with no such knob here is refused with what to do
instead, never mapped onto something close but different (``--rollout-top-k``); a name that is ours too but
means another knob in slime or veRL starts the run with a note saying so (``--kl-coef``: slime's and veRL's
shape the reward, ours weighs the KL loss unless --kl-in-reward). The names are leaf names
(``kl_loss_coef``), as in :mod:`relax_core.cli_config`.
"""

from __future__ import annotations

from typing import Any

ALIASES: dict[str, str] = {
    "kl_loss_coef": "kl_coef",
    "ref_load": "ref_checkpoint",
    "eval_prompt_data": "eval_data",
}
"""slime's name -> ours. ``--kl-loss-coef``: the coefficient of the KL term added to the loss, ours with
--use-kl-loss (the default). ``--ref-load``: the reference model's checkpoint (here an HF directory; slime's
is a Megatron one). ``--eval-prompt-data NAME PATH``: the held-out prompts (here one set: the name is
dropped)."""

MULTI_VALUE = frozenset({"eval_prompt_data"})
"""Aliases taking several values (slime's ``nargs="+"``): every following token up to the next flag."""

NO_EQUIVALENT: dict[str, str] = {
    "rollout_top_k": "relax samples without top-k (only --rollout-top-p truncates the distribution): drop "
    "--rollout-top-k, or give -1 (off, slime's default)",
}
"""slime's names with no knob here: what to do instead."""

NEUTRAL: dict[str, tuple[Any, ...]] = {"rollout_top_k": (-1, 0)}
"""Values of a NO_EQUIVALENT name that ask for what relax does anyway: accepted and dropped."""

OTHER_MEANING: dict[str, str] = {
    "kl_coef": "in slime (--kl-coef) and veRL (algorithm.kl_ctrl.kl_coef) this name shapes the reward "
    "before the advantage; here it weighs the KL term of the loss (their --kl-loss-coef / "
    "actor.kl_loss_coef) unless --kl-in-reward. For their meaning: --kl-coef X --kl-in-reward "
    "--no-use-kl-loss",
}
"""Names that are ours and mean something else in slime or veRL: a note in --help and at start-up."""

_KL_BOTH = (
    "--kl-loss-coef {loss} and --kl-coef {other}: in slime these are two KL terms (loss and reward); here "
    "there is one, --kl-coef, in the loss (--use-kl-loss, the default) or in the reward (--kl-in-reward), "
    "not both. Keep --kl-loss-coef for the loss, or --kl-coef X --kl-in-reward --no-use-kl-loss for the "
    "reward"
)


def eval_prompt_data(values: list[Any]) -> Any:
    """slime's ``--eval-prompt-data NAME PATH`` (or a bare PATH) -> the path; several sets are refused."""
    if len(values) == 1:
        return values[0]
    if len(values) == 2:
        return values[1]
    raise ValueError(
        f"--eval-prompt-data: relax evaluates one held-out set; give --eval-data PATH (got {len(values)} values: "
        f"{' '.join(map(str, values))})"
    )


def merge(leaf: str, first: tuple[str, Any], second: tuple[str, Any]) -> Any:
    """One value for ``leaf`` set under two names (ours and an alias): the same value, or a ``ValueError``.

    slime's ``--kl-coef 0`` next to ``--kl-loss-coef X`` means no KL in the reward: X wins."""
    (n1, v1), (n2, v2) = first, second
    if v1 == v2:
        return v2
    if leaf == "kl_coef":
        loss, other = (v1, v2) if n1 == "kl_loss_coef" else (v2, v1)
        if other == 0:
            return loss
        raise ValueError(_KL_BOTH.format(loss=loss, other=other))
    a, b = ("--" + n.replace("_", "-") for n in (n1, n2))
    raise ValueError(f"{a} {v1!r} and {b} {v2!r} set the same thing here; keep one")


def start_notes(given: dict[str, str], flat: dict[str, Any]) -> list[str]:
    """Start-up notes for names the user gave (``given``: leaf -> the name typed) that mean something else
    in slime or veRL, where the meaning matters: ``--kl-coef`` > 0 without saying where the KL goes."""
    notes = []
    kl = flat.get("kl_coef")
    if given.get("kl_coef") == "kl_coef" and isinstance(kl, (int, float)) and kl > 0:
        if "kl_in_reward" not in given and "use_kl_loss" not in given:
            notes.append(f"--kl-coef {kl}: {OTHER_MEANING['kl_coef']}")
    return notes


def help_lines() -> list[str]:
    """The --help block for slime / veRL users."""
    rows = ["\nslime / veRL names:"]
    for alias, ours in ALIASES.items():
        rows.append(f"  --{alias.replace('_', '-'):30s} = --{ours.replace('_', '-')}")
    for name, why in NO_EQUIVALENT.items():
        rows.append(f"  --{name.replace('_', '-'):30s} no equivalent: {why}")
    for name, why in OTHER_MEANING.items():
        rows.append(f"  --{name.replace('_', '-'):30s} NOTE, means something else: {why}")
    return rows
