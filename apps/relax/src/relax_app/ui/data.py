"""What `relax ui` shows, read from a run directory as the run writes it — live or finished, no state of its own.

Each reader answers with what is there and says what is missing (``problems``) instead of failing: a
directory that is empty, a run that has not written a file yet, a half-written last line, a file of an older
relax (no ``samples/``: written since #56). The files: ``status.json`` (``relax_core.live``),
``metrics.jsonl`` (one line per step), ``samples/step_<k>.jsonl`` (``relax_core.sample_log``), ``trace.json``
(``relax_core.trace``), ``run.json`` (the model, hence the tokenizer that decodes the samples' ids) and
``config.json`` (the data file and media columns, for a multimodal sample's media).
"""

from __future__ import annotations

import json
import math
import mimetypes
import os
import threading
from functools import cached_property
from pathlib import Path
from typing import Any

from relax_core import sample
from relax_core.sample_log import logged_steps, read_step

MEDIA_SUFFIXES = {
    ".png",
    ".jpg",
    ".jpeg",
    ".gif",
    ".webp",
    ".bmp",
    ".wav",
    ".mp3",
    ".flac",
    ".ogg",
    ".mp4",
    ".webm",
}
"""Files a sample's media may be served as (what a browser plays or shows)."""


def _json(path: Path) -> tuple[Any, str | None]:
    """(the file's JSON, None) or (None, what is wrong with it)."""
    try:
        return json.loads(path.read_text()), None
    except FileNotFoundError:
        return None, f"{path.name} is missing"
    except (OSError, ValueError) as e:
        return None, f"{path.name} cannot be read ({type(e).__name__}: {str(e)[:120]})"


