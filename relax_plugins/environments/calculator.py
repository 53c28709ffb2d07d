"""``calculator``: one tool, ``calc``, that evaluates an arithmetic expression for the model.

The tool of the built-in agent task (``synthetic:products``, ``presets/tiny-agent-cpu.yaml``): the
model writes ``<tool_call>{"name":"calc","arguments":{"expr":"347*58"}}</tool_call>``, reads
``20126`` back and answers with it. A turn without a tool call is the model's answer and ends the
trajectory.

The expression is never given to ``eval``: it is parsed with ``ast`` and only numbers (integers
and decimals), ``+ - * / **``, unary signs and parentheses are evaluated, exactly (fractions), with
bounds on the expression's length, the exponent and the result's size. Anything else (a name, a
call, ``__import__``, a huge power, a division by zero) comes back to the model as an ``error: ...``
observation, never as an exception.
"""

from __future__ import annotations

import ast
import math
from decimal import Decimal, localcontext
from fractions import Fraction
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from relax.contracts import ToolSpec
from relax_plugins.environments.tools import ToolEnvironment, ToolError

_OPERATORS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.Pow: "**"}


class CalculatorEnvironment(ToolEnvironment):
    """The ``calc`` tool. Pure and stateless: safe to call from many trajectories at once."""

    class Config(BaseModel):
        """Options of the calculator environment."""

        model_config = ConfigDict(extra="forbid")

        max_expression_chars: int = Field(200, ge=1, le=10_000)
        """Longest expression evaluated; a longer one is an error observation."""
        max_exponent: int = Field(64, ge=0, le=10_000)
        """Largest absolute exponent of ``**`` (an integer); ``0`` turns powers off."""
        max_result_digits: int = Field(64, ge=1, le=4_000)
        """Digits of the integer part any intermediate or final value may have."""
        decimals: int = Field(6, ge=0, le=50)
        """Decimal places a non-integer result is rounded to (trailing zeros dropped)."""
        max_calls_per_turn: int = Field(4, ge=1)
        """Tool calls served per turn; further calls in the same turn get an error line."""

    def __init__(self, config: CalculatorEnvironment.Config) -> None:
        self.config = config
        self.max_calls_per_turn = config.max_calls_per_turn

    def tools(self) -> list[ToolSpec]:
        return [ToolSpec(
            name="calc",
            description="Evaluate an arithmetic expression with + - * / ** and parentheses.",
            parameters={"type": "object",
                        "properties": {"expr": {"type": "string", "description": "The expression, e.g. 347*58"}},
                        "required": ["expr"], "additionalProperties": False},
        )]

    def tool_calc(self, state: dict[str, Any], expr: str) -> str:
        return self.evaluate(expr)

    def evaluate(self, expr: str) -> str:
        """The value of ``expr`` as text (an integer, or a decimal rounded to ``decimals`` places);
        ``ToolError`` saying what is wrong otherwise."""
        if not isinstance(expr, str):
            raise ToolError(f"expr must be a string, got {type(expr).__name__}")
        text = expr.strip()
        if not text:
            raise ToolError("the expression is empty")
        if len(text) > self.config.max_expression_chars:
            raise ToolError(f"the expression has {len(text)} characters, more than "
                            f"{self.config.max_expression_chars}")
        try:
            tree = ast.parse(text, mode="eval")
        except (SyntaxError, ValueError, MemoryError, RecursionError):
            raise ToolError(f"cannot parse {text!r}; write numbers with + - * / ** and parentheses") from None
        try:
            value = self._value(tree.body)
        except RecursionError:
            raise ToolError("the expression is nested too deeply") from None
        return self._format(value)

    def _value(self, node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant):
            if isinstance(node.value, bool) or not isinstance(node.value, int | float):
                raise ToolError(f"{node.value!r} is not a number")
            if isinstance(node.value, float) and not math.isfinite(node.value):
                raise ToolError("the number is too large")
            return self._bounded(Fraction(repr(node.value)) if isinstance(node.value, float) else Fraction(node.value))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.UAdd | ast.USub):
            operand = self._value(node.operand)
            return -operand if isinstance(node.op, ast.USub) else operand
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            left, right = self._value(node.left), self._value(node.right)
            if isinstance(node.op, ast.Add):
                return self._bounded(left + right)
            if isinstance(node.op, ast.Sub):
                return self._bounded(left - right)
            if isinstance(node.op, ast.Mult):
                return self._bounded(left * right)
            if isinstance(node.op, ast.Div):
                if right == 0:
                    raise ToolError("division by zero")
                return self._bounded(left / right)
            return self._power(left, right)
        op = getattr(node, "op", None)
        what = f"the operator {type(op).__name__}" if op is not None else type(node).__name__
        raise ToolError(f"{what} is not allowed; only numbers, + - * / ** and parentheses are")

    def _power(self, base: Fraction, exponent: Fraction) -> Fraction:
        if exponent.denominator != 1:
            raise ToolError("the exponent of ** must be a whole number")
        if abs(exponent) > self.config.max_exponent:
            raise ToolError(f"the exponent {exponent} is larger than {self.config.max_exponent}")
        if base == 0 and exponent < 0:
            raise ToolError("division by zero (0 to a negative power)")
        # The result's size before computing it: digits(base) * exponent, bounded.
        magnitude = max(abs(base.numerator), abs(base.denominator))
        if magnitude > 1 and math.log10(magnitude) * abs(int(exponent)) > self.config.max_result_digits + 1:
            raise ToolError(f"the result has more than {self.config.max_result_digits} digits")
        return self._bounded(base ** int(exponent))

    def _bounded(self, value: Fraction) -> Fraction:
        limit = self.config.max_result_digits
        for part in (value.numerator, value.denominator):
            if abs(part) >= 10 ** (2 * limit):  # exact fractions must stay small too
                raise ToolError(f"a value has more than {limit} digits")
        if abs(value) >= 10 ** limit:
            raise ToolError(f"a value has more than {limit} digits")
        return value

    def _format(self, value: Fraction) -> str:
        if value.denominator == 1:
            return str(value.numerator)
        with localcontext() as context:
            context.prec = 3 * self.config.max_result_digits + self.config.decimals + 10
            rounded = (Decimal(value.numerator) / Decimal(value.denominator)).quantize(
                Decimal(1).scaleb(-self.config.decimals))
            text = format(rounded, "f")
        if "." in text:
            text = text.rstrip("0").rstrip(".")
        return "0" if text in ("-0", "") else text
