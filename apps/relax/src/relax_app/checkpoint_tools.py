"""`relax eval CKPT` (a checkpoint's held-out accuracy) and `relax export CKPT OUT` (a checkpoint as an HF model
directory that serves: weights, config, tokenizer, generation config).

CKPT is a checkpoint (``step_000100``), a ``--save`` directory (its newest whole checkpoint) or a
checkpoint's ``model/``. What the checkpoint does not hold comes from the run that wrote it: its tokenizer
(checkpoints written before relax-core 0.6 have none in ``model/``) from the model the run trained from,
and the task (eval data, reward, response length) from the run's config. Both are found through what
every checkpoint records of its run (``run_state.json``: ``model_path``, ``output_dir``), else through the
run directory around it (``<output_dir>/checkpoints/step_*``: run.json, config.json, summary.json), else
they must be given (``--tokenizer``, ``--data``).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

from relax_core.checkpoints import enclosing_checkpoint, latest_checkpoint, problem
from relax_core.hf_files import copy_serving_files, share_as_new_files, tokenizer_missing
from relax_core.resume import CheckpointDir


class CheckpointError(ValueError):
    """What is wrong with the checkpoint or the command line, and what to do (one line)."""


def resolve(path: str | Path, trust_unverified: bool = False) -> tuple[Path, dict[str, Any], Path | None]:
    """(its HF model directory, its run state, the checkpoint directory) of CKPT, verified against its
    checkpoint's manifest (a model/ directory too: before, `relax eval|export step_N/model` never read it)."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{p}: no such checkpoint")
    if (p / "config.json").is_file() and not (p / "meta.json").is_file():  # a model/ directory
        ckpt = enclosing_checkpoint(p)
        if ckpt is not None and (wrong := problem(ckpt, trust_unverified)):
            raise CheckpointError(f"{p}: its checkpoint {ckpt} is not whole: {wrong}")
        return p, CheckpointDir(ckpt).run_state() if ckpt else {}, ckpt
    try:
        ckpt = Path(latest_checkpoint(p, trust_unverified=trust_unverified))
    except FileNotFoundError as e:
        raise CheckpointError(str(e).replace("--load ", "", 1)) from None
    model, state = ckpt / "model", CheckpointDir(ckpt).run_state()
    if not model.is_dir() and (ckpt / "adapter").is_dir():  # a LoRA run's: its merged export, or merged now
        model = ckpt / "model_merged"
        if not (model / "config.json").is_file():
            model = merge_adapter(ckpt, state)
    if not (model / "config.json").is_file():
        raise CheckpointError(f"{ckpt}: no HF model in it (model/config.json missing)")
    return model, state, ckpt


_MERGED_FROM: dict[str, str] = {}
"""A merged LoRA model's temporary directory -> the base model it was merged into (whose tokenizer and
serving files it holds): what to name as their source, the temporary directory being gone at exit."""


def merge_adapter(ckpt: Path, state: dict[str, Any]) -> Path:
    """A LoRA checkpoint saved without --lora-save-merged (``adapter/`` alone): its adapter merged into the
    model the run trained from (recorded in the checkpoint, else named in the adapter's config), written to a
    temporary HF directory with that model's serving files; the checkpoint is left as it is."""
    import atexit
    import tempfile

    adapter = ckpt / "adapter"
    base = state.get("model_path") or _json(adapter / "adapter_config.json").get("base_model_name_or_path")
    if not base or not (Path(base) / "config.json").is_file():
        raise CheckpointError(
            f"{ckpt}: a LoRA checkpoint whose base model ({base or 'not recorded'}) is not here; merge it with "
            "PeftModel.from_pretrained(base, adapter/) yourself, or save checkpoints with --lora-save-merged"
        )
    from peft import PeftModel

    from relax_core.models import load_model

    merged = PeftModel.from_pretrained(load_model(base), str(adapter)).merge_and_unload()
    out = Path(tempfile.mkdtemp(prefix="relax-lora-merged-"))
    atexit.register(shutil.rmtree, out, True)  # (read by this command alone)
    merged.save_pretrained(out)
    copy_serving_files(base, out, getattr(merged, "generation_config", None))
    _MERGED_FROM[str(out)] = str(base)
    return out


def run_dir(state: dict[str, Any], ckpt: Path | None) -> Path | None:
    """The output directory of the run that wrote the checkpoint, where it can be found."""
    recorded = state.get("output_dir")
    if recorded and (Path(recorded) / "config.json").is_file():
        return Path(recorded)
    for d in ckpt.parents if ckpt else []:  # (a stop by signal saves under <output_dir>/checkpoints)
        if (d / "config.json").is_file() and (d / "run.json").is_file():
            return d
    return None


