r"""A small, bounded LaTeX-to-sympy parser for answer comparison.

Why not ``sympy.parse_expr`` or ``parse_latex``: ``parse_expr`` evaluates generated Python code and
``parse_latex`` needs antlr; both happily build ``2**(2**(2**100))``, which never finishes. Model
output is untrusted, so we tokenize against a whitelist (numbers, single-letter symbols, a few
functions and constants, ``+ - * / ^ ! ( )``) and build the expression with a recursive-descent
parser that checks every power and factorial *before* sympy evaluates it. Anything outside the
whitelist returns ``None``: the caller then treats the answers as "not provably equal".

Only :func:`safe_sympify` is meant to be used; this module imports sympy at import time and is
itself imported lazily by :mod:`relax_rewards.math_equiv`.
"""

from __future__ import annotations

import math
import re

import sympy

__all__ = ["safe_sympify"]

MAX_LEN = 200
MAX_EXPONENT = 1000  # constant exponents
MAX_SYMBOLIC_EXPONENT = 40  # exponents on expressions with free symbols (expand cost)
MAX_DIGITS = 5000  # size of an integer power result
MAX_FACTORIAL = 200
MAX_FUNC_ARG = 1e6  # |argument| of sin, log, exp, ...
MAX_SQRT_ARG = 1e15  # sqrt only extracts square factors: cheap well past 1e6 (898*sqrt(2) = sqrt(1612808))

_FUNCS = {
    "sqrt": sympy.sqrt,
    "sin": sympy.sin,
    "cos": sympy.cos,
    "tan": sympy.tan,
    "log": sympy.log,
    "ln": sympy.log,
    "exp": sympy.exp,
    "abs": sympy.Abs,
}
_CONSTS = {"pi": sympy.pi, "infty": sympy.oo, "oo": sympy.oo, "e": sympy.E}
_MULTI = sorted([*_FUNCS, "pi", "infty"], key=len, reverse=True)
_TOKEN_RE = re.compile(r"\s*(?:(\d+(?:\.\d*)?|\.\d+)|([a-zA-Z]+)|(\*\*|[-+*/()!^]))")


_TRIG_POWER_RE = re.compile(r"\\(sin|cos|tan|log|ln)\^\{?(\d)\}?\s*([a-zA-Z0-9]|\([^()]*\))")
_ABS_RE = re.compile(r"\|([^|]+)\|")


class _Refuse(Exception):
    """Input outside what we are willing to evaluate."""


def safe_sympify(text: str) -> sympy.Expr | None:
    r"""Parse a normalized LaTeX answer into a sympy expression, or ``None`` if unsafe / unsupported.

    >>> safe_sympify(r"\frac{x}{2}+\sqrt{4}")
    x/2 + 2
    >>> safe_sympify("2^{10^{9}}") is None
    True
    >>> safe_sympify("__import__('os')") is None
    True
    """
    if not text or len(text) > MAX_LEN:
        return None
    try:
        text = _TRIG_POWER_RE.sub(r"(\\\1(\3))^{\2}", text)  # \sin^2 x → (\sin(x))^{2}
        text = re.sub(r"\\[lr]vert|\\[lr]Vert|\\mid", "|", text)
        text = _ABS_RE.sub(r"\\abs{\1}", text)
        tokens = _tokenize(_latex_to_plain(text))
        parser = _Parser(tokens)
        expr = parser.expr()
        if parser.pos != len(tokens):
            return None
        return expr
    except (_Refuse, RecursionError):
        return None
    except (TypeError, ValueError, ZeroDivisionError, OverflowError, AttributeError, sympy.SympifyError):
        return None


def _braced(s: str, i: int) -> tuple[str, int]:
    """The contents of the ``{...}`` group starting at ``s[i]`` and the index after it."""
    if i >= len(s) or s[i] != "{":
        raise _Refuse("expected '{'")
    depth = 0
    for j in range(i, len(s)):
        depth += {"{": 1, "}": -1}.get(s[j], 0)
        if depth == 0:
            return s[i + 1 : j], j + 1
    raise _Refuse("unbalanced braces")


def _latex_to_plain(s: str) -> str:
    out, i = [], 0
    while i < len(s):
        if s.startswith("\\frac", i):
            num, i = _braced(s, i + 5)
            den, i = _braced(s, i)
            out.append(f"(({_latex_to_plain(num)})/({_latex_to_plain(den)}))")
        elif s.startswith("\\sqrt", i):
            i += 5
            if i < len(s) and s[i] == "[":
                end = s.find("]", i)
                if end < 0:
                    raise _Refuse("unbalanced [")
                index = _latex_to_plain(s[i + 1 : end])
                arg, i = _braced(s, end + 1)
                out.append(f"(({_latex_to_plain(arg)})^(1/({index})))")
            else:
                arg, i = _braced(s, i)
                out.append(f"sqrt({_latex_to_plain(arg)})")
        elif s.startswith("\\binom", i):
            n, i = _braced(s, i + 6)
            k, i = _braced(s, i)
            if not (n.isdigit() and k.isdigit() and int(n) <= 10_000):
                raise _Refuse("binomial of non-constant or huge arguments")
            out.append(str(math.comb(int(n), int(k))))
        elif s[i] == "\\":
            m = re.match(r"\\([a-zA-Z]+)", s[i:])
            if m and m.group(1) not in _FUNCS and m.group(1) not in _CONSTS and m.group(1) != "div":
                # "\pir^2" (spaces removed by normalize): take the longest known command prefix
                known = next(
                    (
                        w
                        for w in sorted([*_FUNCS, *_CONSTS], key=len, reverse=True)
                        if m.group(1).startswith(w) and len(w) > 1
                    ),
                    None,
                )
                if known:
                    out.append(f" {known} ")
                    i += 1 + len(known)
                    continue
            if not m or (m.group(1) not in _FUNCS and m.group(1) not in _CONSTS and m.group(1) != "div"):
                raise _Refuse(f"unsupported command at {s[i : i + 12]!r}")
            out.append(" / " if m.group(1) == "div" else f" {m.group(1)} ")
            i += len(m.group(0))
        elif s[i] in "{}":
            out.append("(" if s[i] == "{" else ")")
            i += 1
        else:
            out.append(s[i])
            i += 1
    return "".join(out)


