"""The sections of the run configuration: one pydantic model per concern (model, data, rollout, train,
algorithm, run), every field documented, bounded and validated on its own.

Why apart from :mod:`relax_core.config`: the rules *across* sections (:mod:`relax_core.config_checks`) read
these types, and :class:`~relax_core.config.RelaxConfig` runs those rules; with the sections here both import
this module and neither imports the other back. Field names match the flags users of upstream Relax and slime
know: every leaf field ``foo_bar`` is also the command-line flag ``--foo-bar`` (see :mod:`relax_app.cli_config`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)


class ModelConfig(Section):
    hf_checkpoint: str | None = None
    """Directory of the policy: an HF checkpoint (config.json, safetensors, tokenizer). None with no
    --prompt-data runs the built-in CPU demo, which builds its own tiny model."""
    ref_checkpoint: str | None = None
    """Reference model for the KL term; defaults to --hf-checkpoint (the starting policy)."""
    teacher_checkpoint: str | None = None
    """Teacher for on-policy distillation: starts the Teacher role, whose log-probs of the student's own
    sampled tokens go on the bus (teacher_log_probs) and pull the student towards it (--distill-mode). Must
    share the policy's tokenizer; may be a larger model."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype for rollout and training. float32 on CPU."""
    torch_compile: bool = False
    """Run the trainer's forward (and so its backward) and the torch engine's forward through
    torch.compile (inductor; on CPU it needs a C++ compiler). Where it cannot compile, the run says why
    once and runs eager. Off by default: on the CPU demo a training step ran 1.4x faster after ~2 minutes
    of compiling, more than a 100-step run takes (BENCHMARKS.md); worth it for long runs."""


class DataConfig(Section):
    prompt_data: str | None = None
    """Training prompts, one per row: a local .jsonl, .json, .parquet or .arrow file, or a folder the
    datasets library saved (Dataset.save_to_disk)."""
    input_key: str = "prompt"
    """Column holding the prompt: text, or chat messages (a list of {"role", "content"}, veRL's and slime's
    layout) that the chat template renders with their roles. A dotted path reads a nested field."""
    label_key: str = "label"
    """Column holding the reference answer given to the reward; a dotted path reads a nested field
    (veRL's reward_model.ground_truth). Null: a label-free row (counted as unlabeled)."""
    metadata_key: str | None = None
    """Optional column of per-sample metadata for the reward (rm_type, veRL's extra_info), a dotted path too."""
    eval_data: str | None = None
    """Held-out prompts (same format) for greedy evaluation; None disables evaluation."""
    eval_max_samples: int = Field(500, ge=1)
    """Evaluate on at most this many held-out rows."""
    apply_chat_template: bool = False
    """Wrap each text prompt as one user turn of the chat template (chat messages always go through it)."""
    rollout_shuffle: bool = True
    """Shuffle prompts each epoch (seeded by --seed)."""
    multimodal_keys: dict[str, str] | None = None
    """Media columns by modality, e.g. '{image: image_file, video: clip, audio: speech}' (upstream Relax's
    --multimodal-keys); a column may hold one item or a list. Needs a Qwen-VL/Omni checkpoint; the prompt
    marks where media go with <image>/<video>/<audio> (or the model's pad tokens)."""
    multimodal_options: dict[str, Any] = Field(default_factory=dict)
    """Extra relax_multimodal.MultimodalConfig settings, e.g. '{image_max_pixels: 65536, video_fps: 2}'."""


