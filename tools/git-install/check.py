#!/usr/bin/env python3
"""Runs the READMEs' installs straight from git, as written, against a clone of this repository.

Why: `pip install "git+URL#subdirectory=packages/relax-core"` fails. A package's relax-* dependencies
(`relax-bus>=0.4.3,<0.5`) are workspace siblings: uv takes them from the same commit (it reads
`[tool.uv.sources]`), pip looks them up on PyPI, where they are not published. The READMEs therefore give
one command for uv and, for pip, one that names every sibling from the same URL; this checks each of them.

How: the repository is cloned at HEAD (or --ref) into a temporary folder: uncommitted changes are not in
the clone (the commands themselves are read from the working tree's READMEs). Every logical line of a
```bash block that installs from `$RELAX_GIT` with `pip` or `uv pip` runs with bash in a fresh venv of its
own (`uv venv --seed`, activated: VIRTUAL_ENV and PATH), from a folder outside the repository, with
RELAX_GIT=git+file://<clone>. Then each package it names must import, and every relax-* distribution in
the venv must have come from the clone. Commands that install relax-rollout, relax-train or relax-app
(torch, Ray, transformers: minutes) are only resolved (`--dry-run` added) unless --full.

Last, plain `pip install "relax-core @ $RELAX_GIT#subdirectory=packages/relax-core"` must still fail as the
READMEs say (when relax-bus is published, that check says the pip commands can be shortened).

Usage: python3 tools/git-install/check.py [--ref REF] [--full] [-k SUBSTRING]
Needs git and uv on PATH and the package registry; standard library only. Not in CI: it takes minutes
(see the timings it prints).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC_GLOBS = ("README.md", "packages/*/README.md", "apps/*/README.md", "docs/**/*.md")
HEAVY = {"relax-rollout", "relax-train", "relax-app"}  # torch, Ray, transformers: resolved only by default
SPEC = re.compile(r'"(?P<name>[\w.-]+)(?:\[[^\]]*\])? @ \$RELAX_GIT#subdirectory=(?P<sub>[\w./-]+)"')
FENCE = re.compile(r"^\s*(`{3,}|~{3,})\s*(\S*)")
DIST_SOURCES = """
import json, sys
from importlib import metadata
out = {}
for d in metadata.distributions():
    name = d.metadata["Name"]
    if name.startswith("relax-"):
        direct = json.loads(d.read_text("direct_url.json") or "{}")
        out[name] = direct.get("url") if "vcs_info" in direct else None
