r"""Is the model's answer the same mathematical object as the label?

Why this is not ``a == b``: a correct answer reaches us as ``\dfrac{1}{2}``, ``0.5``, ``1/2``,
``50\%`` or ``\text{0.5 m}``; rewarding only the exact label string punishes correct answers and
teaches the policy the dataset's formatting instead of mathematics. We compare in three steps,
cheapest first:

1. strings after LaTeX normalization (``\dfrac``→``\frac``, units and ``\text{}`` dropped, ...);
2. exact numbers: integers compare exactly (no float rounding of ``10^{20}``), rationals exactly,
   decimals and scientific notation with a small relative tolerance;
3. sympy, for simple symbolic expressions (``2\sqrt{2}`` vs ``\sqrt{8}``, ``x^2+2x+1`` vs
   ``(x+1)^2``).

Safety: step 3 never evaluates model text as Python. Our own tokenizer turns the LaTeX into a
token list drawn from a small whitelist (numbers, single-letter symbols, a few function names,
operators); anything else means "not comparable symbolically". Exponents and factorials are bounded
before sympy evaluates anything, and long inputs are refused, so ``2^{2^{2^{100}}}`` costs
microseconds. sympy is imported inside :func:`symbolic_equal` so ``import relax_rewards`` stays light.
"""

from __future__ import annotations

import re
from fractions import Fraction

__all__ = ["is_equiv", "normalize", "parse_number", "symbolic_equal"]

MAX_SYMBOLIC_LEN = 200  # characters of normalized input sent to sympy
MAX_EXPONENT = 1000  # |exponent| allowed in a constant power
MAX_FACTORIAL = 200
MAX_NUMBER_DIGITS = 400  # longer digit strings are compared as strings only
REL_TOL = 1e-6

