"""The files beside an HF model's weights that make its directory servable: tokenizer, chat template,
processor, generation config.

Why: ``save_pretrained`` of a model writes its weights and ``config.json`` only; a checkpoint saved so could
not be served (``python -m relax_rollout.server --model <ckpt>/model`` started with an empty tokenizer:
``/tokenize`` answered ``[]``, chat a 500). Every HF-format model a run writes takes these files from the
checkpoint it was trained from (:func:`copy_serving_files`), and a server refuses a directory without a
tokenizer at start-up, naming what is missing (:func:`tokenizer_missing`).

transformers is imported inside the functions that need it (a hub id's tokenizer, a missing generation
config), so importing relax_core stays light.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import GenerationConfig

logger = logging.getLogger(__name__)

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack")
"""Weight files (and the ``*.index.json`` of sharded ones): never copied, the caller writes its own."""

TOKENIZER_VOCAB = (("tokenizer.json",), ("tokenizer.model",), ("vocab.json", "merges.txt"), ("vocab.txt",))
"""A tokenizer's vocabulary comes in one of these file sets (fast tokenizer, sentencepiece, BPE, WordPiece)."""

TOKENIZER_CONFIG = "tokenizer_config.json"
"""Names the tokenizer class and its special tokens (EOS, pad): without it the vocabulary loads with none."""


def tokenizer_missing(directory: str | Path) -> list[str]:
    """The tokenizer files ``directory`` lacks; [] when it holds a tokenizer (a vocabulary in one of the
    forms of :data:`TOKENIZER_VOCAB`, and :data:`TOKENIZER_CONFIG`), e.g. for an empty directory
    ``['tokenizer.json (or tokenizer.model, or vocab.json + merges.txt, or vocab.txt)', 'tokenizer_config.json']``."""
    root = Path(directory)
    missing = []
    if not any(all((root / f).is_file() for f in group) for group in TOKENIZER_VOCAB):
        others = ", or ".join(" + ".join(group) for group in TOKENIZER_VOCAB[1:])
        missing.append(f"{TOKENIZER_VOCAB[0][0]} (or {others})")
    if not (root / TOKENIZER_CONFIG).is_file():
        missing.append(TOKENIZER_CONFIG)
    return missing


def check_servable(directory: str | Path, flag: str = "--model") -> None:
    """``ValueError`` (one line: the directory, the files missing, what to do) when the local model directory
    ``directory`` has no tokenizer: loaded anyway, transformers builds an empty one (``/tokenize`` answered
    ``[]``, chat a 500). A path that is not a directory here (a hub id) is left to transformers."""
    if not Path(directory).is_dir():
        return
    missing = tokenizer_missing(directory)
    if missing:
        raise ValueError(
            f"{flag} {directory}: no tokenizer there ({' and '.join(missing)} missing); copy the tokenizer files "
            "of the model it was trained from into it (the model/ of a checkpoint relax's --save writes now "
            "carries them)"
        )


def _is_weights(name: str) -> bool:
    return name.endswith(WEIGHT_SUFFIXES) or name.endswith(".index.json")


def copy_serving_files(
    source: str | Path, model_dir: str | Path, generation_config: GenerationConfig | None = None
) -> list[str]:
    """Complete the HF model directory ``model_dir`` (weights and config.json written by the caller) with
    the files of the checkpoint ``source`` it was trained from that serving needs: tokenizer, chat template,
    processor configs, generation config and any other non-weight file, each unless ``model_dir`` has it
    already. ``source`` may be a hub id (not a directory here): its tokenizer is saved instead.
    ``generation_config`` (the model's ``GenerationConfig``) is saved when no generation_config.json came;
    without one, a generation config is derived from ``model_dir``'s config.json (its EOS, BOS and pad ids).
    Returns the names written; logs a warning when the result still has no tokenizer."""
    out = Path(model_dir)
    written: list[str] = []
    src = Path(source)
    if src.is_dir():
        for f in sorted(src.iterdir()):
            if f.is_file() and not f.name.startswith(".") and not _is_weights(f.name):
                if not (out / f.name).exists():
                    shutil.copy2(f, out / f.name)
                    written.append(f.name)
    elif tokenizer_missing(out):  # a hub id: the tokenizer as transformers resolves it
        from transformers import AutoTokenizer

        before = {p.name for p in out.iterdir()}
        AutoTokenizer.from_pretrained(str(source)).save_pretrained(str(out))
        written += sorted({p.name for p in out.iterdir()} - before)
    if not (out / "generation_config.json").is_file() and _save_generation_config(out, generation_config):
        written.append("generation_config.json")
    missing = tokenizer_missing(out)
    if missing:
        logger.warning(
            "%s has no tokenizer (%s missing, none in %s): it cannot be served until the tokenizer files are "
            "copied there",
            out,
            ", ".join(missing),
            source,
        )
    return written


def _save_generation_config(out: Path, generation_config: GenerationConfig | None = None) -> bool:
    """Write ``out/generation_config.json`` from ``generation_config``, else from ``out``'s config.json."""
    try:
        if generation_config is None:
            from transformers import AutoConfig, GenerationConfig

            generation_config = GenerationConfig.from_model_config(AutoConfig.from_pretrained(str(out)))
        generation_config.save_pretrained(str(out))
    except (OSError, ValueError) as e:  # (a config transformers cannot read: served without one)
        logger.warning("%s: no generation_config.json written (%s)", out, e)
        return False
    return True


def _umask() -> int:
    """This process's umask, read without changing it (``os.umask`` sets one to read it: a file another
    thread made meanwhile would get the wrong mode); 0o022 where /proc does not say."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


def share_as_new_files(directory: str | Path) -> None:
    """Give every file under ``directory`` the permission bits the umask gives a new file (adding, never
    removing). Why: safetensors (0.8) writes its files 0600 through a temporary file, so a checkpoint's and
    an export's weights were unreadable to a teammate on a shared filesystem while every file beside them
    was 0644."""
    import os

    allowed = 0o666 & ~_umask()
    for path in Path(directory).rglob("*"):
        if path.is_file() and not path.is_symlink():
            mode = path.stat().st_mode & 0o777
            if mode | allowed != mode:
                os.chmod(path, mode | allowed)