class RolloutConfig(Section):
    rollout_backend: Literal["torch", "sglang", "external"] = "torch"
    """Inference engine: torch (CPU / small runs), sglang (GPU server), external (a running server)."""
    rollout_batch_size: int = Field(16, ge=1)
    """Prompts per rollout step; each yields --n-samples-per-prompt responses."""
    n_samples_per_prompt: int = Field(8, ge=1)
    """Responses sampled per prompt (the GRPO group size)."""
    rollout_max_response_len: int = Field(512, ge=1)
    """Maximum new tokens per response (per model turn in a multi-turn episode). 512 is veRL's
    data.max_response_length (slime has no default: SGLang's, up to the context); reasoning tasks need
    thousands (the DAPO recipe: 8192). A prompt that leaves no room for it in the model's context is skipped
    and counted."""
    env_path: str | None = None
    """Agentic multi-turn RL: an environment class 'pkg.mod:Class' (relax_core.env.Environment) built per
    sample with its prompt, label and metadata; the model and the environment take turns until it is done."""
    max_turns: int = Field(4, ge=1)
    """With --env-path: at most this many model turns per episode."""
    max_total_tokens: int = Field(256, ge=1)
    """With --env-path: token budget of an episode's response (model and environment tokens after the first
    prompt); reaching it ends the episode."""
    env_step_timeout_s: float = Field(10.0, gt=0.0)
    """With --env-path: an environment call taking longer ends that sample (recorded as env_timeout)."""
    rollout_temperature: float = Field(1.0, gt=0.0)
    """Sampling temperature; log-probs are computed at this temperature by every role."""
    rollout_top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling threshold (1.0 disables it)."""
    rollout_stop: list[str] = []
    """Stop strings of rollouts and held-out evaluation (slime's --rollout-stop, SGLang's ``stop``): a response
    ends with the token after which its text contains one of them; that token is kept and trained on. Several: ``--rollout-stop '</answer>' '###'``
    (or a YAML list)."""
    rollout_stop_token_ids: list[int] = []
    """Token ids that end a response besides the tokenizer's EOS (slime's --rollout-stop-token-ids), kept and
    trained on like EOS: e.g. a chat model's end-of-turn token when it is not its EOS."""
    rm_type: str = "math"
    """Reward name in the relax-rewards registry (or a dotted path 'pkg.mod:fn'); a sample's own
    metadata rm_type overrides it."""
    eval_rm_type: str | None = None
    """Reward that scores held-out evaluation; defaults to --rm-type. Set it when the training reward is
    not the task's (e.g. --rm-type none for pure distillation: --eval-rm-type math)."""
    reward_timeout_s: float = Field(10.0, gt=0.0)
    """Per-call reward time-out; a reward that exceeds it scores the fallback and is counted."""
    reward_concurrency: int = Field(8, ge=1)
    """Reward calls run concurrently per rollout batch, at most this many at once."""
    reward_isolation: Literal["thread", "process"] = "thread"
    """Where reward calls run: "thread" (cheapest) or "process" (pooled worker processes: a reward that
    hangs in C code is killed at its time-out, one that crashes, calls os._exit or is killed scores the
    fallback as a "crashed" failure instead of ending the run). Use "process" for untrusted or CPU-heavy
    reward code; the reward must be importable by name (registered, or a dotted path)."""
    reward_memory_limit_mb: int | None = Field(None, ge=1)
    """With --reward-isolation process: each reward worker's address-space limit (MiB); a call past it
    fails (counted), the run goes on."""
    reward_delay_s: float = Field(0.0, ge=0.0)
    """Extra latency added to every reward call, to emulate a remote judge (benchmarks)."""
    dynamic_sampling: bool = False
    """DAPO dynamic sampling: drop groups whose rewards are all equal (zero advantage, no gradient) and
    generate more prompts until the batch holds --rollout-batch-size informative groups."""
    dynamic_sampling_max_rounds: int = Field(8, ge=1)
    """Dynamic sampling: at most this many extra generation rounds per batch; if the batch is still short,
    it is filled with uninformative groups (counted in the metrics) so training never stalls."""
    streaming_rollout: bool = False
    """Fully async: keep up to --max-inflight-groups prompt groups generating, each response its own
    request (the torch engine batches them continuously), and put each group on the bus the moment its
    last response ends, scored meanwhile; the trainer takes rollout step k's groups at version k."""
    max_inflight_groups: int | None = Field(None, ge=1)
    """--streaming-rollout: prompt groups generating at once; default --rollout-batch-size × (--max-staleness
    + 1), every step the staleness bound admits."""
    max_inflight_requests: int = Field(512, ge=1)
    """--streaming-rollout with engines in processes or servers (sglang, external, --rollout-engines): requests
    sent at once, each a thread waiting on its reply; the rest of the groups' responses wait their turn
    (the in-process torch engine runs them all in its continuous batch). slime's --sglang-server-concurrency
    (default 512) bounds its requests so."""
    partial_rollout: bool = False
    """--streaming-rollout: responses in flight go on under new weights (the torch engine swaps them
    between decode steps; each token records its version, a sample's staleness is its oldest token's).
    Without it an update waits until the responses in flight end, and none starts meanwhile. SGLang engines
    run with their overlap scheduler and prefix cache off (exact versions; no prompt served from KV of old
    weights)."""
    mask_offpolicy_in_partial_rollout: bool = False
    """--partial-rollout: train only on the tokens of a response's last weight version; the earlier ones
    (sampled before an update) are masked from the loss (upstream Relax's flag of the same name)."""
    long_tail_min_tokens: int = Field(0, ge=0)
    """Benchmark knob: if > 0, each response is forced to a minimum length drawn from a long-tailed
    distribution with this scale (EOS suppressed until then), emulating long-tail generation."""
    long_tail_exact: bool = False
    """Benchmark knob, with --long-tail-min-tokens: each response ends at exactly its drawn length (at
    least 1), for a model that never learned to stop (random weights) to show the long tail too."""
    rollout_external_urls: list[str] = []
    """Base URLs (``http://host:port``) of running SGLang-compatible engine servers, e.g. SGLang or
    ``python -m relax_rollout.server``; required by (and only used with) --rollout-backend external. With
    --partial-rollout, SGLang servers must run with ``--disable-radix-cache`` (checked at the start) and
    should with ``--disable-overlap-schedule`` (exact per-token versions)."""
    rollout_num_gpus: int = Field(0, ge=0)
    """GPUs for rollout engines in total (--rollout-backend sglang); 0 with the torch engine on CPU."""
    rollout_num_gpus_per_engine: int = Field(1, ge=1)
    """GPUs per SGLang engine (its tensor-parallel size); engines = rollout-num-gpus / this."""
    sglang_mem_fraction_static: float | None = Field(None, gt=0.0, lt=1.0)
    """SGLang's --mem-fraction-static (KV cache share of GPU memory); None = SGLang's default."""
    sglang_server_args: dict[str, Any] = Field(default_factory=dict)
    """Extra `sglang.launch_server` flags, e.g. '{context_length: 32768, chunked_prefill_size: 4096}'."""
    sglang_model_path: str | None = None
    """The checkpoint SGLang serves, when not --hf-checkpoint: Qwen3-Omni, whose thinker the trainer takes
    saved alone (`relax prepare-model omni-thinker`) while SGLang serves only the whole model; weight
    updates then carry the whole model's `thinker.` names."""
    sglang_python: str | None = None
    """The Python that runs ``-m sglang.launch_server`` (default: this process's), e.g. a venv of its own
    when SGLang's pins clash with the trainer's (``tools/sglang-cpu/setup.sh`` builds one for a CPU)."""
    sglang_env: dict[str, str] = Field(default_factory=dict)
    """Environment variables for the SGLang processes, e.g. '{SGLANG_USE_CPU_ENGINE: "1"}' on a CPU."""
    sglang_weight_update: Literal["disk", "distributed", "tensor", "delta"] = "disk"
    """How new weights reach the SGLang engines: ``disk``, safetensors written once per version and loaded
    by every engine (a restarted engine loads them too; on several nodes under the output directory,
    which every node must see); ``distributed``, broadcast by the rollout role on SGLang's weight group
    (NCCL from GPU weights, gloo from host memory), no disk and no shared directory, bucketed; ``tensor``,
    CUDA-IPC handles to engines on the rollout role's GPUs (colocated); ``delta``, each version as its
    difference from the one the engines hold, to SGLang's custom loader (``relax_rollout.sglang_delta_loader``,
    registered at launch), engines on the rollout role's host; the first version, a restarted or new
    engine's and every 50th go full. Bitwise; on one node it pauses SGLang longer than ``distributed`` (the
    decode runs in SGLang's scheduler: BENCHMARKS.md), so it is for a slow rollout-to-server link; across
    nodes the bytes to save are the trainer's, ``--weight-sync-delta``."""
    rollout_engines: int = Field(0, ge=0)
    """Engine processes launched on the Ray cluster (``ray_native``) and driven over HTTP through one pool;
    0 runs the engine inside the rollout role (the default). With engines in their own processes, a crashed
    engine's requests are re-issued on the others and the engine is restarted, and the elastic API can add
    or remove engines mid-run. Fully-async mode only."""
    elastic_port: int | None = Field(None, ge=0, le=65535)
    """Serve the elastic rollout REST API (scale out/in, operations, engines, /elastic/openapi.json) on this
    port (0: any free port, written to output_dir/elastic.json); None: no API."""
    elastic_host: str = "127.0.0.1"
    """Bind address of the elastic API; anything but loopback needs --elastic-token. ``node``: the rollout
    role's node address, for a run across nodes; its engines then bind their own node's address too
    (reached with the elastic token, which external engines joining it must take), and a scale-out may
    name the node to launch engines on."""
    elastic_token: str | None = None
    """Bearer token the elastic API requires (mandatory when --elastic-host is not loopback; not blank)."""
    elastic_max_engines: int | None = Field(None, ge=1)
    """The most engines a scale-out may ask for; None: the Ray cluster's CPUs (each engine takes a core)."""
    drain_timeout_s: float = Field(30.0, gt=0.0)
    """Scale-in: how long a removed engine may finish its in-flight requests before they are aborted and
    re-issued on the remaining engines."""

    @field_validator("rollout_stop")
    @classmethod
    def _stops(cls, v: list[str]) -> list[str]:
        if any(not s for s in v):
            raise ValueError("an empty stop string would end every response at its first token; drop it")
        return v

    @field_validator("rollout_stop_token_ids")
    @classmethod
    def _stop_ids(cls, v: list[int]) -> list[int]:
        if any(i < 0 for i in v):
            raise ValueError(f"token ids are >= 0 (got {[i for i in v if i < 0]})")
        return v

    @model_validator(mode="after")
    def _check_external(self) -> RolloutConfig:
        if self.rollout_backend == "external" and not self.rollout_external_urls:
            raise ValueError(
                "--rollout-backend external needs --rollout-external-urls (the engine servers' URLs)"
            )
        return self


