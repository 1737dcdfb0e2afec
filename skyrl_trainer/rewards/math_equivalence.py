"""Equivalence of competition-math answers without math_verify: normalised strings, numbers, sympy.

LaTeX is converted to sympy by a small converter of our own (fractions, roots, powers, products,
common functions and constants), because sympy's own LaTeX parser needs an exact antlr4 runtime.
Anything outside that subset is compared as a normalised string only. sympy never `eval`s model
text as such: the converter emits only a whitelisted vocabulary, parsed with no builtins.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

from skyrl_trainer.rewards.math_answers import numbers_equal, parse_number
from skyrl_trainer.rewards.timeouts import call_with_timeout

# Bounds that keep one symbolic check cheap enough for its timeout to work: sympy arithmetic on
# a huge integer power (10^{10^{10}}) is one C call that holds the GIL, which no timeout stops.
_MAX_SYMBOLIC_CHARS = 300
_MAX_EXPONENT = 100
_MAX_INTEGER = 10**40
_MAX_ITEMS = 20

_FUNCTIONS = {
    "sin": "sin",
    "cos": "cos",
    "tan": "tan",
    "sec": "sec",
    "csc": "csc",
    "cot": "cot",
    "arcsin": "asin",
    "arccos": "acos",
    "arctan": "atan",
    "sinh": "sinh",
    "cosh": "cosh",
    "tanh": "tanh",
    "log": "log",
    "ln": "log",
    "exp": "exp",
    "sqrt": "sqrt",
}
_GREEK = frozenset(
    ["alpha", "beta", "gamma", "delta", "epsilon", "varepsilon", "zeta", "eta", "theta"]
    + ["vartheta", "iota", "kappa", "lambda", "mu", "nu", "xi", "rho", "sigma", "tau"]
    + ["upsilon", "phi", "varphi", "chi", "psi", "omega"]
)
_OPERATORS = {"cdot": "*", "times": "*", "div": "/", "pi": " pi ", "infty": " oo "}

_MATH_DELIMITERS = (("\\(", "\\)"), ("\\[", "\\]"))  # "$" goes with all other "$"
_LEFT_RIGHT_RE = re.compile(r"\\(?:left|right)(?![a-zA-Z])")
_SPACING_RE = re.compile(r"\\[!,;: ]|\\q?quad(?![a-zA-Z])|~|\\displaystyle(?![a-zA-Z])")
_DEGREES_RE = re.compile(r"\^\s*(?:\{\s*)?\\circ(?:\s*\})?|°|\\degrees?(?![a-zA-Z])")
_UNIT_TAIL_RE = re.compile(r"\\(?:text|mbox|mathrm)\s*\{\s*[A-Za-z][A-Za-z\s.]*\}(?:\^\{?\d\}?)?")
_TEXT_WRAPPER_RE = re.compile(
    r"\\(?:text|textbf|textit|textrm|mbox|mathrm|mathbf|operatorname)\s*\{([^{}]*)\}"
)
_SQRT_SHORT_RE = re.compile(r"\\sqrt\s*([0-9a-zA-Z])")
_FRAC_SHORT_RE = re.compile(r"\\frac\s*([0-9a-zA-Z])\s*([0-9a-zA-Z])")
_FRAC_SHORT_DEN_RE = re.compile(r"\\frac\s*\{([^{}]*)\}\s*([0-9a-zA-Z])")
_FRAC_SHORT_NUM_RE = re.compile(r"\\frac\s*([0-9a-zA-Z])\s*\{")
_COMMAND_SPACE_RE = re.compile(r"(\\[a-zA-Z]+)\s+(?=[a-zA-Z])")
_WHITESPACE_RE = re.compile(r"\s+")
_LEADING_DOT_RE = re.compile(r"(?<![\d}])\.(\d)")
_VARIABLE_RE = re.compile(r"[a-zA-Z]|\\[a-zA-Z]+")
_THOUSANDS_RE = re.compile(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_CHOICE_RE = re.compile(r"\(([A-Za-z])\)")
_COMMAND_RE = re.compile(r"\\([a-zA-Z]+)")
_LETTERS_RE = re.compile(r"[a-zA-Z]+")
# After normalisation, the only characters the converter reads.
_CONVERTIBLE_RE = re.compile(r"[0-9a-zA-Z+\-*/^().{}\[\]\\ ]*")
_SPACE_MARK = "\x00"


def normalize_math_answer(text: str) -> str:
    """`text` in a canonical spelling, so that equal answers written differently compare equal.

    Drops `$...$` / `\\(...\\)` wrappers, spaces, `\\left`/`\\right`, spacing commands,
    `\\displaystyle`, degree marks, `%`, `$`, a trailing unit in `\\text{...}`/`\\mbox{...}`/
    `\\mathrm{...}` (`5 \\text{ cm}^2` -> `5`), a trailing `.`, thousands commas of a plain
    number, and a short left-hand side (`x = 5` -> `5`); unwraps other `\\text{...}`; writes
    `\\dfrac`/`\\tfrac` as `\\frac`, `\\frac12` as `\\frac{1}{2}`, `\\sqrt2` as `\\sqrt{2}`, `.5` as
    `0.5`, and `(C)` as `C`.
    """
    s = text.strip()
    for left, right in _MATH_DELIMITERS:
        if s.startswith(left) and s.endswith(right) and len(s) >= 4:
            s = s[2:-2]
            break
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("{,}", ",")
    s = _LEFT_RIGHT_RE.sub("", s)
    s = _SPACING_RE.sub(" ", s)
    s = _DEGREES_RE.sub("", s)
    for mark in ("\\%", "%", "\\$", "$"):
        s = s.replace(mark, "")
    s = _strip_unit_tail(s.strip())
    for _ in range(3):  # nested \text{\textbf{...}}
        s = _TEXT_WRAPPER_RE.sub(r"\1", s)
    s = _SQRT_SHORT_RE.sub(r"\\sqrt{\1}", s)
    s = _FRAC_SHORT_RE.sub(r"\\frac{\1}{\2}", s)
    s = _FRAC_SHORT_DEN_RE.sub(r"\\frac{\1}{\2}", s)
    s = _FRAC_SHORT_NUM_RE.sub(r"\\frac{\1}{", s)
    # A space ends a command name ("\sin x"), so keep one there and drop all others.
    s = _COMMAND_SPACE_RE.sub(r"\1" + _SPACE_MARK, s)
    s = _WHITESPACE_RE.sub("", s).replace(_SPACE_MARK, " ")
    s = _LEADING_DOT_RE.sub(r"0.\1", s)
    s = s.rstrip(".")
    if s.count("=") == 1:
        lhs, rhs = s.split("=")
        if _VARIABLE_RE.fullmatch(lhs):
            s = rhs
    if _THOUSANDS_RE.fullmatch(s):
        s = s.replace(",", "")
    choice = _CHOICE_RE.fullmatch(s)
    if choice is not None:
        s = choice.group(1)
    return s


def math_answers_equivalent(pred: str, gold: str, *, timeout_s: float = 3.0) -> bool:
    """True when answer `pred` equals answer `gold` (LaTeX, no `\\boxed`), else False.

    Equal after `normalize_math_answer`, or both numbers (`parse_number`, strictly) within
    1e-6, or equal as sympy expressions (constants compared numerically within 1e-6, others by
    `simplify(a - b) == 0`). Tuples and intervals compare item by item in order, sets `\\{...\\}`
    and bare comma lists in any order. Symbolic work is bounded by `timeout_s` (timing out
    counts as not equal) and skipped for answers over 300 characters or with huge powers.
    Never raises.
    """
    p, g = normalize_math_answer(pred), normalize_math_answer(gold)
    if not p or not g:
        return False
    if p == g:
        return True
    p_number, g_number = parse_number(p, strict=True), parse_number(g, strict=True)
    if p_number is not None and g_number is not None:
        return numbers_equal(p_number, g_number)
    if len(p) > _MAX_SYMBOLIC_CHARS or len(g) > _MAX_SYMBOLIC_CHARS:
        return False
    try:
        tools = _sympy_tools()  # import outside the timed call: the first import takes ~0.5 s
    except ImportError:
        return False
    try:
        return call_with_timeout(lambda: _equivalent(p, g, tools), timeout_s)
    except Exception:  # CallTimedOut, or sympy failing on an odd input
        return False


def _equivalent(p: str, g: str, tools: _SympyTools) -> bool:
    if p == g:
        return True
    p_items, g_items = _split_items(p), _split_items(g)
    if p_items is not None or g_items is not None:
        if p_items is None or g_items is None:
            return False
        (p_kind, p_list), (g_kind, g_list) = p_items, g_items
        if p_kind != g_kind or len(p_list) != len(g_list):
            return False
        if p_kind in ("set", "list"):
            return _match_unordered(p_list, g_list, lambda a, b: _equivalent(a, b, tools))
        return all(_equivalent(a, b, tools) for a, b in zip(p_list, g_list))
    p_number, g_number = parse_number(p, strict=True), parse_number(g, strict=True)
    if p_number is not None and g_number is not None:
        return numbers_equal(p_number, g_number)
    a, b = tools.parse(p), tools.parse(g)
    if a is None or b is None:
        return False
    return tools.equal(a, b)


def _strip_unit_tail(s: str) -> str:
    start = max(s.rfind("\\text"), s.rfind("\\mbox"), s.rfind("\\mathrm"))
    if start > 0 and s[:start].strip() and _UNIT_TAIL_RE.fullmatch(s, start):
        return s[:start].strip()
    return s


def _split_items(s: str) -> tuple[str, list[str]] | None:
    """(kind, items) for a tuple/interval "(a,b]", a set "\\{a,b\\}" or a bare list "a,b"."""
    if s.startswith("\\{") and s.endswith("\\}"):
        kind, inner = "set", s[2:-2]
    elif len(s) >= 2 and s[0] in "([" and s[-1] in ")]" and _balanced(s[1:-1]):
        kind, inner = s[0] + s[-1], s[1:-1]
    else:
        kind, inner = "list", s
    items, depth, start = [], 0, 0
    for i, c in enumerate(inner):
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == "," and depth == 0:
            items.append(inner[start:i])
            start = i + 1
    items.append(inner[start:])
    if len(items) > _MAX_ITEMS or (kind in ("()", "list") and len(items) == 1):
        return None  # "(x+1)" is an expression, not a 1-tuple
    return kind, items


def _balanced(s: str) -> bool:
    depth = 0
    for c in s:
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth < 0:
                return False
    return depth == 0


def _match_unordered(a: list[str], b: list[str], equal: Callable[[str, str], bool]) -> bool:
    unused = list(b)
    for item in a:
        match = next((i for i, other in enumerate(unused) if equal(item, other)), None)
        if match is None:
            return False
        unused.pop(match)
    return True


class _Unsupported(Exception):
    """The LaTeX uses something outside the converter's subset."""


