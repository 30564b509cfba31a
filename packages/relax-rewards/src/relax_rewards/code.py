r"""``code``: run the response's Python against test cases in the sandbox.

Why these label shapes: code datasets store tests either as stdin/stdout pairs (APPS, CodeContests,
DeepCoder: ``{"inputs": [...], "outputs": [...]}`` or ``[{"input": ..., "output": ...}]``) or as
assert statements to run after the solution (MBPP, HumanEval: a string or a list of strings). We
accept all of them. The code is the last fenced ```` ```python ```` block (any fence if none is
tagged), else the whole response.

Score: the fraction of test cases passed (``metadata["all_or_nothing"] = True`` for 1.0 only when
every case passes). Each stdin case and the assert block run in a fresh sandboxed process
(:mod:`relax_rewards.sandbox`) with ``metadata["timeout_s"]`` (default 5 s) and
``metadata["memory_mb"]`` (default 512 MB). Output is compared line by line, trailing whitespace
ignored.
"""

from __future__ import annotations

import re
from typing import Any

from relax_rewards.registry import register
from relax_rewards.sandbox import run_python
from relax_rewards.types import RewardResult

__all__ = ["code_reward", "extract_code", "parse_tests"]

_FENCE_RE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)```", re.DOTALL)
MAX_CASES = 50


def extract_code(response: str) -> str | None:
    """The last fenced Python block (or last fenced block of any language), else the response.

    >>> extract_code("Here:\\n```python\\nprint(1)\\n```\\nand ```\\nx\\n```")
    'print(1)\\n'
    >>> extract_code("") is None
    True
    """
    blocks = _FENCE_RE.findall(response or "")
    python = [body for lang, body in blocks if lang.lower() in ("python", "py", "python3")]
    if python:
        return python[-1]
    if blocks:
        return blocks[-1][1]
    return response if response and response.strip() else None


def parse_tests(label: Any) -> tuple[list[tuple[str, str]], str | None]:
    """``(stdin/stdout pairs, assert code)`` from any accepted label shape.

    >>> parse_tests({"inputs": ["1\\n"], "outputs": ["2\\n"]})
    ([('1\\n', '2\\n')], None)
    >>> parse_tests(["assert f(1) == 2"])
    ([], 'assert f(1) == 2')
    """
    if isinstance(label, str):
        import json

        try:
            label = json.loads(label)
        except ValueError:
            return [], label
    if isinstance(label, dict) and "inputs" in label:
        return [(str(i), str(o)) for i, o in zip(label["inputs"], label["outputs"])], None
    if isinstance(label, list | tuple):
        if all(isinstance(t, str) for t in label):
            return [], "\n".join(label)
        return [(str(t["input"]), str(t["output"])) for t in label], None
    raise ValueError(f"code tests must be stdin/stdout pairs or assert strings (got {type(label).__name__})")


def _same_output(got: str, want: str) -> bool:
    strip = lambda s: [line.rstrip() for line in s.strip().splitlines()]  # noqa: E731
    return strip(got) == strip(want)


@register("code")
def code_reward(response: str, label: Any, metadata: dict | None = None) -> RewardResult:
    """Fraction of the label's test cases the response's code passes, run in the sandbox.

    >>> code_reward("```python\\nprint(int(input()) * 2)\\n```", [{"input": "3", "output": "6"}]).score
    1.0
    >>> code_reward("def f(x): return x", "assert f(2) == 3").score
    0.0
    """
    meta = metadata or {}
    code = extract_code(response)
    if code is None:
        return RewardResult(0.0, {"format_ok": False, "passed": 0, "total": 0})
    cases, asserts = parse_tests(label)
    cases = cases[: int(meta.get("max_cases", MAX_CASES))]
    timeout_s, memory_mb = float(meta.get("timeout_s", 5.0)), int(meta.get("memory_mb", 512))
    passed, total, first_error = 0, 0, None
    for stdin, expected in cases:
        total += 1
        run = run_python(code, stdin, timeout_s=timeout_s, memory_mb=memory_mb)
        if run.ok and _same_output(run.stdout, expected):
            passed += 1
        elif first_error is None:
            first_error = (
                "timeout" if run.timed_out else (run.stderr.strip().splitlines() or ["wrong output"])[-1]
            )
        if meta.get("all_or_nothing") and passed < total:
            break
    if asserts:
        total += 1
        run = run_python(code + "\n\n" + asserts + "\n", timeout_s=timeout_s, memory_mb=memory_mb)
        if run.ok:
            passed += 1
        elif first_error is None:
            first_error = "timeout" if run.timed_out else (run.stderr.strip().splitlines() or ["failed"])[-1]
    if meta.get("all_or_nothing"):
        score = 1.0 if total and passed == total else 0.0
    else:
        score = passed / total if total else 0.0
    return RewardResult(
        score, {"format_ok": True, "passed": passed, "total": total, "first_error": first_error}
    )
