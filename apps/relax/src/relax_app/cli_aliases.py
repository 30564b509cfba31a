"""Other frameworks' flag names, as a slime or veRL user types them.

Each kind is a table: a name that is the same knob as one of ours under another name is an alias (slime's
``--kl-loss-coef`` is our ``--kl-coef``), its values translated where they are spelt otherwise
(``--kl-loss-type low_var_kl`` is ``--kl-estimator k3``); an on/off flag that sets one of our fields is a
switch (``--use-tis`` is ``--tis-mode token_truncate``); a flag that turns on what here is on once a field
is set is accepted beside that field (``--use-wandb`` with ``--wandb-project``); a name with no such knob
here is refused with what to do instead, never mapped onto something close but different
(``--rollout-top-k``); a name that is ours too but means another knob in slime or veRL starts the run with a
note saying so (``--kl-coef``). The names are leaf names (``kl_loss_coef``), as in
:mod:`relax_app.cli_config`, which also hints, for an unknown flag, a close name of these tables before a
close name of ours (``--use-wandb`` was hinted ``--use-actor-fwd``).

slime's names are from its ``slime/utils/arguments.py`` (and the flags its example scripts set most).
"""

from __future__ import annotations

from typing import Any

ALIASES: dict[str, str] = {
    "kl_loss_coef": "kl_coef",
    "kl_loss_type": "kl_estimator",
    "ref_load": "ref_checkpoint",
    "eval_prompt_data": "eval_data",
    "tis_clip": "tis_cap",
    "learning_rate": "lr",
    "model_path": "hf_checkpoint",
    "use_tensorboard": "tensorboard",
    "lora_r": "lora_rank",
    "target_modules": "lora_target_modules",
    "lora_rollout_sync_mode": "lora_sync_mode",
    "lam": "lambd",
    "cliprange_value": "value_clip",
    "critic_ppo_epochs": "critic_epochs",
    "critic_learning_rate": "critic_lr",
    "critic_model_path": "critic_checkpoint",
    "critic_pretrain": "critic_checkpoint",
}
"""slime's (and veRL's, HF's, SGLang's) name -> ours. ``--kl-loss-coef``: the coefficient of the KL term
added to the loss, ours with --use-kl-loss (the default). ``--kl-loss-type``: its estimator (values in
:data:`VALUES`). ``--ref-load``: the reference model's checkpoint (here an HF directory; slime's is a
Megatron one). ``--eval-prompt-data NAME PATH``: the held-out prompts (here one set: the name is dropped).
``--tis-clip``: the upper clamp of the TIS weight. ``--learning-rate``: HF's and TRL's name of --lr.
``--model-path``: SGLang's and veRL's (``actor_rollout_ref.model.path``) name of the policy checkpoint.
``--use-tensorboard``: TensorBoard event files (on here by default). ``--lora-r``: TRL's (PEFT's) LoRA rank.
``--target-modules``: veRL's ``model.target_modules``. ``--lora-rollout-sync-mode``: slime's choice of
sending adapters (``native_adapter``) or merged weights (``merged``). ``--lam``: veRL's ``algorithm.lam`` (GAE's
λ, our and OpenRLHF's --lambd). ``--cliprange-value``: veRL's ``critic.cliprange_value``. ``--critic-ppo-epochs``:
veRL's ``critic.ppo_epochs``. ``--critic-learning-rate``: OpenRLHF's. ``--critic-model-path``: veRL's
``critic.model.path``; ``--critic-pretrain``: OpenRLHF's."""

VALUES: dict[str, dict[Any, Any]] = {
    "kl_loss_type": {"low_var_kl": "k3", "kl": "k1", "mse": "k2"},
    "lora_rollout_sync_mode": {"native_adapter": "adapter"},
}
"""An alias's values spelt otherwise here: slime's and veRL's ``low_var_kl`` is k3 clamped to ±10, which
our k3 is; veRL's ``kl`` / ``mse`` are k1 / k2. slime's ``native_adapter`` is our ``adapter``."""