def latex_to_sympy_source(s: str) -> str | None:
    """A sympy-parsable expression for a normalised LaTeX answer, or None outside the subset.

    The subset: numbers, single-letter variables, Greek letters, `+ - * /`, `\\cdot`, `\\times`,
    `\\div`, `\\frac{}{}`, `\\sqrt{}`, `\\sqrt[n]{}`, `^`, `\\pi`, `\\infty`, `\\sin`-style
    functions, parentheses and braces. Letters written together are a product (`xy` -> `x*y`).
    """
    if not _CONVERTIBLE_RE.fullmatch(s):
        return None
    try:
        source, end = _convert(s, 0, stop=None)
    except (_Unsupported, IndexError):
        return None
    if end != len(s) or "()" in source.replace(" ", ""):
        return None  # "()" would parse as an empty tuple, not an expression
    return source


def _convert(s: str, i: int, stop: str | None) -> tuple[str, int]:
    """Convert from `s[i]` up to the closing `stop` brace (or the end); return (source, end)."""
    out: list[str] = []
    while i < len(s):
        c = s[i]
        if c == stop:
            return "".join(out), i
        if c == "\\":
            text, i = _convert_command(s, i)
            out.append(text)
        elif c == "{":
            inner, i = _convert(s, i + 1, stop="}")
            out.append(f"({inner})")
            i += 1
        elif c in "}[]":
            raise _Unsupported(c)
        elif c == "^":
            arg, i = _argument(s, i + 1)
            out.append(f"**({arg})")
        elif c.isalpha():
            letters = _LETTERS_RE.match(s, i).group()
            i += len(letters)
            if letters in _FUNCTIONS and s.startswith("(", i):
                out.append(f" {_FUNCTIONS[letters]}")
            else:
                out.append(" " + " ".join(letters) + " ")
        elif c == " ":
            i += 1
        else:
            out.append(c)
            i += 1
    if stop is not None:
        raise _Unsupported("unclosed {")
    return "".join(out), i