class TrainConfig(Section):
    train_backend: Literal["torch", "megatron"] = "torch"
    """Training backend: torch (HF model; CPU or small GPU runs) or megatron (megatron-core on GPU)."""
    num_rollout: int = Field(40, ge=1)
    """Number of RL steps (rollout batches trained on)."""
    global_batch_size: int | None = Field(None, ge=1)
    """Samples per optimizer step; default = rollout-batch-size × n-samples-per-prompt (one step per
    rollout). Must divide that product."""
    micro_batch_size: int = Field(32, ge=1)
    """Samples per forward/backward pass (gradient accumulation up to the global batch). With
    --use-dynamic-batch-size, only how many samples a forward role takes from the bus at a time."""
    use_dynamic_batch_size: bool = False
    """Pack micro-batches by tokens instead of by count (slime's --use-dynamic-batch-size, veRL's
    use_dynamic_bsz): samples sorted by length, each micro-batch as many as fit --max-tokens-per-gpu padded
    tokens. Less padding and fewer passes, the same gradient (the loss is normalised over the optimizer
    batch, not the micro-batch). Training, ActorFwd, Reference and teacher forwards alike."""
    max_tokens_per_gpu: int | None = Field(None, ge=1)
    """With --use-dynamic-batch-size: padded tokens (rows × longest row) per forward pass on one device
    (one data-parallel replica, before context-parallel splitting); a longer sample runs alone."""
    log_probs_chunk_size: int = Field(1024, ge=0)
    """The torch backend scores response tokens from the last hidden states this many tokens at a time
    (LM head, log-softmax, target and entropy fused; logits recomputed in backward), never holding the
    [tokens, vocabulary] logits: at Qwen's 151,936 tokens those are 4.9 GB per 8k tokens in float32. 0:
    the model's logits for every position (multimodal models always; slime's --log-probs-chunk-size)."""
    lr: float = Field(1e-6, gt=0.0)
    """AdamW learning rate, constant (slime's and veRL's default 1e-6, for a pretrained model)."""
    weight_decay: float = Field(0.01, ge=0.0)
    """AdamW weight decay (slime's (Megatron's) and veRL's default 0.01)."""
    adam_beta1: float = Field(0.9, ge=0.0, lt=1.0)
    """AdamW beta1."""
    adam_beta2: float = Field(0.999, ge=0.0, lt=1.0)
    """AdamW beta2 (slime's (Megatron's) and veRL's default 0.999)."""
    clip_grad: float = Field(1.0, gt=0.0)
    """Gradient-norm clipping threshold."""
    save: str | None = None
    """Directory to write checkpoints to."""
    save_interval: int | None = Field(None, ge=1)
    """Checkpoint every N steps (and always at the end when --save is set)."""
    load: str | None = None
    """Checkpoint directory to resume from."""
    trust_unverified: bool = False
    """Resume (``--load``) from a checkpoint without ``manifest.json`` as it is: nothing says its files are
    whole (written before relax-core 0.6, or copied in part); refused without this."""
    seed: int = 0
    """Seed for data order, sampling and initialisation."""
    # -- GPU training (--train-backend megatron); ignored by the torch backend --------------------
    actor_num_nodes: int = Field(1, ge=1)
    """Nodes the trainer (Actor) spans."""
    actor_num_gpus_per_node: int = Field(0, ge=0)
    """GPUs per node for the trainer; 0 = CPU (the torch backend's default path)."""
    tensor_model_parallel_size: int = Field(1, ge=1)
    """Megatron tensor parallelism (TP): each layer's matrices split over this many GPUs."""
    pipeline_model_parallel_size: int = Field(1, ge=1)
    """Megatron pipeline parallelism (PP): layers split into this many stages."""
    context_parallel_size: int = Field(1, ge=1)
    """Megatron context parallelism (CP): each sequence split over this many GPUs."""
    expert_model_parallel_size: int = Field(1, ge=1)
    """Megatron expert parallelism (EP, MoE models): experts split over this many GPUs."""
    expert_tensor_parallel_size: int | None = Field(None, ge=1)
    """Tensor parallelism inside each expert (default: --tensor-model-parallel-size)."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (with TP > 1): norms and dropout on sequence shards."""
    use_distributed_optimizer: bool = False
    """Megatron backend: shard AdamW's moments over the data-parallel replicas (ZeRO-1): each replica
    steps the parameters it owns and sends them to the others, saving 8 bytes per parameter on all but
    1/DP of them. Checkpoints stay loadable under any layout."""