SWITCHES: dict[str, tuple[str, Any]] = {
    "use_tis": ("tis_mode", "token_truncate"),
    "disable_grpo_std_normalization": ("normalize_advantages_std", False),
    "offload_rollout": ("offload", True),
    "offload_train": ("offload", True),
    "bf16": ("dtype", "bfloat16"),
    "fp16": ("dtype", "float16"),
}
"""slime's on/off flags -> the field and value they stand for. ``--use-tis``: each token's loss weighted by
π_old / π_rollout clamped to --tis-clip (slime's vanilla TIS: our --tis-mode token_truncate, --tis-cap).
``--disable-grpo-std-normalization``: Dr.GRPO's centring without the std. ``--offload-rollout`` / ``--offload-train``: slime's
halves of colocate's hand-over, which --offload does both of. ``--bf16`` / ``--fp16``: Megatron's precision,
our --dtype. Off (``--use-tis false``) sets nothing."""

ENABLES: dict[str, tuple[str, str]] = {
    "use_wandb": (
        "wandb_project",
        "W&B logging is on here when --wandb-project NAME is given (offline unless --wandb-mode online)",
    ),
    "use_lora": (
        "lora_rank",
        "slime's --use-lora: LoRA is on here when --lora-rank N is given (e.g. --lora-rank 8)",
    ),
    "use_peft": (
        "lora_rank",
        "TRL's --use_peft: LoRA is on here when --lora-rank N is given (e.g. --lora-rank 8)",
    ),
}
"""slime's switches for what is on here once a field is set: accepted beside that field, refused without it
(saying what to add), so a run asked to log to W&B never runs without it."""

MULTI_VALUE = frozenset(
    {
        "eval_prompt_data",
        "rollout_stop",
        "rollout_stop_token_ids",
        "lora_target_modules",
        "target_modules",
        "lora_target_parameters",
    }
)
"""Names taking several values on the command line (slime's ``nargs="+"``): every following token up to the
next flag (``--rollout-stop '</answer>' '###'``); one value may also be a YAML list (``'["a", "b"]'``)."""

STRING_LISTS = frozenset({"rollout_stop", "lora_target_modules", "target_modules", "lora_target_parameters"})
"""The :data:`MULTI_VALUE` names whose values are strings (the rest are token ids)."""


NO_EQUIVALENT: dict[str, str] = {
    "rollout_top_k": "relax samples without top-k (only --rollout-top-p truncates the distribution): drop "
    "--rollout-top-k, or give -1 (off, slime's default)",
    "tis_clip_low": "the TIS weight is clamped above only (--tis-cap); slime's default 0 is the same",
    "num_epoch": "give the number of steps, --num-rollout N (an epoch is the prompt rows / --rollout-batch-size "
    "steps)",
    "optimizer": "relax trains with AdamW (--lr, --weight-decay, --adam-beta1, --adam-beta2); give adam or drop it",
    "lr_decay_style": "the learning rate is constant here; give constant or drop it",
    "n_samples_per_eval_prompt": "held-out evaluation here is greedy, one answer per prompt; give 1 or drop it",
    "eval_max_response_len": "held-out answers are as long as training's, --rollout-max-response-len; drop it",
    "rollout_max_prompt_len": "prompts are never cut: a prompt that leaves no room for --rollout-max-response-len "
    "in the model's context is skipped and counted; drop it",
    "wandb_key": "log in once with `wandb login` (or set WANDB_API_KEY); drop it",
    "wandb_group": "the W&B run is named after --output-dir; drop it",
    "lora_save_merged_hf": "every --save checkpoint holds the adapter (adapter/); --lora-save-merged adds the "
    "merged HF model beside it (model_merged/): give --lora-save-merged instead of a directory",
    "save_lora": "every --save checkpoint holds the adapter in peft's format (adapter/): drop --save-lora",
    "attention_dropout": "relax trains with the checkpoint's own dropout (its config.json; 0 in Qwen3, "
    "as RL wants): give 0 or drop it",
    "hidden_dropout": "relax trains with the checkpoint's own dropout (its config.json; 0 in Qwen3, as RL "
    "wants): give 0 or drop it",
}
"""slime's names with no knob here: what to do instead."""