def _convert_command(s: str, i: int) -> tuple[str, int]:
    match = _COMMAND_RE.match(s, i)
    if match is None:
        raise _Unsupported(s[i : i + 2])
    name, i = match.group(1), match.end()
    if s.startswith(" ", i):
        i += 1
    if name == "frac":
        numerator, i = _argument(s, i)
        denominator, i = _argument(s, i)
        return f"(({numerator})/({denominator}))", i
    if name == "sqrt":
        if s.startswith("[", i):
            close = s.index("]", i)
            index, _ = _convert(s[i + 1 : close], 0, stop=None)
            radicand, i = _argument(s, close + 1)
            return f"(({radicand})**(1/({index})))", i
        radicand, i = _argument(s, i)
        return f"sqrt({radicand})", i
    if name in _OPERATORS:
        return _OPERATORS[name], i
    if name in _GREEK:
        return f" {name}_ ", i  # "_": "lambda" is a Python keyword
    if name in _FUNCTIONS:
        if s.startswith("(", i):
            return f" {_FUNCTIONS[name]}", i
        arg, i = _argument(s, i)
        return f" {_FUNCTIONS[name]}({arg})", i
    raise _Unsupported(f"\\{name}")


def _argument(s: str, i: int) -> tuple[str, int]:
    """One TeX argument: a `{...}` group, a command, or a single character (`\\frac12`, `x^2`)."""
    c = s[i]
    if c == "{":
        inner, end = _convert(s, i + 1, stop="}")
        return f"({inner})", end + 1
    if c == "\\":
        text, end = _convert_command(s, i)
        return f"({text})", end
    if c.isalnum():
        return (f" {c} " if c.isalpha() else c), i + 1
    raise _Unsupported(f"argument {c!r}")