class AlgoConfig(Section):
    advantage_estimator: str = "grpo"
    """Advantage estimator name in relax-train's registry (grpo, dr_grpo, rloo, reinforce_plus_plus,
    reinforce_plus_plus_baseline), or gae: PPO with a learned critic (the Critic role; its flags:
    :class:`~relax_core.config_critic.CriticConfig`)."""
    normalize_advantages_std: bool = True
    """GRPO: divide group-centred rewards by the group's std (False = Dr.GRPO-style centring only)."""
    policy_loss: Literal["ppo", "gspo", "sapo", "cispo"] = "ppo"
    """Policy loss in relax-train's POLICY_LOSSES registry: ppo (clipped surrogate, clip-higher and
    dual-clip), gspo (sequence-level ratio; its paper's settings unless set: --eps-clip 3e-4,
    --eps-clip-high 4e-4, --loss-agg-mode seq-mean-token-mean), sapo (soft gate with
    --sapo-tau-pos/--sapo-tau-neg; --loss-agg-mode seq-mean-token-mean unless set, as its paper), cispo
    (clipped stop-gradient IS weight × log-prob, --cispo-ratio-max)."""
    loss_agg_mode: Literal[
        "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
    ] = "token-mean"
    """How per-token losses reduce to the scalar: token-mean (every token of the optimizer batch alike),
    seq-mean-token-mean (every response alike), seq-mean-token-sum, seq-mean-token-sum-norm (Dr.GRPO: sum
    divided by --rollout-max-response-len). Denominators are global over the optimizer batch, so
    micro-batching does not change the gradient."""
    eps_clip: float = Field(0.2, gt=0.0)
    """PPO / GSPO clip range below 1 (ratio >= 1 - eps_clip)."""
    eps_clip_high: float | None = Field(None, gt=0.0)
    """PPO / GSPO clip range above 1 (clip-higher, DAPO); defaults to --eps-clip."""
    eps_clip_c: float | None = Field(None, gt=1.0)
    """Dual-clip bound (typically 3): the loss of a negative-advantage token is capped at -A·eps_clip_c;
    None disables it. ppo and gspo only."""
    sapo_tau_pos: float = Field(1.0, gt=0.0)
    """SAPO gate temperature for tokens with advantage > 0 (larger = sharper, closer to a hard clip)."""
    sapo_tau_neg: float = Field(1.05, gt=0.0)
    """SAPO gate temperature for tokens with advantage <= 0."""
    cispo_ratio_max: float = Field(5.0, gt=0.0)
    """CISPO: upper truncation of the stop-gradient importance weight (ScaleRL recommends 5)."""
    kl_coef: float = Field(0.0, ge=0.0)
    """KL-to-reference coefficient β; > 0 starts the Reference role. Applied as a loss term
    (--use-kl-loss) or as reward shaping (--kl-in-reward)."""
    kl_estimator: Literal["k1", "k2", "k3"] | None = None
    """Per-token KL estimator (Schulman 2020; d = log π − log π_ref): k1 = d, k2 = ½ d², k3 = exp(−d) + d − 1
    (clamped to 10). What matters is the gradient each gives. As a loss (--use-kl-loss): k3 (the default,
    GRPO's and TRL's) pulls along ∇KL(π_ref || π), k2 along ∇KL(π || π_ref); k1 is refused (its expected
    gradient is zero). In the reward (--kl-in-reward): only k1 (the default there) has the expectation
    KL(π || π_ref); k2 and k3 are refused. Unset: k3 as a loss, k1 in the reward."""
    use_kl_loss: bool = True
    """With --kl-coef > 0: add β·KL per token to the loss, aggregated like the policy loss (GRPO)."""
    kl_in_reward: bool = False
    """With --kl-coef > 0: subtract β·Σ_t KL_t (rollout log-probs vs reference, no gradient) from each
    response's reward before the advantage estimator (InstructGPT / REINFORCE++ reward shaping). Exclusive
    with --use-kl-loss."""
    entropy_coef: float = Field(0.0, ge=0.0)
    """Entropy bonus coefficient (token-mean entropy, whatever --loss-agg-mode)."""
    distill_mode: Literal["advantage", "loss"] = "advantage"
    """With --teacher-checkpoint: 'advantage' adds β_d·(log π_teacher − log π_old) per token to the
    advantages (a per-token reward: the negative reverse KL, no gradient through the teacher), 'loss' adds
    β_d·½(log π − log π_teacher)² per token to the loss (k2, whose gradient on the student's own samples is
    that of KL(π || π_teacher); --kl-estimator does not apply)."""
    distill_coef: float = Field(1.0, ge=0.0)
    """β_d, the weight of the distillation term."""
    use_actor_fwd: bool = True
    """The old policy of the loss is π_prox, the trainer's policy of the step that trains the sample (in
    fully async too, see --exact-proximal-policy); False uses the rollout engine's log-probs instead. When
    each batch is one optimizer step (--global-batch-size = the batch, the default) π_prox is the training
    forward's own log-probs, bit for bit, so no ActorFwd role runs (TRL and AReaL skip that forward too);
    with several optimizer steps the ActorFwd role computes it."""
    exact_proximal_policy: bool = True
    """Fully async: π_prox (--use-actor-fwd's log-probs: the policy the ratio is clipped against and
    decoupled PPO / TIS correct towards) is the trainer's policy of the step that trains the sample. ActorFwd
    scores each sample when it lands, with the weights it holds then; the trainer recomputes those it
    scored with older weights: in the batch's first optimizer step from the training forward itself (which
    runs with exactly those weights: free), in later ones by a forward just before the update (as AReaL and
    slime recompute). Off: ActorFwd's values as they are (π_prox then lags the trainer by up to
    --max-staleness versions). Colocate mode is exact either way."""
    decoupled_ppo: bool | None = None
    """Decoupled PPO (Hilton et al. 2022): the ratio is clipped against the proximal policy π_prox (the
    trainer's policy of the step, see --use-actor-fwd) and each token's loss is weighted by π_prox /
    π_behaviour, the behaviour policy being the rollout engine's log-probs. The weight is truncated or
    masked by --tis-mode (none: used as is). Needs --use-actor-fwd. Default (unset): on in fully-async runs
    with --max-staleness >= 1 (as AReaL runs it), where samples of older policies are trained — the demo's
    held-out accuracy on seeds 0/1/2 at staleness 1: 0.718/0.594/0.544 with it, 0.646/0.570/0.488 without,
    colocate 0.728/0.590/0.518; off otherwise (on-policy, the weight only corrects the engine-vs-trainer
    mismatch)."""
    tis_mode: Literal["none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"] = "none"
    """Truncated importance sampling of the rollout-vs-trainer mismatch: weight each token's loss by
    π_prox / π_rollout (token level, or the product over the response at sequence level), clamped to
    --tis-cap (truncate) or zeroed above it (mask). Needs --use-actor-fwd."""
    tis_cap: float = Field(2.0, gt=0.0)
    """Upper bound of the truncated importance-sampling weight."""
    routing_replay: bool = False
    """Routing replay (R3) for MoE policies: the rollout engine records each token's top-k experts per
    MoE layer (routed_experts on the bus) and every trainer forward routes tokens to exactly those, so
    training scores the network that generated the sample; routing weights still come from the trainer's
    router. Needs --rollout-backend torch and a Qwen3-MoE-style model."""

    @model_validator(mode="after")
    def _check_algo(self) -> AlgoConfig:
        if self.policy_loss == "gspo":  # GSPO's paper settings (Zheng et al. 2025) where the user set none:
            # a sequence ratio is a geometric mean of token ratios, so PPO's ±0.2 would clip almost nothing
            given = self.model_fields_set
            if "eps_clip" not in given:
                self.__dict__["eps_clip"] = 3e-4
                if "eps_clip_high" not in given:
                    self.__dict__["eps_clip_high"] = 4e-4
            if "loss_agg_mode" not in given:
                self.__dict__["loss_agg_mode"] = "seq-mean-token-mean"
        if self.policy_loss == "sapo" and "loss_agg_mode" not in self.model_fields_set:
            self.__dict__["loss_agg_mode"] = "seq-mean-token-mean"  # SAPO's objective (Gao et al. 2025)
        if self.kl_coef > 0 and self.kl_in_reward and self.use_kl_loss:
            raise ValueError(
                "--kl-in-reward and --use-kl-loss are exclusive (the KL would count twice); add --no-use-kl-loss"
            )
        if self.kl_coef > 0 and self.kl_in_reward and self.kl_estimator in ("k2", "k3"):
            raise ValueError(
                f"--kl-in-reward with --kl-estimator {self.kl_estimator}: in a reward only k1's expectation is "
                f"KL(π || π_ref); {self.kl_estimator}'s policy gradient is another objective (k3's: ∇KL(π||ref) "
                "− ∇KL(ref||π), about 7% of the true gradient near the reference). Drop --kl-estimator (k1 is "
                "the default in the reward)"
            )
        if self.kl_coef > 0 and self.use_kl_loss and not self.kl_in_reward and self.kl_estimator == "k1":
            raise ValueError(
                "--use-kl-loss with --kl-estimator k1: as a loss, k1's expected gradient is zero (∇ log π "
                "averages to 0 under π), so the KL term does nothing; use k2 (gradient of KL(π || π_ref)) or "
                "k3, the default (GRPO's, gradient of KL(π_ref || π))"
            )
        if (self.tis_mode != "none" or self.decoupled_ppo) and not self.use_actor_fwd:
            flag = "--decoupled-ppo" if self.decoupled_ppo else f"--tis-mode {self.tis_mode}"
            raise ValueError(
                f"{flag} needs --use-actor-fwd: the importance weight is π_prox / π_rollout, and π_prox comes "
                "from the ActorFwd role"
            )
        return self

    @property
    def kl_loss_estimator(self) -> str:
        """The estimator of the KL loss term (--use-kl-loss): --kl-estimator, else k3."""
        return self.kl_estimator or "k3"

    @property
    def kl_reward_estimator(self) -> str:
        """The estimator of the KL in the reward (--kl-in-reward): --kl-estimator, else k1."""
        return self.kl_estimator or "k1"

    @property
    def uses_reference(self) -> bool:
        """Whether the Reference role runs (a KL term in the loss or in the reward)."""
        return self.kl_coef > 0 and (self.use_kl_loss or self.kl_in_reward)