NEUTRAL: dict[str, tuple[Any, ...]] = {
    "rollout_top_k": (-1, 0),
    "tis_clip_low": (0, 0.0),
    "optimizer": ("adam",),
    "lr_decay_style": ("constant",),
    "n_samples_per_eval_prompt": (1,),
    "attention_dropout": (0, 0.0),
    "hidden_dropout": (0, 0.0),
}
"""Values of a NO_EQUIVALENT name that ask for what relax does anyway: accepted and dropped."""


def _reward_path(value: Any) -> str:
    """slime's ``--custom-rm-path pkg.mod.fn`` -> our ``--rm-type pkg.mod:fn`` (a path with ``:`` as is)."""
    text = str(value)
    if ":" in text or "." not in text:
        return text
    module, _, fn = text.rpartition(".")
    return f"{module}:{fn}"


def _group_filter(value: Any) -> bool:
    """slime's ``--dynamic-sampling-filter-path``: its filter of groups whose rewards differ is our
    --dynamic-sampling; another filter has no equivalent."""
    if str(value).rpartition(".")[2] == "check_reward_nonzero_std":
        return True
    raise ValueError(
        f"--dynamic-sampling-filter-path {value}: relax's --dynamic-sampling keeps the groups whose rewards "
        "differ (slime's check_reward_nonzero_std); another filter has no equivalent here: give that one, "
        "or drop the flag"
    )


CONVERTS: dict[str, tuple[str, Any]] = {
    "custom_rm_path": ("rm_type", _reward_path),
    "dynamic_sampling_filter_path": ("dynamic_sampling", _group_filter),
}
"""slime's names whose value becomes another field's: name -> (field, converter; ``ValueError`` for a value
with no equivalent). ``--custom-rm-path pkg.mod.fn``: the reward function (our --rm-type pkg.mod:fn)."""

REFUSED_SWITCHES: dict[str, str] = {
    "no_load_optim": "--load restores the optimizer with the weights; to start a fresh optimizer from trained "
    "weights, export them (`relax export CKPT OUT`) and give OUT as --hf-checkpoint",
    "no_load_rng": "--load restores the random state with the weights; to draw afresh give another --seed",
    "finetune": "--load resumes a run (its step, optimizer and data position); to start a new run from "
    "trained weights, export them (`relax export CKPT OUT`) and give OUT as --hf-checkpoint",
}
"""slime's on/off flags with no equivalent here: what to do instead."""

_ARCH = (
    "the architecture is read from --hf-checkpoint's config.json here: slime's MODEL_ARGS "
    "(scripts/models/*.sh) are accepted and not used"
)
_MEGATRON = "Megatron's own setting, which relax's backends choose themselves: accepted and not used"
_THROUGHPUT = "a throughput setting of slime's with no equivalent here: accepted and not used"
_GREEDY = "held-out answers here are greedy (sampling settings do not change them): accepted and not used"
IGNORED: dict[str, str] = {
    **dict.fromkeys(
        "swiglu num_layers hidden_size ffn_hidden_size num_attention_heads group_query_attention "
        "num_query_groups use_rotary_position_embeddings disable_bias_linear normalization norm_epsilon "
        "rotary_base vocab_size kv_channels qk_layernorm untie_embeddings_and_output_weights "
        "position_embedding_type add_qkv_bias rotary_percent make_vocab_size_divisible_by "
        "max_position_embeddings num_experts moe_ffn_hidden_size moe_router_topk "
        "moe_shared_expert_intermediate_size moe_router_score_function moe_router_load_balancing_type "
        "moe_aux_loss_coeff moe_grouped_gemm moe_token_dispatcher_type moe_router_pre_softmax "
        "moe_layer_freq moe_router_dtype moe_router_enable_expert_bias moe_router_bias_update_rate "
        "moe_router_topk_scaling_factor".split(),
        _ARCH,
    ),
    **dict.fromkeys(
        "seq_length accumulate_allreduce_grads_in_fp32 attention_softmax_in_fp32 attention_backend "
        "recompute_granularity recompute_method recompute_num_layers use_precision_aware_optimizer "
        "optimizer_cpu_offload overlap_cpu_optimizer_d2h_h2d megatron_to_hf_mode".split(),
        _MEGATRON,
    ),
    **dict.fromkeys(
        "balance_data over_sampling_batch_size keep_old_actor rollout_num_process".split(), _THROUGHPUT
    ),
    **dict.fromkeys("eval_top_p eval_temperature eval_top_k".split(), _GREEDY),
}
"""slime's names accepted and not used, each with why (one start-up note per reason lists those given):
the model's shape (from the checkpoint here), Megatron's numerics and memory settings (activation
recomputation, fused-softmax precision: relax's backends choose them), throughput knobs of slime's own
scheduling (``--balance-data``, ``--over-sampling-batch-size``: dynamic sampling draws more prompts as it
needs, ``--keep-old-actor``: relax keeps what an importance ratio needs itself), and evaluation sampling
(greedy here)."""