def _json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except ValueError:
        return {}


def tokenizer_source(model: Path, state: dict[str, Any], run: Path | None, given: str | None) -> str:
    """Where the tokenizer comes from: ``given``, the checkpoint itself, else the model its run trained from
    (recorded in the checkpoint, in run.json, in the run's config or, for the demo, its summary)."""
    if given:
        return given
    if not tokenizer_missing(model):
        return str(model)
    candidates = [state.get("model_path")]
    if run is not None:
        candidates += [
            _json(run / "run.json").get("model_path"),
            _json(run / "config.json").get("model", {}).get("hf_checkpoint"),
            _json(run / "summary.json").get("model"),  # (the demo's warm-started model)
        ]
    for c in candidates:
        if c and Path(c).is_dir() and not tokenizer_missing(c):
            return str(c)
        if c and not Path(c).exists() and c.count("/") == 1:  # a hub id
            return str(c)
    raise CheckpointError(
        f"{model}: no tokenizer in the checkpoint and none found for the run that wrote it "
        f"({' and '.join(tokenizer_missing(model))} missing); give --tokenizer DIR, the model it was trained from"
    )


def export(
    ckpt: str | Path,
    out: str | Path,
    tokenizer: str | None = None,
    overwrite: bool = False,
    trust_unverified: bool = False,
) -> str:
    """Write CKPT's model to ``out`` as an HF model directory that serves; returns where the tokenizer came
    from. ``out`` is never inside CKPT, nor CKPT inside ``out`` (before, `relax export S S --overwrite`
    deleted every checkpoint in S)."""
    src, dst = Path(ckpt).resolve(), Path(out).resolve()
    if dst == src or src in dst.parents or dst in src.parents:
        raise CheckpointError(
            f"OUT {out} and CKPT {ckpt} overlap: export to a directory outside the checkpoint"
        )
    model, state, where = resolve(ckpt, trust_unverified)
    source = tokenizer_source(model, state, run_dir(state, where), tokenizer)
    dst = Path(out)
    if dst.exists() and any(dst.iterdir()):
        if not overwrite:
            raise CheckpointError(f"{dst} exists and is not empty: give another OUT, or --overwrite")
        shutil.rmtree(dst)
    tmp = dst.with_name(f".{dst.name}.exporting")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(model, tmp)
    if source != str(model):
        copy_serving_files(source, tmp)
    missing = tokenizer_missing(tmp)
    if missing:
        shutil.rmtree(tmp)
        raise CheckpointError(
            f"{source}: no tokenizer there ({' and '.join(missing)} missing); give --tokenizer DIR"
        )
    share_as_new_files(tmp)  # (a checkpoint written before this was fixed: its weights 0600)
    if dst.exists():
        dst.rmdir()
    tmp.rename(dst)  # (whole or not at all)
    return _MERGED_FROM.get(source, source)  # (not the merge's temporary directory: gone at exit)


def _run_config(run: Path | None, overrides: list[str]):
    """The run's config (its task: eval data, reward, lengths, keys) with ``overrides`` (train flags) on top."""
    from relax_app.cli_config import build_config, flag_index

    saved = _json(run / "config.json") if run is not None else {}
    index = flag_index()
    flat = {k: v for sec in saved.values() if isinstance(sec, dict) for k, v in sec.items() if k in index}
    return build_config(None, overrides, defaults=flat)