class _SympyTools:
    """sympy, imported once, with the restricted namespace our parser uses."""

    def __init__(self) -> None:
        import sympy
        from sympy.parsing.sympy_parser import (
            implicit_multiplication,
            parse_expr,
            standard_transformations,
        )

        self.sympy = sympy
        self._parse_expr = parse_expr
        self._transformations = (*standard_transformations, implicit_multiplication)
        self._globals: dict[str, Any] = {"__builtins__": {}}
        for name in ("Integer", "Float", "Rational", "Symbol", "Add", "Mul", "Pow"):
            self._globals[name] = getattr(sympy, name)
        letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
        self._locals: dict[str, Any] = {c: sympy.Symbol(c) for c in letters}
        self._locals.update({f"{name}_": sympy.Symbol(name) for name in _GREEK})
        self._locals.update({name: getattr(sympy, name) for name in set(_FUNCTIONS.values())})
        self._locals.update(pi=sympy.pi, oo=sympy.oo)

    def parse(self, latex: str) -> Any:
        source = latex_to_sympy_source(latex)
        if source is None:
            return None
        try:
            expr = self._parse_expr(
                source,
                local_dict=dict(self._locals),
                global_dict=dict(self._globals),
                transformations=self._transformations,
                evaluate=False,
            )
        except Exception:
            return None
        if not isinstance(expr, self.sympy.Basic) or not self._within_limits(expr):
            return None
        return expr

    def _within_limits(self, expr: Any) -> bool:
        # Children first, so every exponent evaluated here is itself known to be small.
        if not all(self._within_limits(arg) for arg in expr.args):
            return False
        if expr.is_Integer:
            return abs(int(expr)) < _MAX_INTEGER
        if expr.is_Pow and not expr.exp.free_symbols:
            try:
                return abs(complex(expr.exp.evalf(15))) <= _MAX_EXPONENT
            except (TypeError, ValueError):
                return False
        return True

    def equal(self, a: Any, b: Any) -> bool:
        if not a.free_symbols and not b.free_symbols:
            va, vb = complex(a.evalf(30)), complex(b.evalf(30))
            return numbers_equal(va.real, vb.real) and numbers_equal(va.imag, vb.imag)
        return bool(self.sympy.simplify(a - b) == 0)


@functools.cache
def _sympy_tools() -> _SympyTools:
    return _SympyTools()
