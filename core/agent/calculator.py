"""The built-in ``calculator`` tool: arithmetic through a parser of its own, never ``eval`` or
``exec``.

Grammar (Python's precedence: ``-2 ** 2`` is -4, ``2 ** -1`` is 0.5, ``**`` groups right)::

    expr  := term (('+' | '-') term)*
    term  := unary (('*' | '/' | '//' | '%') unary)*
    unary := ('+' | '-') unary | power
    power := atom ('**' unary)?
    atom  := number | '(' expr ')'

Numbers are decimals (``3``, ``3.25``, ``.5``, ``1e3``); the arithmetic is exact (fractions), so
a result never depends on the machine: ``0.1 + 0.2`` is ``0.3``. A whole result is written as an
integer, any other rounded to 12 decimals with trailing zeros dropped. What it cannot do (a
division by zero, a power that is not whole or too large, an expression too long or too deep)
raises ``CalculatorError`` with a short reason the model is shown.
"""

from __future__ import annotations

import re
from fractions import Fraction

MAX_CHARS = 512  # longer input is refused before it is read
MAX_DEPTH = 64  # nested parentheses and signs: no RecursionError from a hostile input
MAX_EXPONENT = 1024
MAX_BITS = 4096  # of a numerator or denominator: 10 ** 10 ** 10 is refused, not computed
DECIMALS = 12

_TOKEN = re.compile(r"\s*(?:(\d+\.?\d*(?:[eE][+-]?\d+)?|\.\d+(?:[eE][+-]?\d+)?)|(\*\*|//|[-+*/%()]))")


class CalculatorError(ValueError):
    """An expression the calculator cannot evaluate; the message says why, in a few words."""


def calculate(expression: str) -> str:
    """The value of ``expression``, as text."""
    if not isinstance(expression, str):
        raise CalculatorError(f"expression must be text, not {type(expression).__name__}")
    if len(expression) > MAX_CHARS:
        raise CalculatorError(f"expression longer than {MAX_CHARS} characters")
    value = _Parser(_tokens(expression)).parse()
    return render(value)


def render(value: Fraction) -> str:
    """A whole value as an integer; any other rounded to ``DECIMALS`` places, zeros dropped."""
    if value.denominator == 1:
        return str(value.numerator)
    scaled = round(value * 10**DECIMALS)
    sign = "-" if scaled < 0 else ""
    whole, frac = divmod(abs(scaled), 10**DECIMALS)
    frac_text = f"{frac:0{DECIMALS}d}".rstrip("0")
    return f"{sign}{whole}.{frac_text}" if frac_text else f"{sign}{whole}"


def _tokens(text: str) -> list[str]:
    out, pos = [], 0
    text = text.rstrip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None or m.end() == pos:
            raise CalculatorError(f"unexpected {text[pos:].lstrip()[:10]!r}")
        out.append(m.group(1) or m.group(2))
        pos = m.end()
    if not out:
        raise CalculatorError("empty expression")
    return out


class _Parser:
    def __init__(self, tokens: list[str]) -> None:
        self.tokens = tokens
        self.i = 0
        self.depth = 0

    def parse(self) -> Fraction:
        value = self.expr()
        if self.i < len(self.tokens):
            raise CalculatorError(f"unexpected {self.tokens[self.i]!r}")
        return value

    def _peek(self) -> str | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def _next(self) -> str:
        tok = self._peek()
        if tok is None:
            raise CalculatorError("expression ends too soon")
        self.i += 1
        return tok

    def _deeper(self) -> None:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise CalculatorError(f"nested deeper than {MAX_DEPTH}")

    def expr(self) -> Fraction:
        value = self.term()
        while self._peek() in ("+", "-"):
            value = value + self.term() if self._next() == "+" else value - self.term()
            _check_size(value)
        return value

    def term(self) -> Fraction:
        value = self.unary()
        while self._peek() in ("*", "/", "//", "%"):
            op, rhs = self._next(), self.unary()
            if op == "*":
                value = value * rhs
            elif rhs == 0:
                raise CalculatorError("division by zero")
            elif op == "/":
                value = value / rhs
            elif op == "//":
                value = Fraction(value // rhs)
            else:
                value = value - rhs * (value // rhs)  # Python's %: the sign of the divisor
            _check_size(value)
        return value

    def unary(self) -> Fraction:
        if self._peek() in ("+", "-"):
            self._deeper()
            sign = self._next()
            value = self.unary()
            self.depth -= 1
            return -value if sign == "-" else value
        return self.power()

    def power(self) -> Fraction:
        base = self.atom()
        if self._peek() != "**":
            return base
        self._next()
        self._deeper()
        exponent = self.unary()
        self.depth -= 1
        if exponent.denominator != 1:
            raise CalculatorError("only whole powers")
        if abs(exponent) > MAX_EXPONENT:
            raise CalculatorError(f"power larger than {MAX_EXPONENT}")
        if base == 0 and exponent < 0:
            raise CalculatorError("division by zero")
        # The result's size is known before it is computed: refuse what would not fit.
        bits = max(abs(base.numerator).bit_length(), base.denominator.bit_length()) * abs(int(exponent))
        if bits > MAX_BITS:
            raise CalculatorError("result too large")
        return base ** int(exponent)

    def atom(self) -> Fraction:
        tok = self._next()
        if tok == "(":
            self._deeper()
            value = self.expr()
            if self._peek() != ")":
                raise CalculatorError("unbalanced parentheses")
            self._next()
            self.depth -= 1
            return value
        if tok[0].isdigit() or tok[0] == ".":
            return _number(tok)
        raise CalculatorError(f"unexpected {tok!r}")


def _number(text: str) -> Fraction:
    mantissa, _, exp = text.lower().partition("e")
    if exp and abs(int(exp)) > MAX_EXPONENT:
        raise CalculatorError(f"exponent larger than {MAX_EXPONENT}")
    value = Fraction(mantissa) * Fraction(10) ** int(exp or 0)
    _check_size(value)
    return value


def _check_size(value: Fraction) -> None:
    if max(abs(value.numerator).bit_length(), value.denominator.bit_length()) > MAX_BITS:
        raise CalculatorError("result too large")