def evaluate(
    ckpt: str | Path,
    data: str | None = None,
    overrides: list[str] | None = None,
    tokenizer: str | None = None,
    trust_unverified: bool = False,
) -> dict[str, Any]:
    """CKPT's held-out greedy accuracy on ``data`` (default: its run's eval data; the demo's held-out set)."""
    model, state, where = resolve(ckpt, trust_unverified)
    run = run_dir(state, where)
    cfg = _run_config(run, overrides or [])
    recorded = _json(run / "summary.json").get("eval_data") if run is not None else None
    data = data or cfg.data.eval_data or recorded
    if not data and cfg.is_demo:
        import os

        from relax_app.demo.assets import prepare_demo

        data = str(
            prepare_demo(os.environ.get("RELAX_CACHE_DIR", ".relax_cache"), seed=cfg.train.seed).eval_path
        )
    if not data:
        raise CheckpointError(f"{ckpt}: no held-out data known for its run; give --data FILE.jsonl")
    if not Path(data).is_file():
        raise CheckpointError(f"--data {data}: no such file")
    from relax_core.data import load_prompts

    try:  # (a file of other columns ended in a traceback naming --prompt-data)
        load_prompts(data, cfg.data.input_key, cfg.data.label_key, cfg.data.metadata_key)
    except ValueError as e:
        raise CheckpointError(
            f"{str(e).replace('--prompt-data', '--data', 1)}; name its columns with --input-key and --label-key"
        ) from None
    source = tokenizer_source(model, state, run, tokenizer)
    import torch
    from transformers import AutoModelForCausalLM

    from relax_rollout.evaluate import GreedyEvaluator

    evaluator = GreedyEvaluator(cfg, source, str(data))
    net = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        accuracy = evaluator(net)
    step = _json(where / "meta.json").get("version") if where else None
    return {
        "checkpoint": str(where or model),
        "step": step,
        "data": str(data),
        "samples": len(evaluator.rows),
        "reward": cfg.rollout.eval_rm_type or cfg.rollout.rm_type,
        "accuracy": accuracy,
    }


EVAL_USAGE = """usage: relax eval CKPT [--data FILE.jsonl] [--tokenizer DIR] [--trust-unverified] [--flag value ...]

  CKPT         a checkpoint (step_*), a --save directory (its newest) or a checkpoint's model/
  --data       held-out prompts and labels (default: the run's --eval-data; the demo's held-out set)
  --tokenizer  where the tokenizer is, when neither the checkpoint nor its run says
  --trust-unverified  use a checkpoint without manifest.json as it is (nothing says its files are whole)
  --flag value any `relax train` flag over the run's config: --eval-rm-type math, --eval-max-samples 200,
               --rollout-max-response-len 64, --input-key question, ...
"""

EXPORT_USAGE = """usage: relax export CKPT OUT [--tokenizer DIR] [--overwrite] [--trust-unverified]

  CKPT         a checkpoint (step_*), a --save directory (its newest) or a checkpoint's model/
  OUT          the HF model directory to write (weights, config, tokenizer, generation config), e.g. for
               `python -m relax_rollout.server --model OUT`, SGLang, vLLM or transformers
  --tokenizer  where the tokenizer is, when neither the checkpoint nor its run says
  --overwrite  replace OUT when it holds files (never a directory that overlaps CKPT)
  --trust-unverified  use a checkpoint without manifest.json as it is (nothing says its files are whole)
"""


def _flag(argv: list[str], flag: str) -> bool:
    """Whether ``flag`` is in ``argv`` (taken out of it)."""
    found = flag in argv
    while flag in argv:
        argv.remove(flag)
    return found


def _take(argv: list[str], flag: str) -> str | None:
    if flag in argv:
        i = argv.index(flag)
        if i + 1 >= len(argv):
            raise CheckpointError(f"{flag} needs a value")
        value = argv[i + 1]
        del argv[i : i + 2]
        return value
    return None


def eval_main(argv: list[str]) -> int:
    argv = list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(EVAL_USAGE)
        return 0 if argv else 2
    from relax_app.cli_config import ConfigError

    try:
        ckpt, rest = argv[0], argv[1:]
        data, tokenizer = _take(rest, "--data"), _take(rest, "--tokenizer")
        result = evaluate(ckpt, data, rest, tokenizer, _flag(rest, "--trust-unverified"))
    except (CheckpointError, ConfigError, FileNotFoundError) as e:
        print(f"relax: {e}", file=sys.stderr)
        return 2
    print(
        f"held-out accuracy {result['accuracy']:.4f} on {result['samples']} prompts of {result['data']} "
        f"(checkpoint {result['checkpoint']}, reward {result['reward']})"
    )
    print(json.dumps(result))
    return 0


def export_main(argv: list[str]) -> int:
    argv = list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(EXPORT_USAGE)
        return 0 if argv else 2
    try:
        overwrite, trust = _flag(argv, "--overwrite"), _flag(argv, "--trust-unverified")
        tokenizer = _take(argv, "--tokenizer")
        if len(argv) != 2:
            raise CheckpointError(f"expected CKPT OUT, got {' '.join(argv) or 'nothing'}\n\n{EXPORT_USAGE}")
        source = export(argv[0], argv[1], tokenizer, overwrite, trust)
    except (CheckpointError, FileNotFoundError) as e:
        print(f"relax: {e}", file=sys.stderr)
        return 2
    print(f"exported {argv[0]} to {argv[1]} (tokenizer from {source})")
    return 0