_UNITS = (
    "units?|degrees?|deg|cm|mm|km|m|meters?|metres?|inch(?:es)?|in|feet|ft|foot|yards?|miles?|"
    "seconds?|sec|s|minutes?|min|hours?|hrs?|h|days?|weeks?|months?|years?|kg|g|grams?|mg|lbs?|"
    "pounds?|ounces?|oz|liters?|litres?|l|ml|mph|dollars?|cents?|points?|percent|sq|square|cubic|"
    "ways|people|students|apples"
)
_UNIT_TAIL_RE = re.compile(rf"(?:\s*(?<![a-zA-Z])(?:{_UNITS})(?:\^\{{?[23]\}}?)?\.?)+$")
MAX_NORMALIZE_LEN = 2000  # longer strings are only stripped: regexes stay linear and cheap
_TEXT_CMD_RE = re.compile(r"\\(?:text|textbf|textit|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}")
_NUMBER_RE = re.compile(r"^[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:e[+-]?\d+)?$", re.IGNORECASE)
_THOUSANDS_RE = re.compile(r"^[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_FRAC_RE = re.compile(r"^([+-]?)\\frac\{([^{}]+)\}\{([^{}]+)\}$")
_SLASH_RE = re.compile(r"^([+-]?\d+)\s*/\s*([+-]?\d+)$")
_REPEATING_RE = re.compile(r"([+-]?\d*)\.(\d*)\\overline\{(\d{1,20})\}")
_MIXED_RE = re.compile(r"^([+-]?)(\d+)\\frac\{(\d+)\}\{(\d+)\}$")
_SCI_LATEX_RE = re.compile(r"([\d.]+)\s*(?:\\times|\\cdot|\*|x)\s*10\s*\^\s*\{?\s*([+-]?\d+)\s*\}?")


def normalize(text: str, strip_variable: bool = True) -> str:
    r"""Canonical string form of an answer: LaTeX noise, units and wrappers removed.

    >>> normalize(r"\$1{,}000 \text{ dollars}")
    '1000'
    >>> normalize(r"\left( \dfrac12, x \right)")
    '(\\frac{1}{2},x)'
    >>> normalize(r"x = 5^\circ")
    '5'
    """
    s = str(text).strip()
    if len(s) > MAX_NORMALIZE_LEN:
        return s.replace(" ", "")
    s = s.replace("\n", " ")
    s = s.replace(r"\$", "").replace("$", "")
    for wrapper in (r"\(", r"\)", r"\[", r"\]"):
        s = s.replace(wrapper, " ")
    s = re.sub(r"\\displaystyle|\\left|\\right|\\!|\\,|\\;|\\:|\\quad|\\qquad|~", " ", s)
    s = s.replace(r"\ ", " ").replace("{,}", "").replace(r"\{", "{").replace(r"\}", "}")
    s = re.sub(r"\^\s*\{?\s*\\circ\s*\}?|°|\\degree", "", s)
    s = re.sub(r"(\d)\s*\\text\{[^{}]*\}\s*$", r"\1", s)  # "5\text{ cm}" → "5"
    s = _TEXT_CMD_RE.sub(r"\1", s)
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = re.sub(r"\\frac\s*(\d)\s*(\d)", r"\\frac{\1}{\2}", s)  # \frac12
    s = re.sub(r"\\frac\s*\{([^{}]*)\}\s*(\d)", r"\\frac{\1}{\2}", s)  # \frac{1}2
    s = re.sub(r"\\sqrt\s*(\d|[a-zA-Z])", r"\\sqrt{\1}", s)  # \sqrt2
    s = s.replace(r"\%", "%").replace(r"\cdot", "*").replace(r"\times", "*")
    s = s.replace(r"\varnothing", r"\emptyset").replace(r"\dots", "").replace(r"\ldots", "")
    s = re.sub(r"\s+", " ", s).strip().rstrip(".,;").strip()
    s = re.sub(r"(?i)^(?:the\s+)?(?:final\s+)?answer\s*(?:is\b|:)?\s*", "", s)  # \text{the answer is } 12
    s = re.sub(r"^\(?[A-E]\)\s+(?=[-\d\\])", "", s)  # AMC style "(C) 12" → "12"
    if strip_variable:
        s = re.sub(r"^[a-zA-Z]\s*=\s*(?=\S)", "", s)  # "x = 5" → "5"
    s = _strip_units(s)
    if _THOUSANDS_RE.match(s.replace(" ", "")):
        s = s.replace(",", "").replace(" ", "")
    s = s.replace(" ", "")
    return s


def _strip_units(s: str) -> str:
    """Drop trailing unit words after a number: "12 meters" → "12", but keep "2x" and "5 m^x"."""
    m = _UNIT_TAIL_RE.search(s)
    if not m or m.start() == 0:
        return s
    head = s[: m.start()].strip()
    if re.search(r"\d", head) and not re.search(r"[a-zA-Z]", re.sub(r"\\(?:frac|sqrt)", "", head)):
        return head
    return s


def parse_number(s: str) -> tuple[Fraction, bool] | None:
    r"""Parse a normalized answer as an exact number.

    Returns ``(value, exact)`` where ``exact`` is False for decimals / scientific notation (compared
    with a tolerance) and True for integers and fractions; ``None`` when ``s`` is not a plain number.
    A trailing ``%`` is *not* handled here (see :func:`is_equiv`).

    >>> parse_number(r"-\frac{3}{4}")
    (Fraction(-3, 4), True)
    >>> parse_number("2.5e3")
    (Fraction(2500, 1), False)
    """
    s = s.strip()
    if not s or len(s) > MAX_NUMBER_DIGITS:
        return None
    m = _REPEATING_RE.fullmatch(s)
    if m:  # 0.1\overline{6} = 1/6
        whole, fixed, rep = m.group(1) or "0", m.group(2), m.group(3)
        sign = -1 if whole.startswith("-") else 1
        base = Fraction(abs(int(whole.lstrip("+-") or 0))) + (
            Fraction(int(fixed), 10 ** len(fixed)) if fixed else 0
        )
        base += Fraction(int(rep), (10 ** len(rep) - 1) * 10 ** len(fixed))
        return sign * base, True
    m = _SCI_LATEX_RE.fullmatch(s)
    if m:
        s = f"{m.group(1)}e{m.group(2)}"
    try:
        if _NUMBER_RE.match(s):
            exponent = re.search(r"e([+-]?\d+)$", s, re.IGNORECASE)
            if exponent and abs(int(exponent.group(1))) > MAX_EXPONENT:
                return None
            is_exact = "." not in s and "e" not in s.lower()
            return Fraction(s), is_exact
        m = _MIXED_RE.match(s)
        if m and int(m.group(3)) < int(m.group(4)):  # 2\frac{1}{3} is the mixed number 7/3
            value = int(m.group(2)) + Fraction(int(m.group(3)), int(m.group(4)))
            return (-value if m.group(1) == "-" else value), True
        m = _FRAC_RE.match(s) or _SLASH_RE.match(s)
        if m:
            groups = m.groups()
            sign = -1 if len(groups) == 3 and groups[0] == "-" else 1
            num_s, den_s = groups[-2], groups[-1]
            num, den = parse_number(num_s), parse_number(den_s)
            if num is None or den is None or den[0] == 0:
                return None
            return sign * num[0] / den[0], num[1] and den[1]
    except (ValueError, ZeroDivisionError, OverflowError):
        return None
    return None


def _numbers_equal(a: tuple[Fraction, bool], b: tuple[Fraction, bool]) -> bool:
    if a[1] and b[1]:
        return a[0] == b[0]
    # Exact Fraction arithmetic: float() overflows past 1e308 and the inputs may be huge.
    diff = abs(a[0] - b[0])
    return diff <= Fraction(REL_TOL) * max(abs(a[0]), abs(b[0]))


def _split_top_level(s: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(s):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(s[start:i])
            start = i + 1
    parts.append(s[start:])
    return parts


def _strip_brackets(s: str) -> tuple[str, str]:
    if len(s) >= 2 and s[0] + s[-1] in ("()", "[]", "{}") and len(_split_top_level(s[1:-1])) > 1:
        return s[0] + s[-1], s[1:-1]
    return "", s


def is_equiv(pred: str | None, label: object, *, symbolic: bool = True) -> bool:
    r"""True when ``pred`` and ``label`` denote the same answer.

    >>> is_equiv(r"\dfrac{1}{2}", "0.5")
    True
    >>> is_equiv("50\\%", "50")
    True
    >>> is_equiv("1,000", 1000)
    True
    >>> is_equiv(r"2\sqrt{2}", r"\sqrt{8}")
    True
    >>> is_equiv("3", "4")
    False
    """
    if pred is None or label is None:
        return False
    a, b = normalize(pred), normalize(str(label))
    if not a or not b:
        return False
    if a == b:
        return True
    ea, eb = normalize(pred, strip_variable=False), normalize(str(label), strip_variable=False)
    if _is_equation(ea) and _is_equation(eb):
        return _equations_equiv(ea, eb) if symbolic else False
    a, b = _expand_pm(a), _expand_pm(b)
    if _looks_like_interval(a) or _looks_like_interval(b):
        return _intervals_equiv(a, b, symbolic)
    # Tuples, lists and sets: compare element-wise (sets and bare lists also unordered).
    (ka, ia), (kb, ib) = _strip_brackets(a), _strip_brackets(b)
    pa, pb = _split_top_level(ia), _split_top_level(ib)
    if len(pa) > 1 or len(pb) > 1:
        pa, pb = [_strip_var(x) for x in pa], [_strip_var(y) for y in pb]
        if len(pa) != len(pb) or (ka and kb and ka != kb):
            return False
        if all(_atom_equiv(x, y, symbolic) for x, y in zip(pa, pb)):
            return True
        if ka in ("", "{}") and kb in ("", "{}"):
            remaining = list(pb)
            for x in pa:
                match = next((y for y in remaining if _atom_equiv(x, y, symbolic)), None)
                if match is None:
                    return False
                remaining.remove(match)
            return True
        return False
    return _atom_equiv(a, b, symbolic)


def _strip_var(s: str) -> str:
    return re.sub(r"^[a-zA-Z]=(?=\S)", "", s)


def _expand_pm(s: str) -> str:
    r"""``1\pm\sqrt{2}`` → ``1+\sqrt{2},1-\sqrt{2}`` (one top-level ``\pm`` only)."""
    if s.count(r"\pm") != 1 or "," in s:
        return s
    head, tail = s.split(r"\pm")
    return f"{head}+{tail},{head}-{tail}" if head else f"{tail},-{tail}"


_INTERVAL_RE = re.compile(r"^([(\[])([^,()\[\]]+(?:\([^()]*\))?[^,()\[\]]*),([^,\[\]]+?)([)\]])$")


def _looks_like_interval(s: str) -> bool:
    return r"\cup" in s or (s[:1] + s[-1:] in ("(]", "[)") and _INTERVAL_RE.match(s) is not None)


def _intervals_equiv(a: str, b: str, symbolic: bool) -> bool:
    """Unions of intervals: same pieces (in any order), same bracket kinds, equal end points."""
    pa, pb = a.split(r"\cup"), b.split(r"\cup")
    if len(pa) != len(pb):
        return False
    parsed_a = [m for p in pa if (m := _INTERVAL_RE.match(p)) is not None]
    parsed_b = [m for p in pb if (m := _INTERVAL_RE.match(p)) is not None]
    if len(parsed_a) != len(pa) or len(parsed_b) != len(pb):  # a piece that is not an interval
        return False

    def same(x: re.Match, y: re.Match) -> bool:
        return (
            x.group(1) == y.group(1)
            and x.group(4) == y.group(4)
            and _atom_equiv(x.group(2), y.group(2), symbolic)
            and _atom_equiv(x.group(3), y.group(3), symbolic)
        )

    remaining = list(parsed_b)
    for x in parsed_a:
        match = next((y for y in remaining if same(x, y)), None)
        if match is None:
            return False
        remaining.remove(match)
    return True


def _is_equation(s: str) -> bool:
    return s.count("=") == 1 and "," not in s and not re.search(r"[<>]|\\[lg]eq?", s)


def _equations_equiv(a: str, b: str) -> bool:
    """``x^2-1=0`` ~ ``x^2=1`` ~ ``1=x^2``: (lhs - rhs) agree up to a non-zero constant factor."""
    from relax_rewards._sympy_parse import safe_sympify

    parsed = [safe_sympify(side) for eq in (a, b) for side in eq.split("=")]
    sides = [x for x in parsed if x is not None]
    if len(sides) != len(parsed) or not all(
        sides[i].free_symbols or sides[i + 1].free_symbols for i in (0, 2)
    ):
        return False
    import sympy

    try:
        da, db = sympy.expand(sides[0] - sides[1]), sympy.expand(sides[2] - sides[3])
        if da == 0 or db == 0:
            return False
        ratio = sympy.simplify(da / db)
        return bool(ratio.is_number and ratio != 0)
    except Exception:
        return False


def _atom_equiv(a: str, b: str, symbolic: bool) -> bool:
    if a == b:
        return True
    if a.endswith("%") or b.endswith("%"):
        # "50%" matches "50" and "0.5": graders and datasets disagree on which they mean.
        for x in _percent_forms(a):
            for y in _percent_forms(b):
                if x == y or _atom_equiv(x, y, symbolic):
                    return True
        return False
    na, nb = parse_number(a), parse_number(b)
    if na is not None and nb is not None:
        return _numbers_equal(na, nb)
    if symbolic:
        return symbolic_equal(a, b)
    return False


def _percent_forms(s: str) -> list[str]:
    if not s.endswith("%"):
        return [s]
    core = s[:-1]
    value = parse_number(core)
    forms = [core]
    if value is not None:
        forms.append(str(value[0] / 100) if value[1] else repr(float(value[0] / 100)))
    return forms


def symbolic_equal(a: str, b: str) -> bool:
    r"""Compare two normalized LaTeX expressions with sympy; False when either cannot be parsed safely.

    >>> symbolic_equal(r"\frac{\sqrt{2}}{2}", r"\frac{1}{\sqrt{2}}")
    True
    >>> symbolic_equal("(x+1)^2", "x^2+2x+1")
    True
    >>> symbolic_equal("2^{2^{2^{100}}}", "1")
    False
    """
    from relax_rewards._sympy_parse import safe_sympify

    ea, eb = safe_sympify(a), safe_sympify(b)
    if ea is None or eb is None:
        return False
    import sympy

    try:
        if ea == eb:
            return True
        if ea.is_Rational and eb.is_Rational:
            return False  # exact numbers that differ (ea == eb was checked above)
        if not ea.free_symbols and not eb.free_symbols:
            va, vb = sympy.N(ea, 30), sympy.N(eb, 30)
            if va.is_real is False or vb.is_real is False:
                return bool(sympy.simplify(ea - eb) == 0)
            # A decimal is an approximation ("3.14159" for pi); exact forms must agree to 1e-12.
            tol = REL_TOL if ("." in a or "." in b) else 1e-12
            return bool(sympy.Abs(va - vb) <= sympy.Float(tol) * sympy.Abs(vb) + sympy.Float(1e-12))
        diff = sympy.expand(ea - eb)
        if diff == 0:
            return True
        if sympy.count_ops(diff) > 60:
            return False
        return bool(sympy.simplify(diff) == 0)
    except Exception:  # sympy raises a zoo of types on odd input; "not equal" is the safe answer
        return False