class RunConfig(Section):
    mode: Literal["colocate", "fully_async"] = "colocate"
    """colocate: rollout fills a batch, then training (time-shared devices). fully_async: every role
    is an independent Ray service exchanging data over the bus. Flags: --colocate / --fully-async."""
    max_staleness: int = Field(0, ge=0)
    """Staleness of a sample = (trainer version when it is trained on) - (policy version that generated
    it). Every trained sample satisfies staleness <= max-staleness: 0 is strict on-policy, 1
    near-on-policy, k >= 2 fully asynchronous. Only fully_async mode can exceed 0."""
    staleness_policy: Literal["wait", "drop"] = "wait"
    """wait: rollout blocks until the trainer catches up; drop: stale samples are discarded and counted."""
    bus_capacity: int = Field(8192, ge=1)
    """Maximum live samples on the bus; a full bus applies back-pressure to rollout. Raised to a step's
    samples, and under --streaming-rollout to every group in flight (a smaller bus would deadlock)."""
    output_dir: str = "runs/relax"
    """Where TensorBoard logs, metrics.jsonl, the plot and the summary are written. A run locks it (and
    --save): a second run on the same directory is refused, naming the first."""
    overwrite: bool = False
    """Start a fresh run in a --save that holds checkpoints (without --load): they are deleted first. Without
    it such a run is refused (it used to keep them and resume them on a restart)."""
    allow_data_change: bool = False
    """Go on when the prompt file is not the one fingerprinted at the start of the run or in the checkpoint
    --load resumes (logged); without it the run is refused, naming what changed."""
    eval_interval: int | None = Field(10, ge=1)
    """Evaluate held-out greedy accuracy every N steps (and before the first and after the last)."""
    num_cpus: int | None = Field(None, ge=1)
    """CPUs given to the local Ray cluster (default: all)."""
    ray_address: str | None = None
    """The running Ray cluster to join, ``HOST:PORT`` of its head (several nodes: `ray start --head` on one,
    `ray start --address` on the others); default: the ``RAY_ADDRESS`` environment variable, else a local
    cluster started for the run. Start the run on a node of that cluster (the head, as the Slurm and
    KubeRay launchers in deploy/ do)."""
    role_nodes: dict[str, str] = Field(default_factory=dict)
    """Fully async on several nodes: the node each role runs on, role → node address (the one `ray start
    --node-ip-address` gave it), e.g. 'rollout=10.0.0.2,actor=10.0.0.3'. Roles not named, and the bus,
    stay on the driver's node. A role that fails on another node is restarted on the driver's node (its
    own may be gone or cut off)."""
    torch_threads: int | None = Field(None, ge=1)
    """torch intra-op threads per role process (default: 2 in colocate, 1 per role when fully async)."""
    verify_weight_sync: bool = False
    """Record a checksum of every engine's weights after each sync (tests, debugging); costs a hash per
    step."""
    weight_sync_transport: Literal["broadcast", "ipc"] = "broadcast"
    """Fully async, how the trainer's weights reach the rollout and the forward roles: ``broadcast``, a
    bucketed collective to every receiver (any machine); ``ipc``, every receiver on the trainer's machine
    maps the trainer's bucket buffers (CUDA IPC on the same GPU with ``weight_sync_backend=nccl``, shared
    memory on CPU) and copies from them — no collective."""
    weight_sync_timeout_s: float = Field(300.0, gt=0.0)
    """Fully async, how long one weight sync may wait for a receiver (a bucket's collective, the
    receivers' acknowledgements, the rendezvous) before it fails with an error saying so (``SyncTimeout``:
    the trainer trains on, the health manager restarts the receiver and re-forms the group). A receiver
    cut off the network mid-sync holds the trainer this long. Lower it on a flaky network, raise it when a
    sync of a large model takes longer."""
    weight_sync_delta: bool = False
    """Fully async with ``broadcast``: send each weight version as its difference from the last (per bucket:
    gap-coded changes or XOR, zstd-compressed, whichever is smaller), full on a receiver's first sync, when
    one asks (it joined, or a delta did not check) and every ``weight_sync_full_every`` versions. Bitwise the
    same weights. Pays in bf16 at small learning rates (a few percent of the bytes at lr <= 1e-5) where bytes
    are time (a link slower than the encode: across nodes); off by default because on one node the encode
    costs more than the bytes save, and float32 weights change in every element (the run then says so and
    sends full). BENCHMARKS.md, "Delta weight sync"."""
    weight_sync_full_every: int = Field(50, ge=1)
    """With ``weight_sync_delta``: a full sync every this many versions."""
    weight_sync_backend: Literal["gloo", "nccl"] = "gloo"
    """Where the buckets live: ``gloo``, host memory (works everywhere; GPU weights are copied to the host);
    ``nccl``, GPU memory (an NCCL broadcast, or CUDA IPC with ``ipc``): every role of the group needs a
    GPU."""
    overlap_weight_sync: bool = True
    """Fully async: broadcast the new weights from a background thread while the trainer goes on to its
    next step (waiting for data, forward and backward); the trainer waits for the broadcast only before
    its optimizer writes the weights again. Off: the trainer blocks until every receiver has them."""
    offload: bool | None = None
    """Colocate: hand the devices back and forth between rollout and training. While the trainer and the
    forward roles run, the rollout engines release their weights and KV cache; while the engines generate,
    the trainer's weights, gradients and optimizer state wait in host memory. Default: on when CUDA is
    available (as slime's --colocate implies --offload); --offload / --no-offload force it."""
    tensorboard: bool = True
    """Write TensorBoard event files under output_dir/tensorboard."""
    progress: bool = True
    """Show a progress bar."""
    log_samples: int = Field(32, ge=0)
    """Samples of each trained step written to output_dir/samples/step_<k>.jsonl (whole groups first; token ids,
    versions, log-probs, rewards, advantages) for `relax ui`'s rollout browser; 0 writes none. About 40 bytes
    a response token: 32 samples of 8k tokens are ~10 MB a step."""
    trace: bool = True
    """Write output_dir/trace.json: a timeline of every role's phases (generate, reward, forward,
    advantages, train, weight sync, eval) in the Chrome trace format; open it in https://ui.perfetto.dev or
    chrome://tracing to see which phases overlap. A few spans per step: negligible overhead."""
    notify_urls: list[str] = []
    """Apprise URLs (Slack, Discord, Telegram, ntfy, e-mail, a JSON webhook ``json://host:port/path``, ...)
    told when the run starts, finishes (steps, samples, wall time, final reward and eval) or fails (the
    error); e.g. '["slack://T/B/C", "json://127.0.0.1:8000/hook"]'. Needs relax-core[notify]; a
    notification that cannot be delivered only logs a warning."""

    wandb_project: str | None = None
    """Also log metrics to Weights & Biases under this project (needs relax-core[wandb])."""
    wandb_mode: Literal["online", "offline"] = "offline"
    """W&B mode: offline writes output_dir/wandb for a later ``wandb sync``; online needs an account."""
    clearml_project: str | None = None
    """Also log metrics to ClearML under this project (needs relax-core[clearml])."""
    clearml_offline: bool = True
    """ClearML offline mode: the session is written locally (import it later with
    ``clearml-task --import-offline-session``); False needs a ClearML server."""
    health: bool = True
    """Fully async: heartbeats from every role; a failed role is restarted in place, repeated failures
    escalate to a global restart from the last checkpoint (restarting the trainer needs --save)."""
    heartbeat_interval_s: float = Field(2.0, gt=0.0)
    """How often the health manager asks every role for a heartbeat."""
    heartbeat_timeout_s: float = Field(120.0, gt=0.0)
    """A role whose loop made no progress for this long (or does not answer) counts as failed."""
    stall_timeout_s: float = Field(3600.0, ge=0.0)
    """Fully async: a run whose trainer makes no step for this long while every role answers its heartbeat
    stops, saying where it stands (the roles wait on each other: a deadlock no heartbeat shows); 0: never."""
    max_restarts_per_role: int = Field(3, ge=0)
    """In-place restarts allowed per role before the health manager escalates to a global restart."""
    max_global_restarts: int = Field(1, ge=0)
    """Global restarts (every role, from the last checkpoint) before the run stops with the reason."""

    @field_validator("role_nodes", mode="before")
    @classmethod
    def _role_nodes_pairs(cls, v: Any) -> Any:
        """'rollout=10.0.0.2,actor=10.0.0.3' as well as a mapping."""
        if not isinstance(v, str):
            return v
        pairs = [p.strip() for p in v.split(",") if p.strip()]
        bad = [p for p in pairs if p.count("=") != 1 or not all(x.strip() for x in p.split("="))]
        if bad:
            raise ValueError(f"--role-nodes takes ROLE=ADDRESS pairs separated by commas (got {bad[0]!r})")
        return {k.strip(): a.strip() for k, a in (p.split("=") for p in pairs)}

    @field_validator("notify_urls", mode="before")
    @classmethod
    def _one_url(cls, v: Any) -> Any:
        return [] if v is None else [v] if isinstance(v, str) else v