DOTTED: dict[str, str] = {
    "data.train_files": "prompt_data",
    "data.val_files": "eval_data",
    "data.prompt_key": "input_key",
    "data.train_batch_size": "rollout_batch_size",
    "data.max_response_length": "rollout_max_response_len",
    "data.shuffle": "rollout_shuffle",
    "actor_rollout_ref.model.path": "hf_checkpoint",
    "actor_rollout_ref.actor.optim.lr": "lr",
    "actor_rollout_ref.actor.optim.weight_decay": "weight_decay",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "micro_batch_size",
    "actor_rollout_ref.actor.use_kl_loss": "use_kl_loss",
    "actor_rollout_ref.actor.kl_loss_coef": "kl_coef",
    "actor_rollout_ref.actor.kl_loss_type": "kl_estimator",
    "actor_rollout_ref.actor.entropy_coeff": "entropy_coef",
    "actor_rollout_ref.actor.clip_ratio": "eps_clip",
    "actor_rollout_ref.actor.clip_ratio_low": "eps_clip",
    "actor_rollout_ref.actor.clip_ratio_high": "eps_clip_high",
    "actor_rollout_ref.actor.clip_ratio_c": "eps_clip_c",
    "actor_rollout_ref.actor.loss_agg_mode": "loss_agg_mode",
    "actor_rollout_ref.actor.grad_clip": "clip_grad",
    "actor_rollout_ref.actor.use_dynamic_bsz": "use_dynamic_batch_size",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": "max_tokens_per_gpu",
    "actor_rollout_ref.actor.megatron.tensor_model_parallel_size": "tensor_model_parallel_size",
    "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size": "pipeline_model_parallel_size",
    "actor_rollout_ref.ref.model.path": "ref_checkpoint",
    "actor_rollout_ref.rollout.n": "n_samples_per_prompt",
    "actor_rollout_ref.rollout.temperature": "rollout_temperature",
    "actor_rollout_ref.rollout.top_p": "rollout_top_p",
    "actor_rollout_ref.rollout.response_length": "rollout_max_response_len",
    "actor_rollout_ref.rollout.tensor_model_parallel_size": "rollout_num_gpus_per_engine",
    "actor_rollout_ref.rollout.gpu_memory_utilization": "sglang_mem_fraction_static",
    "algorithm.adv_estimator": "advantage_estimator",
    "algorithm.use_kl_in_reward": "kl_in_reward",
    "algorithm.norm_adv_by_std_in_grpo": "normalize_advantages_std",
    "algorithm.lam": "lambd",
    "trainer.total_training_steps": "num_rollout",
    "trainer.save_freq": "save_interval",
    "trainer.test_freq": "eval_interval",
    "trainer.default_local_dir": "save",
    "trainer.nnodes": "actor_num_nodes",
    "trainer.n_gpus_per_node": "actor_num_gpus_per_node",
    "trainer.seed": "seed",
    "critic.model.path": "critic_checkpoint",
    "critic.optim.lr": "critic_lr",
    "critic.ppo_epochs": "critic_epochs",
    "critic.cliprange_value": "value_clip",
}
"""veRL's Hydra override paths (``actor_rollout_ref.actor.optim.lr=1e-6``, from its ppo_trainer.yaml) that
are one of our fields; values as :data:`DOTTED_VALUES` spells them. ``algorithm.kl_ctrl.kl_coef`` is the
coefficient of veRL's KL in the reward: ours with ``algorithm.use_kl_in_reward=True``
(:func:`check_enabled`). Other veRL paths are refused naming what to give (:data:`DOTTED_REFUSED`)."""