print(json.dumps(out))
"""


@dataclass
class Command:
    source: str  # file:line of its first line
    text: str  # the logical line (continuations joined)
    packages: list[tuple[str, str]]  # (distribution name, subdirectory)
    fails_with: str | None = None  # the command must fail, saying this (what the READMEs say pip does)

    @property
    def heavy(self) -> bool:
        return any(name in HEAVY for name, _ in self.packages)


def bash_lines(text: str) -> list[tuple[int, str]]:
    """(first line number, logical line) of every ```bash / ```sh block, `\\` continuations joined."""
    out, in_block, fence, pending, start = [], False, "", "", 0
    for n, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if not in_block:
            if m:
                in_block, fence, keep = True, m[1], m[2] in ("bash", "sh", "shell", "console")
            continue
        if m and line.strip() == fence[0] * len(line.strip()) and len(line.strip()) >= len(fence):
            in_block = False
            continue
        if not keep:
            continue
        if not pending:
            start = n
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        out.append((start, " ".join((pending + line).split())))
        pending = ""
    return out


def documented_commands() -> list[Command]:
    seen, out = set(), []
    files = sorted({p for g in DOC_GLOBS for p in ROOT.glob(g) if p.is_file()})
    for path in files:
        for n, line in bash_lines(path.read_text()):
            if "$RELAX_GIT" not in line or not re.match(r"(uv )?pip install ", line):
                continue
            key = line.split(" #")[0].strip()  # the same command with another comment is the same command
            if key in seen:
                continue
            seen.add(key)
            packages = [(m["name"], m["sub"]) for m in SPEC.finditer(line)]
            out.append(Command(f"{path.relative_to(ROOT)}:{n}", key, packages))
    return out


def module_of(clone: Path, sub: str) -> str:
    """The import name a subdirectory's wheel ships (hatch's `packages = ["src/relax_core"]`)."""
    cfg = tomllib.loads((clone / sub / "pyproject.toml").read_text())
    return Path(cfg["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"][0]).name


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


def check(command: Command, clone: Path, work: Path, full: bool) -> str | None:
    """None when the command installs (or resolves) and what it installed imports; else what went wrong."""
    venv = work / "venv"
    made = run(["uv", "venv", "--quiet", "--seed", "--python", "python3", str(venv)])
    if made.returncode:
        return f"uv venv failed: {made.stderr}"
    dry = command.heavy and not full
    text = re.sub(r"\binstall\b", "install --dry-run", command.text, count=1) if dry else command.text
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "UV_PROJECT", "CONDA"))}
    env.update(
        VIRTUAL_ENV=str(venv),
        PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}",
        RELAX_GIT=f"git+file://{clone}",
    )
    done = run(["bash", "-c", text], cwd=work, env=env)
    if command.fails_with is not None:
        if done.returncode and command.fails_with in done.stdout + done.stderr:
            return None
        return (
            f"expected to fail with {command.fails_with!r} (as the READMEs say pip does); got exit "
            f"{done.returncode}: if relax-bus is on the registry now, the pip commands can drop the siblings"
            f"\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
        )
    if done.returncode:
        return f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    if dry:
        return None
    python = str(venv / "bin" / "python")
    for name, sub in command.packages:
        mod = module_of(clone, sub)
        imported = run([python, "-c", f"import {mod}"], cwd=work, env=env)
        if imported.returncode:
            return f"{name} installed but `import {mod}` failed:\n{imported.stderr[-3000:]}"
    listed = run([python, "-c", DIST_SOURCES], cwd=work, env=env)
    sources = json.loads(listed.stdout)
    strays = {name: url for name, url in sources.items() if url != f"file://{clone}"}
    if strays:
        return f"relax-* distributions not installed from the clone's git (file://{clone}): {strays}"
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ref", default="HEAD", help="the commit, branch or tag to clone (default: HEAD)")
    ap.add_argument("--full", action="store_true", help="install relax-rollout/-train/-app too (minutes)")
    ap.add_argument("-k", default="", help="only the commands whose text or source contains this")
    args = ap.parse_args()
    pip_alone = Command(
        "(the failure the READMEs describe)",
        'pip install "relax-core @ $RELAX_GIT#subdirectory=packages/relax-core"',
        [("relax-core", "packages/relax-core")],
        fails_with="No matching distribution found for relax-bus",
    )
    commands = [c for c in [*documented_commands(), pip_alone] if args.k in c.text or args.k in c.source]
    if not commands:
        print("no README command installs from $RELAX_GIT (or none matches -k)", file=sys.stderr)
        return 1
    failed = 0
    with tempfile.TemporaryDirectory(prefix="relax-git-install-") as tmp:
        clone = Path(tmp) / "relax"
        cloned = run(["git", "clone", "--quiet", str(ROOT), str(clone)])
        if cloned.returncode or run(["git", "-C", str(clone), "checkout", "--quiet", args.ref]).returncode:
            print(f"cannot clone {ROOT} at {args.ref}: {cloned.stderr}", file=sys.stderr)
            return 1
        head = run(["git", "-C", str(clone), "rev-parse", "--short", "HEAD"]).stdout.strip()
        print(f"clone of {ROOT} at {head} ({args.ref}); {len(commands)} commands")
        for i, command in enumerate(commands):
            work = Path(tmp) / f"c{i}"
            work.mkdir()
            t0 = time.monotonic()
            error = check(command, clone, work, args.full)
            mode = (
                "fails" if command.fails_with else "resolve" if command.heavy and not args.full else "install"
            )
            verdict = "ok  " if error is None else "FAIL"
            print(f"{verdict} {time.monotonic() - t0:6.1f} s  {mode:7s} {command.source}: {command.text}")
            if error is not None:
                failed += 1
                print("     " + error.replace("\n", "\n     "))
    print(f"{len(commands) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