def _tokenize(s: str) -> list[tuple[str, str]]:
    """Tokens as ``(kind, text)``: NUM, SYM, CONST, FUNC or OP, with implicit ``*`` made explicit."""
    raw: list[tuple[str, str]] = []
    pos = 0
    s = s.rstrip()
    while pos < len(s):
        m = _TOKEN_RE.match(s, pos)
        if not m:
            raise _Refuse(f"unexpected character {s[pos]!r}")
        pos = m.end()
        num, name, op = m.groups()
        if num:
            raw.append(("NUM", num))
        elif op:
            raw.append(("OP", "**" if op == "^" else op))
        else:
            raw.extend(_split_name(name))
    tokens: list[tuple[str, str]] = []
    for tok in raw:
        if tokens:
            prev = tokens[-1]
            left = prev[0] in ("NUM", "SYM", "CONST") or prev[1] in (")", "!")
            right = tok[0] in ("NUM", "SYM", "CONST", "FUNC") or tok[1] == "("
            if left and right:
                tokens.append(("OP", "*"))
        tokens.append(tok)
    return tokens


def _split_name(name: str) -> list[tuple[str, str]]:
    out, i = [], 0
    while i < len(name):
        word = next((w for w in _MULTI if name.startswith(w, i)), None)
        if word is not None:
            out.append(("FUNC" if word in _FUNCS else "CONST", word))
            i += len(word)
        else:
            ch = name[i]
            out.append(("CONST", ch) if ch == "e" else ("SYM", ch))
            i += 1
    return out


class _Parser:
    """expr := term (± term)*; term := unary (*|/ unary)*; unary := ± unary | power;
    power := postfix (** unary)?; postfix := atom !*; atom := NUM | SYM | CONST | FUNC atom | ( expr )"""

    def __init__(self, tokens: list[tuple[str, str]]):
        self.tokens, self.pos = tokens, 0

    def _peek(self) -> tuple[str, str] | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def _take(self, text: str | None = None) -> tuple[str, str]:
        tok = self._peek()
        if tok is None or (text is not None and tok[1] != text):
            raise _Refuse(f"expected {text or 'a token'} at {self.pos}")
        self.pos += 1
        return tok

    def expr(self) -> sympy.Expr:
        value = self.term()
        while (tok := self._peek()) and tok[1] in ("+", "-"):
            self._take()
            rhs = self.term()
            value = value + rhs if tok[1] == "+" else value - rhs
        return value

    def term(self) -> sympy.Expr:
        value = self.unary()
        while (tok := self._peek()) and tok[1] in ("*", "/"):
            self._take()
            rhs = self.unary()
            if tok[1] == "/" and rhs == 0:
                raise _Refuse("division by zero")
            value = value * rhs if tok[1] == "*" else value / rhs
        return value

    def unary(self) -> sympy.Expr:
        tok = self._peek()
        if tok and tok[1] in ("+", "-"):
            self._take()
            value = self.unary()
            return -value if tok[1] == "-" else value
        return self.power()

    def power(self) -> sympy.Expr:
        base = self.postfix()
        if (tok := self._peek()) and tok[1] == "**":
            self._take()
            return _checked_pow(base, self.unary())
        return base

    def postfix(self) -> sympy.Expr:
        value = self.atom()
        while (tok := self._peek()) and tok[1] == "!":
            self._take()
            if not (value.is_Integer and 0 <= int(value) <= MAX_FACTORIAL):
                raise _Refuse("factorial of a non-integer or too large value")
            value = sympy.factorial(value)
        return value

    def atom(self) -> sympy.Expr:
        kind, text = self._take()
        if kind == "NUM":
            return sympy.Rational(text) if "." in text else sympy.Integer(text)
        if kind == "SYM":
            return sympy.Symbol(text, real=True)  # competition answers live in the reals
        if kind == "CONST":
            return _CONSTS[text]
        if kind == "FUNC":
            arg = self.postfix() if self._peek() != ("OP", "(") else self.atom()
            limit = MAX_SQRT_ARG if text == "sqrt" else MAX_FUNC_ARG
            if not arg.free_symbols and arg.is_number and abs(complex(sympy.N(arg, 15))) > limit:
                raise _Refuse("function argument too large")
            return _FUNCS[text](arg)
        if text == "(":
            value = self.expr()
            self._take(")")
            return value
        raise _Refuse(f"unexpected {text!r}")


def _checked_pow(base: sympy.Expr, exp: sympy.Expr) -> sympy.Expr:
    if exp.free_symbols:
        return sympy.Pow(base, exp)
    e = complex(sympy.N(exp, 15))
    if abs(e) > (MAX_SYMBOLIC_EXPONENT if base.free_symbols else MAX_EXPONENT):
        raise _Refuse("exponent too large")
    if not base.free_symbols and base.is_number:
        b = abs(complex(sympy.N(base, 15)))
        if b > 1 and abs(e) * math.log10(b) > MAX_DIGITS:
            raise _Refuse("power too large")
    return sympy.Pow(base, exp)