DOTTED_VALUES: dict[str, dict[Any, Any]] = {
    "actor_rollout_ref.actor.kl_loss_type": VALUES["kl_loss_type"],
    "actor_rollout_ref.actor.loss_agg_mode": {"seq-mean-token-sum-norm": "seq-mean-token-sum-norm"},
    "algorithm.adv_estimator": {"reinforce_plus_plus": "reinforce_plus_plus", "grpo": "grpo", "rloo": "rloo"},
}

DOTTED_REFUSED: dict[str, str] = {
    "actor_rollout_ref.actor.ppo_mini_batch_size": "veRL counts it in prompts: give --global-batch-size "
    "(samples per optimizer step) = ppo_mini_batch_size x rollout.n",
    "data.max_prompt_length": NO_EQUIVALENT["rollout_max_prompt_len"],
    "trainer.total_epochs": NO_EQUIVALENT["num_epoch"],
    "actor_rollout_ref.rollout.name": "the rollout backend is --rollout-backend (torch, sglang or external)",
    "custom_reward_function.path": "give the reward as --rm-type pkg.module:function (an importable module)",
    "custom_reward_function.name": "give the reward as --rm-type pkg.module:function (an importable module)",
}
"""veRL paths with no field of ours: what to give instead."""


def dotted(path: str, value: Any) -> tuple[str, Any]:
    """A ``key=value`` override -> (our leaf, value): veRL's path (:data:`DOTTED`), our own ``section.field``
    or ``field`` (``train.lr=1e-6``, ``lr=1e-6``). ``ValueError`` naming the path and what to give."""
    from relax_core.config import RelaxConfig

    if path == "algorithm.kl_ctrl.kl_coef":
        return "kl_coef", value  # (with algorithm.use_kl_in_reward=True only: check_enabled)
    if path in DOTTED:
        return DOTTED[path], DOTTED_VALUES.get(path, {}).get(value, value) if isinstance(
            value, str
        ) else value
    if path in DOTTED_REFUSED:
        raise ValueError(f"{path}={value}: no equivalent in relax; {DOTTED_REFUSED[path]}")
    section, _, name = path.rpartition(".")
    name = name.replace("-", "_")
    if section in ("", *RelaxConfig.model_fields):
        return ALIASES.get(name, name), translate(name, value)
    import difflib

    close = difflib.get_close_matches(path, [*DOTTED, *DOTTED_REFUSED], n=1, cutoff=0.75)
    hint = f" (did you mean {close[0]}?)" if close else ""
    raise ValueError(
        f"{path}={value}: not a veRL path relax maps{hint}; give our flag for it (relax train --help lists "
        "them, and veRL's names each maps)"
    )


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


def table_names() -> list[str]:
    """Every name of these tables (hinted before our own names for an unknown flag)."""
    return [
        *ALIASES,
        *SWITCHES,
        *ENABLES,
        *NO_EQUIVALENT,
        *MULTI_VALUE,
        *CONVERTS,
        *REFUSED_SWITCHES,
        *IGNORED,
    ]


def translate(name: str, value: Any) -> Any:
    """``value`` given under ``name``, in our spelling (:data:`VALUES`)."""
    spelt = VALUES.get(name, {})
    return spelt.get(value, value) if isinstance(value, str) else value


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