def _finite(row: dict[str, Any]) -> dict[str, Any]:
    """A metrics row with non-finite numbers as None (JSON has no NaN)."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}


class RunView:
    """One run directory, read on demand."""

    def __init__(self, run_dir: str | Path) -> None:
        self.dir = Path(run_dir)
        self._metrics_lock = threading.Lock()
        self._metrics_file: tuple[int, int] | None = None
        """(inode, device) of the metrics file read so far, its bytes read and their rows."""
        self._metrics_offset = 0
        self._metrics_rows: list[dict[str, Any]] = []

    # -- the run ----------------------------------------------------------------------------------
    def overview(self) -> dict[str, Any]:
        """The run's status, settings and logged steps, and what is missing for the page to show all."""
        problems: list[str] = []
        if not self.dir.is_dir():
            return {"run_dir": str(self.dir), "problems": [f"{self.dir} is not a directory"], "status": None}
        if not any(self.dir.iterdir()):
            problems.append(f"{self.dir} is empty: no run has written here yet (start one with --output-dir)")
        status, why = _json(self.dir / "status.json")
        if why:
            problems.append(f"{why}: no live status (the run writes it as it starts)")
        cfg, why = _json(self.dir / "config.json")
        if why:
            problems.append(f"{why}: the run's settings are unknown")
        if not (self.dir / "metrics.jsonl").is_file():
            problems.append("metrics.jsonl is missing: no step has finished yet")
        steps = logged_steps(self.dir)
        if not steps and (self.dir / "metrics.jsonl").is_file():
            live = isinstance(status, dict) and status.get("state") in ("starting", "running")
            problems.append(
                "samples/ has no step yet: the trainer writes each step's after the step"
                if live
                else "samples/ is missing: this run wrote no samples (a relax before the run explorer, or "
                "--log-samples 0)"
            )
        if not (self.dir / "trace.json").is_file():
            traced = not isinstance(cfg, dict) or (cfg.get("run") or {}).get("trace", True)
            problems.append(
                "trace.json is missing: no timeline yet (the run writes it every few seconds)"
                if traced
                else "trace.json is missing: the run was started with --no-trace (no timeline of its phases)"
            )
        return {
            "run_dir": str(self.dir),
            "status": status if isinstance(status, dict) else None,
            "settings": _settings(cfg) if isinstance(cfg, dict) else {},
            "sample_steps": steps,
            "problems": problems,
        }

    def metrics(self, after: int = 0) -> list[dict[str, Any]]:
        """The steps' metrics rows after step ``after`` (a line still being written is left for later).

        The file is read from where the last call stopped (the page polls every second; a long run's file
        is megabytes), and from the start again when it was replaced or cut (a run started over)."""
        path = self.dir / "metrics.jsonl"
        with self._metrics_lock:
            try:
                with path.open("rb") as f:
                    st = os.fstat(f.fileno())
                    if (st.st_ino, st.st_dev) != self._metrics_file or st.st_size < self._metrics_offset:
                        self._metrics_file, self._metrics_offset, self._metrics_rows = (
                            (st.st_ino, st.st_dev),
                            0,
                            [],
                        )
                    f.seek(self._metrics_offset)
                    chunk = f.read()
            except OSError:
                return []
            complete = chunk[: chunk.rfind(b"\n") + 1]  # (a line without its newline yet: next time)
            self._metrics_offset += len(complete)
            for line in complete.splitlines():
                try:
                    row = json.loads(line)
                except ValueError:
                    continue
                if isinstance(row, dict) and isinstance(row.get("step"), int):
                    self._metrics_rows.append(_finite(row))
            return [r for r in self._metrics_rows if r["step"] > after]

    # -- samples ----------------------------------------------------------------------------------
    @cached_property
    def tokenizer(self) -> Any:
        """The run's tokenizer (``run.json``'s model), or None where it cannot be loaded."""
        run, _ = _json(self.dir / "run.json")
        model = run.get("model_path") if isinstance(run, dict) else None
        if not model:
            return None
        try:
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(model)
        except Exception:  # noqa: BLE001 - the ids are shown instead, saying why
            return None

    def samples(self, step: int) -> dict[str, Any]:
        """Step ``step``'s samples by group, each response as tokens with the policy version that produced
        each and its |Δ log-prob| between the trainer and the rollout (where the trainer's were logged)."""
        try:
            rows = read_step(self.dir, step)
        except FileNotFoundError:
            known = logged_steps(self.dir)
            return {
                "step": step,
                "groups": [],
                "problem": f"no samples of step {step} (logged: {known[-20:]})",
            }
        groups: dict[str, dict[str, Any]] = {}
        for i, r in enumerate(rows):
            g = groups.setdefault(
                str(r.get(sample.GROUP_ID)),
                {sample.GROUP_ID: r.get(sample.GROUP_ID), "prompt": "", "samples": []},
            )
            g["prompt"] = g["prompt"] or self._text(r.get("prompt_ids", []))
            g["samples"].append(self._sample(i, r))
        problem = (
            None if self.tokenizer is not None else "the run's tokenizer could not be loaded: token ids shown"
        )
        return {"step": step, "groups": list(groups.values()), "problem": problem}

    def _sample(self, i: int, r: dict[str, Any]) -> dict[str, Any]:
        ids = r.get("response_ids", [])
        n, pieces = len(ids), [self._piece(t) for t in ids]
        versions = r.get(sample.TOKEN_VERSIONS) or [r.get(sample.POLICY_VERSION)] * n
        mask = r.get(sample.LOSS_MASK) or [1.0] * n
        ours, theirs = r.get(sample.LOG_PROBS), r.get(sample.ROLLOUT_LOG_PROBS)
        diff = [abs(a - b) for a, b in zip(ours, theirs)] if ours and theirs else [None] * n
        adv = r.get(sample.ADVANTAGES) or []
        on = [a for a, m in zip(adv, mask) if m]
        return {
            "index": i,
            "reward": r.get(sample.REWARD),
            "advantage": sum(on) / len(on) if on else None,
            "finish_reason": r.get(sample.FINISH_REASON),
            sample.POLICY_VERSION: r.get(sample.POLICY_VERSION),
            sample.AGENT: r.get(sample.AGENT),
            sample.TURNS: r.get(sample.TURNS),
            sample.REWARD_FAILURE: r.get(sample.REWARD_FAILURE) or "",
            sample.PROMPT_ID: r.get(sample.PROMPT_ID),
            "tokens": [
                {"t": piece, "v": v, "d": d, "m": int(bool(m)), "k": k}
                for piece, v, d, m, k in zip(pieces, versions, diff, mask, token_kinds(pieces, mask))
            ],
            "media": self.media_of(r.get(sample.PROMPT_ID)),
        }

    def _text(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return " ".join(f"#{t}" for t in ids)
        return str(self.tokenizer.decode(ids, skip_special_tokens=False))

    def _piece(self, token_id: int) -> str:
        return f"#{token_id}" if self.tokenizer is None else str(self.tokenizer.decode([token_id]))

    # -- media of multimodal samples ----------------------------------------------------------------
    @cached_property
    def _media_rows(self) -> dict[str, list[str]]:
        """Row id → the media files of that row (the data file's media columns, --multimodal-keys)."""
        cfg, _ = _json(self.dir / "config.json")
        data = (cfg or {}).get("data", {}) if isinstance(cfg, dict) else {}
        keys, path = data.get("multimodal_keys") or {}, data.get("prompt_data")
        if not keys or not path or not str(path).endswith(".jsonl") or not Path(path).is_file():
            return {}
        out: dict[str, list[str]] = {}
        for i, line in enumerate(Path(path).read_text().splitlines()):
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            files = []
            for column in keys.values():
                v = rec.get(column) if isinstance(rec, dict) else None
                files += [str(x) for x in (v if isinstance(v, list) else [v]) if isinstance(x, str)]
            if files and isinstance(rec, dict):
                out[str(rec.get("id", i))] = files
        return out

    def media_of(self, prompt_id: Any) -> list[dict[str, str]]:
        """A sample's media as ``{"kind": image|audio|video, "n": k}`` (served by :meth:`media_file`)."""
        files = self._media_rows.get(str(prompt_id), [])
        out = []
        for k, f in enumerate(files):
            kind = (mimetypes.guess_type(f)[0] or "").split("/")[0]
            if Path(f).suffix.lower() in MEDIA_SUFFIXES and kind in ("image", "audio", "video"):
                out.append({"kind": kind, "n": str(k)})
        return out

    def media_file(self, prompt_id: str, k: int) -> Path | None:
        """The ``k``-th media file of row ``prompt_id``, if it is one a browser shows."""
        files = self._media_rows.get(prompt_id, [])
        if not 0 <= k < len(files) or Path(files[k]).suffix.lower() not in MEDIA_SUFFIXES:
            return None
        path = Path(files[k])
        return path if path.is_file() else None

    # -- the timeline -----------------------------------------------------------------------------
    def timeline(self, limit: int = 5000) -> dict[str, Any]:
        """The roles' phases (``trace.json``, the last ``limit``; an engine pool's engines each on a row of
        its own, ``engine <id>``, from joining to leaving), their states and the health manager's
        failures and restarts (``status.json``; each placed on the trace's clock), and the bus depth per step
        (``metrics.jsonl``)."""
        trace, why = _json(self.dir / "trace.json")
        events = trace.get("traceEvents", []) if isinstance(trace, dict) else []
        names = {
            e.get("pid"): (e.get("args") or {}).get("name")
            for e in events
            if isinstance(e, dict) and e.get("ph") == "M" and e.get("name") == "process_name"
        }
        spans = [
            {
                "role": names.get(e.get("pid")) or str(e.get("pid")),
                "name": e.get("name"),
                "ts": e["ts"],
                "dur": e["dur"],
                "args": {k: v for k, v in (e.get("args") or {}).items() if k != "thread"},
            }
            for e in events
            if isinstance(e, dict)
            and e.get("ph") == "X"
            and isinstance(e.get("ts"), (int, float))
            and isinstance(e.get("dur"), (int, float))
        ][-limit:]
        status, _ = _json(self.dir / "status.json")
        roles = (status or {}).get("roles", {}) if isinstance(status, dict) else {}
        origin = (
            ((trace or {}).get("otherData") or {}).get("origin_unix_ns") if isinstance(trace, dict) else None
        )
        events = [
            {
                **e,
                "ts": (e["at"] * 1e9 - origin) / 1000.0
                if origin and isinstance(e.get("at"), (int, float))
                else None,
            }
            for e in ((status or {}).get("events") or [] if isinstance(status, dict) else [])
            if isinstance(e, dict)
        ]
        bus = [{"step": r["step"], "live": r.get("bus/live")} for r in self.metrics() if "bus/live" in r]
        return {"spans": spans, "roles": roles, "events": events, "bus": bus, "problem": why}


TOOL_CALL, TOOL_RESULT = ("<tool_call>", "<function="), ("<tool_response>", "<|im_start|>tool")
"""Text that marks a model turn as a tool call (Qwen's JSON and XML call formats) and an observation as a
tool's result (Qwen's chat template wraps a ``tool`` message of a conversation with tools in
``<tool_response>``, others under the role's own header)."""


def token_kinds(pieces: list[str], mask: list[Any]) -> list[str]:
    """Each response token's part of a multi-turn trajectory: ``gen`` (the model's text, trained on),
    ``call`` (a model turn that calls a tool), ``obs`` (what came back between turns, not trained on: the
    environment's or user's message with its template) or ``tool`` (an observation that is a tool's result).

    Read from the tokens alone, as every rollout path (environments, tool envs, agents over our server)
    leaves them: turns are the runs of equal loss mask; a model turn is a call when its text holds a tool
    call or the observation after it is a tool result (``calc: 2+3`` answered by the calculator)."""
    runs: list[tuple[int, int, bool]] = []  # (start, end, trained on)
    for i, m in enumerate(mask):
        if runs and runs[-1][2] == bool(m) and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1, bool(m))
        else:
            runs.append((i, i + 1, bool(m)))
    text = ["".join(pieces[a:b]) for a, b, _ in runs]
    tool = [not on and any(t in txt for t in TOOL_RESULT) for (_, _, on), txt in zip(runs, text)]
    kinds: list[str] = []
    for j, ((a, b, on), txt) in enumerate(zip(runs, text)):
        if on:
            called = any(t in txt for t in TOOL_CALL) or (j + 1 < len(runs) and tool[j + 1])
            kinds += ["call" if called else "gen"] * (b - a)
        else:
            kinds += ["tool" if tool[j] else "obs"] * (b - a)
    return kinds


def _settings(cfg: dict[str, Any]) -> dict[str, Any]:
    """What the page's header says of the run's config."""
    section = lambda name: cfg.get(name) or {}  # noqa: E731
    return {
        "mode": section("run").get("mode"),
        "max_staleness": section("run").get("max_staleness"),
        "model": section("model").get("hf_checkpoint"),
        "estimator": section("algo").get("advantage_estimator"),
        "lora_rank": section("lora").get("lora_rank"),
        "agent_path": section("agent").get("agent_path"),
        "multimodal": bool(section("data").get("multimodal_keys")),
    }


def media_type(path: Path) -> str:
    return mimetypes.guess_type(str(path))[0] or "application/octet-stream"
