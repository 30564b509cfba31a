"""Every ```python block of every README runs as written.

The READMEs' blocks are what users copy first, and they rot silently: once, all six failed (placeholders,
undefined names, a missing import, a top-level ``await``). So each block runs here as its own script —
``python block.py`` with this interpreter (it sees the workspace's packages), in a fresh temporary
directory (a block may write files there), exit status 0 required. A script file, not ``python -c``: a
block that starts a spawn-based pool re-imports its own file in the workers, as the user's would.

A block that cannot run on a CI machine (it needs a GPU) is preceded by ``<!-- no-run: REASON -->``;
those are listed, and capped at ``MAX_NO_RUN`` so the escape hatch stays rare.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a Ray start and a torch import: tens of seconds in all

ROOT = Path(__file__).resolve().parents[1]
DOC_GLOBS = ("README.md", "packages/*/README.md", "apps/*/README.md", "docs/**/*.md", "examples/**/*.md")
MAX_NO_RUN = 2
TIMEOUT_S = 300
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})\s*(?P<lang>[^\s`]*)")
NO_RUN = re.compile(r"^\s*<!--\s*no-run:\s*(?P<reason>.*?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    path: str  # relative to the repository
    line: int  # of the opening fence, 1-based
    code: str
    no_run: str | None  # the reason given in a preceding `<!-- no-run: ... -->`

    @property
    def name(self) -> str:
        return f"{self.path}:{self.line}"


def python_blocks(text: str, path: str = "<text>") -> list[Block]:
    """The ```python (or ```py) fenced blocks of a Markdown text, dedented by their fence's indent."""
    lines, blocks, i = text.splitlines(), [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        fence, indent = m["fence"], len(m["indent"])
        end = next(
            (
                j
                for j in range(i + 1, len(lines))
                if lines[j].strip().startswith(fence) and not lines[j].strip().strip(fence[0])
            ),
            None,
        )
        if end is None:
            raise ValueError(f"{path}:{i + 1}: a {fence} fence is never closed")
        if m["lang"].lower() in ("python", "py"):
            body = "\n".join(
                line[indent:] if line[:indent].isspace() else line for line in lines[i + 1 : end]
            )
            before = next((lines[k] for k in range(i - 1, -1, -1) if lines[k].strip()), "")
            marker = NO_RUN.match(before)
            blocks.append(Block(path, i + 1, body + "\n", marker["reason"] if marker else None))
        i = end + 1
    return blocks


def doc_files() -> list[Path]:
    return sorted({p for pattern in DOC_GLOBS for p in ROOT.glob(pattern) if p.is_file()})


def all_blocks() -> list[Block]:
    return [b for p in doc_files() for b in python_blocks(p.read_text(), str(p.relative_to(ROOT)))]


BLOCKS = all_blocks()


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.no_run is None], ids=lambda b: b.name)
def test_readme_block_runs(block: Block, tmp_path):
    script = tmp_path / "readme_block.py"
    script.write_text(block.code)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"}
    try:
        proc = subprocess.run(
            [sys.executable, str(script)],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{block.name}: the block ran past {TIMEOUT_S} s\n{e.stdout or ''}\n{e.stderr or ''}")
    assert proc.returncode == 0, (
        f"{block.name}: the README's python block exited {proc.returncode}; fix the block (or the code it "
        f"shows).\n--- stdout ---\n{proc.stdout[-3000:]}\n--- stderr ---\n{proc.stderr[-6000:]}"
    )


def test_no_run_blocks_are_rare_and_say_why():
    skipped = [b for b in BLOCKS if b.no_run is not None]
    print(f"{len(BLOCKS)} python blocks in {len(doc_files())} files; not run: {[b.name for b in skipped]}")
    assert all(b.no_run for b in skipped), [b.name for b in skipped if not b.no_run]
    assert len(skipped) <= MAX_NO_RUN, (
        f"{len(skipped)} README blocks are marked no-run ({[b.name for b in skipped]}); at most {MAX_NO_RUN}: "
        "make them run on a CPU with tiny inputs instead"
    )
    # the package READMEs' examples are found (a broken parser would pass every test above vacuously)
    assert {b.path for b in BLOCKS} >= {
        "packages/relax-bus/README.md",
        "packages/relax-multimodal/README.md",
        "packages/relax-rewards/README.md",
    }


def test_python_blocks_parser():
    text = (
        "# t\n\n```bash\necho '```python'\n```\n\n"
        "```python\nprint(1)\n```\n\n"
        "- item\n\n   ```py title=x\n   if True:\n       print(2)\n   ```\n\n"
        "<!-- no-run: needs a GPU -->\n\n````python\nimport torch\n```\n````\n\n"
        "~~~python\nprint(3)\n~~~\n"
    )
    blocks = python_blocks(text, "t.md")
    assert [(b.line, b.code, b.no_run) for b in blocks] == [
        (7, "print(1)\n", None),
        (13, "if True:\n    print(2)\n", None),
        (20, "import torch\n```\n", "needs a GPU"),
        (25, "print(3)\n", None),
    ]
    with pytest.raises(ValueError, match="t.md:1: a ``` fence is never closed"):
        python_blocks("```python\nprint(1)\n", "t.md")