def multi_value(name: str, values: list[Any]) -> Any:
    """One value of a :data:`MULTI_VALUE` name given as ``values`` (the command line's tokens, or a YAML
    value as a list); ``ValueError`` naming the flag."""
    if name == "eval_prompt_data":
        return eval_prompt_data(values)
    if len(values) == 1 and isinstance(values[0], str) and values[0].lstrip().startswith("["):
        import yaml

        try:
            values = yaml.safe_load(values[0])
        except yaml.YAMLError:
            raise ValueError(f"--{name.replace('_', '-')}: {values[0]!r} is not a YAML list") from None
    if name in STRING_LISTS:
        return [str(v) for v in values]
    ids = []
    for v in values:
        if isinstance(v, bool) or not (isinstance(v, int) or (isinstance(v, str) and v.strip().isdigit())):
            raise ValueError(f"--{name.replace('_', '-')}: token ids are integers >= 0 (got {v!r})")
        ids.append(int(v))
    return ids


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


def check_enabled(given: dict[str, str], flat: dict[str, Any]) -> None:
    """``ValueError`` for an :data:`ENABLES` switch given (``given`` holds it under its own name) without the
    field that turns its feature on here, and for veRL's ``algorithm.kl_ctrl.kl_coef`` without its
    ``algorithm.use_kl_in_reward=True`` (veRL ignores it then; here it would weigh the KL of the loss)."""
    if given.get("kl_coef") == "algorithm.kl_ctrl.kl_coef" and not flat.get("kl_in_reward"):
        raise ValueError(
            f"algorithm.kl_ctrl.kl_coef={flat.get('kl_coef')}: veRL uses it only with "
            "algorithm.use_kl_in_reward=True; add that (it is --kl-in-reward here), or drop it (the KL of the "
            "loss is actor_rollout_ref.actor.kl_loss_coef, --kl-coef here)"
        )
    for name, (field, what) in ENABLES.items():
        if name in given and not flat.get(field):
            flag = "--" + field.replace("_", "-")
            raise ValueError(
                f"--{name.replace('_', '-')}: {what}; add {flag} (--{name.replace('_', '-')} may stay)"
            )


def start_notes(given: dict[str, str], flat: dict[str, Any]) -> list[str]:
    """Start-up notes for names the user gave (``given``: leaf -> the name typed) that mean something else
    in slime or veRL, where the meaning matters: ``--kl-coef`` > 0 without saying where the KL goes."""
    notes = []
    ignored: dict[str, list[str]] = {}
    for name in given:
        if name in IGNORED:
            ignored.setdefault(IGNORED[name], []).append("--" + name.replace("_", "-"))
    notes += [f"{', '.join(names)}: {why}" for why, names in ignored.items()]
    kl = flat.get("kl_coef")
    if given.get("kl_coef") == "kl_coef" and isinstance(kl, (int, float)) and kl > 0:
        if "kl_in_reward" not in given and "use_kl_loss" not in given:
            notes.append(f"--kl-coef {kl}: {OTHER_MEANING['kl_coef']}")
    return notes


def help_rows() -> list[tuple[str, str]]:
    """(names, what they mean here) for the --help block of slime / veRL names."""

    def flag(n: str) -> str:
        return "--" + n.replace("_", "-")

    rows = []
    for alias, ours in ALIASES.items():
        spelt = "".join(f"; {theirs} = {v}" for theirs, v in VALUES.get(alias, {}).items())
        rows.append((flag(alias), f"= {flag(ours)}{spelt}"))
    for name, (field, value) in SWITCHES.items():
        rows.append((flag(name), f"= {flag(field)} {value}"))
    for name, (field, what) in ENABLES.items():
        rows.append((flag(name), f"accepted with {flag(field)}: {what}"))
    for name, (field, _) in CONVERTS.items():
        rows.append((flag(name), f"= {flag(field)} (see the table's docstring for the values)"))
    for name, why in NO_EQUIVALENT.items():
        rows.append((flag(name), f"no equivalent: {why}"))
    for name, why in REFUSED_SWITCHES.items():
        rows.append((flag(name), f"no equivalent: {why}"))
    for why in dict.fromkeys(IGNORED.values()):
        names = [flag(n) for n, w in IGNORED.items() if w == why]
        rows.append((" ".join(names[:4]) + (" ..." if len(names) > 4 else ""), why))
    for name, why in OTHER_MEANING.items():
        rows.append((flag(name), f"NOTE, means something else: {why}"))
    return rows
