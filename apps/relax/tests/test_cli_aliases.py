"""slime's flag names: aliases for the same knob, a refusal where there is none, a note where ours means
something else."""

import pytest

from relax_app.cli_config import ConfigError, build_config, help_text


def test_slime_names_set_our_flags():
    cfg = build_config(
        argv=[
            "--kl-loss-coef",
            "0.01",
            "--ref-load",
            "/ckpt/ref",
            "--eval-prompt-data",
            "aime",
            "/data/aime.jsonl",
            "--lr",
            "1e-6",
        ]
    )
    assert cfg.algo.kl_coef == 0.01 and cfg.algo.use_kl_loss  # slime's KL loss: ours, in the loss
    assert cfg.model.ref_checkpoint == "/ckpt/ref"
    assert cfg.data.eval_data == "/data/aime.jsonl" and cfg.train.lr == 1e-6
    assert build_config(argv=["--eval-prompt-data", "/data/aime.jsonl"]).data.eval_data == "/data/aime.jsonl"
    assert build_config(argv=["--kl-loss-coef=0.02"]).algo.kl_coef == 0.02


def test_slime_names_in_yaml(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text("kl-loss-coef: 0.03\nref_load: /r\neval_prompt_data: [aime, /a.jsonl]\n")
    cfg = build_config(path)
    assert (cfg.algo.kl_coef, cfg.model.ref_checkpoint, cfg.data.eval_data) == (0.03, "/r", "/a.jsonl")


def test_several_eval_sets_are_refused():
    with pytest.raises(
        ConfigError, match="--eval-prompt-data: relax evaluates one held-out set; give --eval-data"
    ):
        build_config(argv=["--eval-prompt-data", "aime", "/a.jsonl", "math", "/m.jsonl"])


def test_kl_loss_coef_with_slimes_kl_coef():
    # slime scripts set both; --kl-coef 0 there means "no KL in the reward"
    assert build_config(argv=["--kl-loss-coef", "0.01", "--kl-coef", "0.00"]).algo.kl_coef == 0.01
    assert build_config(argv=["--kl-coef", "0", "--kl-loss-coef", "0.01"]).algo.kl_coef == 0.01
    assert build_config(argv=["--kl-coef", "0.01", "--kl-loss-coef", "0.01"]).algo.kl_coef == 0.01
    with pytest.raises(
        ConfigError, match="--kl-loss-coef 0.01 and --kl-coef 0.02: in slime these are two KL"
    ):
        build_config(argv=["--kl-loss-coef", "0.01", "--kl-coef", "0.02"])


def test_rollout_top_k_has_no_equivalent():
    with pytest.raises(ConfigError, match="--rollout-top-k 20: no equivalent in relax; .*--rollout-top-p"):
        build_config(argv=["--rollout-top-k", "20"])
    assert build_config(argv=["--rollout-top-k", "-1"]) == build_config(argv=[])  # off: as here


def test_kl_coef_notes_its_other_meaning():
    notes: list[str] = []
    build_config(argv=["--kl-coef", "0.01"], notes=notes)
    assert len(notes) == 1 and "slime" in notes[0] and "--kl-in-reward --no-use-kl-loss" in notes[0]
    for argv in (
        ["--kl-coef", "0.01", "--kl-in-reward", "--no-use-kl-loss"],
        ["--kl-coef", "0.01", "--use-kl-loss"],
        ["--kl-loss-coef", "0.01", "--kl-coef", "0"],
        ["--kl-coef", "0"],
        [],
    ):
        notes = []
        build_config(argv=argv, notes=notes)
        assert notes == [], argv


def test_help_lists_the_aliases_next_to_our_names_and_the_note():
    text = help_text()
    assert "--kl-coef / --kl-loss-coef" in text
    assert "--ref-checkpoint / --ref-load" in text and "--eval-data / --eval-prompt-data" in text
    assert "--rollout-top-k" in text and "NOTE for slime / veRL users" in text


# -- the slime flags slime users type most (issue #35: each got a misleading hint, or none) ----------------


def test_use_wandb_goes_with_a_project_and_is_refused_without_one(tmp_path):
    cfg = build_config(argv=["--use-wandb", "--wandb-project", "grpo"])
    assert cfg.run.wandb_project == "grpo"
    assert build_config(argv=["--wandb-project", "grpo", "--use-wandb", "true"]) == cfg
    with pytest.raises(ConfigError, match=r"--use-wandb: W&B logging is on here when --wandb-project NAME"):
        build_config(argv=["--use-wandb"])
    assert build_config(argv=["--no-use-wandb"]) == build_config(argv=[])  # off: nothing asked for
    path = tmp_path / "cfg.yaml"
    path.write_text("use_wandb: true\nwandb_project: grpo\n")
    assert build_config(path) == cfg
    path.write_text("use_wandb: true\n")
    with pytest.raises(ConfigError, match="add --wandb-project "):
        build_config(path)


def test_use_tis_is_token_level_truncation_at_tis_clip():
    cfg = build_config(argv=["--use-tis", "--tis-clip", "3"])
    assert (cfg.algo.tis_mode, cfg.algo.tis_cap) == ("token_truncate", 3.0)  # slime's vanilla TIS
    assert build_config(argv=["--use-tis", "false"]).algo.tis_mode == "none"
    assert build_config(argv=["--tis-clip-low", "0", "--use-tis"]).algo.tis_mode == "token_truncate"
    with pytest.raises(ConfigError, match="--tis-clip-low 0.5: no equivalent in relax; .*--tis-cap"):
        build_config(argv=["--tis-clip-low", "0.5"])
    with pytest.raises(ConfigError, match="--use-tis 'token_truncate' and --tis-mode 'token_mask'"):
        build_config(argv=["--use-tis", "--tis-mode", "token_mask"])


@pytest.mark.parametrize(
    ("theirs", "ours"), [("low_var_kl", "k3"), ("k3", "k3"), ("k2", "k2"), ("mse", "k2")]
)
def test_kl_loss_type_is_the_kl_estimator(theirs, ours):
    cfg = build_config(argv=["--kl-loss-coef", "0.01", "--kl-loss-type", theirs])
    assert (cfg.algo.kl_coef, cfg.algo.kl_estimator) == (0.01, ours)


def test_kl_loss_type_k1_as_a_loss_is_refused_with_the_reason():
    with pytest.raises(ConfigError, match="k1's expected gradient is zero"):
        build_config(argv=["--kl-loss-coef", "0.01", "--kl-loss-type", "k1"])


def test_rollout_stop_takes_several_strings_like_slimes():
    cfg = build_config(argv=["--rollout-stop", "</answer>", "###", "--lr", "1e-6"])
    assert cfg.rollout.rollout_stop == ["</answer>", "###"] and cfg.train.lr == 1e-6
    assert build_config(argv=["--rollout-stop", "42"]).rollout.rollout_stop == ["42"]  # (text, not a number)
    assert build_config(argv=['--rollout-stop=["a", "--b"]']).rollout.rollout_stop == ["a", "--b"]
    assert build_config(argv=["--rollout-stop-token-ids", "7", "8"]).rollout.rollout_stop_token_ids == [7, 8]
    with pytest.raises(ConfigError, match="--rollout-stop-token-ids: token ids are integers"):
        build_config(argv=["--rollout-stop-token-ids", "eos"])
    with pytest.raises(ConfigError, match="--rollout-stop: an empty stop string"):
        build_config(argv=["--rollout-stop", ""])


def test_learning_rate_and_model_path_are_lr_and_hf_checkpoint(tmp_path):
    cfg = build_config(
        argv=["--learning-rate", "3e-6", "--model-path", "/models/qwen3", "--prompt-data", "p"]
    )
    assert (cfg.train.lr, cfg.model.hf_checkpoint) == (3e-6, "/models/qwen3")
    with pytest.raises(ConfigError, match="--hf-checkpoint '/a' and --model-path '/b' set the same thing"):
        build_config(argv=["--hf-checkpoint", "/a", "--model-path", "/b"])
    path = tmp_path / "cfg.yaml"
    path.write_text("learning_rate: 2.0e-6\n")
    assert build_config(path).train.lr == 2e-6


@pytest.mark.parametrize(
    ("typed", "hint"),
    [
        ("--use-wandbb", "--use-wandb"),  # was --use-actor-fwd
        ("--use-tiss", "--use-tis"),  # was --use-kl-loss
        ("--kl-loss-typ", "--kl-loss-type"),  # was --kl-loss-coef
        ("--rollout-stp", "--rollout-stop"),  # was --rollout-top-p
        ("--model-pth", "--model-path"),  # was --sglang-model-path
        ("--learning-rat", "--learning-rate"),  # was no hint
        ("--wandb-projct", "--wandb-project"),
    ],
)
def test_a_mistyped_slime_flag_is_hinted_the_slime_name(typed, hint):
    with pytest.raises(ConfigError, match=f"unknown flag {typed} \\(did you mean {hint}\\?\\)"):
        build_config(argv=[typed, "1"])


def test_slime_flags_with_nothing_to_do_here_say_what_instead():
    assert build_config(argv=["--optimizer", "adam", "--lr-decay-style", "constant"]) == build_config(argv=[])
    with pytest.raises(ConfigError, match="--num-epoch 3: no equivalent in relax; give the number of steps"):
        build_config(argv=["--num-epoch", "3"])
    with pytest.raises(
        ConfigError, match="--wandb-key 'k': no equivalent in relax; log in once with `wandb login`"
    ):
        build_config(argv=["--wandb-key", "k"])


def test_help_lists_the_slime_switches():
    text = help_text(width=100)
    assert "--tis-mode / --use-tis" in text and "--use-wandb accepted with --wandb-project" in text
    assert "--kl-loss-type = --kl-estimator; low_var_kl = k3" in text


# slime's scripts/run-qwen3-4B.sh (THUDM/slime at 05a0752) with its MODEL_ARGS (scripts/models/qwen3-4B.sh),
# as `python3 train.py` receives them, and the flags of its other examples the issue (#50) names.
SLIME_SCRIPT = """
--actor-num-nodes 1 --actor-num-gpus-per-node 8 --colocate
--swiglu --num-layers 36 --hidden-size 2560 --ffn-hidden-size 9728 --num-attention-heads 32
--group-query-attention --num-query-groups 8 --use-rotary-position-embeddings --disable-bias-linear
--normalization RMSNorm --norm-epsilon 1e-6 --rotary-base 1000000 --vocab-size 151936 --kv-channels 128
--qk-layernorm
--hf-checkpoint /root/Qwen3-4B --ref-load /root/Qwen3-4B_torch_dist --load /root/Qwen3-4B_slime/
--save /root/Qwen3-4B_slime/ --save-interval 20
--prompt-data /root/dapo-math-17k/dapo-math-17k.jsonl --input-key prompt --label-key label
--apply-chat-template --rollout-shuffle --rm-type deepscaler --num-rollout 3000 --rollout-batch-size 32
--n-samples-per-prompt 8 --rollout-max-response-len 8192 --rollout-temperature 0.8 --global-batch-size 256
--balance-data
--eval-interval 20 --eval-prompt-data aime /root/aime-2024/aime-2024.jsonl --n-samples-per-eval-prompt 16
--eval-max-response-len 16384 --eval-top-p 0.7
--tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 1
--context-parallel-size 1 --expert-model-parallel-size 1 --expert-tensor-parallel-size 1
--recompute-granularity full --recompute-method uniform --recompute-num-layers 1
--use-dynamic-batch-size --max-tokens-per-gpu 9216
--advantage-estimator grpo --use-kl-loss --kl-loss-coef 0.00 --kl-loss-type low_var_kl --entropy-coef 0.00
--eps-clip 0.2 --eps-clip-high 0.28
--optimizer adam --lr 1e-6 --lr-decay-style constant --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.98
--rollout-num-gpus-per-engine 2 --sglang-mem-fraction-static 0.7
--attention-dropout 0.0 --hidden-dropout 0.0 --accumulate-allreduce-grads-in-fp32
--attention-softmax-in-fp32 --attention-backend flash
--seq-length 4096 --offload-rollout --keep-old-actor --bf16 --over-sampling-batch-size 64
--dynamic-sampling-filter-path slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std
--no-load-optim
""".split()


def test_a_slime_script_gets_one_answer_listing_every_flag_it_cannot_take():
    assert sum(a.startswith("--") for a in SLIME_SCRIPT) == 79
    with pytest.raises(ConfigError) as e:
        build_config(argv=SLIME_SCRIPT)
    lines = str(e.value).splitlines()
    assert lines[0] == "3 problems with the command line:"
    assert lines[1].startswith(
        "  --n-samples-per-eval-prompt 16: no equivalent in relax; held-out evaluation"
    )
    assert lines[2].startswith("  --eval-max-response-len 16384: no equivalent in relax; held-out answers")
    assert lines[3].startswith("  --no-load-optim: no equivalent in relax; --load restores the optimizer")
    # what they say to do, done: the rest runs, its accepted-and-unused flags named at start
    fixed = [a for a in SLIME_SCRIPT if a not in ("--no-load-optim", "--eval-max-response-len", "16384")]
    fixed[fixed.index("--n-samples-per-eval-prompt") + 1] = "1"
    notes: list[str] = []
    cfg = build_config(argv=[*fixed, "--global-batch-size", "128", "--rollout-batch-size", "16"], notes=notes)
    assert cfg.model.dtype == "bfloat16" and cfg.run.offload is True and cfg.rollout.dynamic_sampling
    assert cfg.algo.kl_estimator == "k3" and cfg.train.max_tokens_per_gpu == 9216
    assert len(notes) == 4
    arch, throughput, greedy, megatron = notes  # (in the order the script first gives each kind)
    assert (
        arch.startswith("--swiglu, --num-layers, --hidden-size")
        and "from --hf-checkpoint's config.json" in arch
    )
    assert "--recompute-granularity" in megatron and "--seq-length" in megatron
    assert throughput.startswith("--balance-data") and "--over-sampling-batch-size" in throughput
    assert greedy.startswith("--eval-top-p") and "greedy" in greedy


def test_slime_values_that_become_ours():
    assert (
        build_config(argv=["--custom-rm-path", "my_rm.reward.score"]).rollout.rm_type == "my_rm.reward:score"
    )
    assert build_config(argv=["--custom-rm-path", "my_rm:score"]).rollout.rm_type == "my_rm:score"
    with pytest.raises(ConfigError, match="another filter has no equivalent here"):
        build_config(argv=["--dynamic-sampling-filter-path", "my.filters.keep_long"])
    assert build_config(argv=["--fp16"]).model.dtype == "float16"
    assert build_config(argv=["--attention-dropout", "0"]) == build_config(argv=[])
    with pytest.raises(ConfigError, match="--attention-dropout 0.1: no equivalent in relax"):
        build_config(argv=["--attention-dropout", "0.1"])
