"""A completion's working, read: every checkable "lhs = rhs" it writes (`steps`) and what they make of a correct
answer (`classify`): *valid* (at least one checkable step, all right), *lucky* (a wrong step) or *no working*. Used
by the premise check (bench/premise_check.py, docs/premise-check.md) and by study reports, which classify the paid
completions a run logged (arithmetic tasks such as reasoning-gym's chain_sum)."""

from __future__ import annotations

import ast
import math
import re


_LATEX = {r"\times": "*", r"\cdot": "*", r"\div": "/", r"\left": "", r"\right": "", "−": "-", "–": "-"}
#: a stretch of arithmetic on one line: numbers, operators, parentheses, "=", spaces (a word or ":" ends it)
_RUN = re.compile(r"[0-9.+\-*/×x÷()= \t]+")
_TOKEN = re.compile(r"\d+(?:\.\d+)?|[-+*/×x÷()]|\.")
_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
        ast.Div: lambda a, b: a / b}


def _value(node) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return float(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _value(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_value(node.left), _value(node.right))
    raise ValueError("not arithmetic")


def _evaluate(tokens: list[str]) -> tuple[float, bool] | None:
    """(value, has a binary operator) of a token list, or None when it is not one arithmetic expression."""
    text = " ".join("*" if t in "×x" else "/" if t == "÷" else t for t in tokens)
    if not text or "." in tokens:
        return None
    try:
        tree = ast.parse(text, mode="eval").body
        value = _value(tree)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError):
        return None
    has_op = any(isinstance(n, ast.BinOp) for n in ast.walk(tree))
    return value, has_op


def _longest(tokens: list[str], suffix: bool) -> tuple[float, bool] | None:
    """The longest suffix (left of an "=") or prefix (right of one) of `tokens` that is an expression."""
    for cut in range(len(tokens)):
        part = tokens[cut:] if suffix else tokens[:len(tokens) - cut]
        got = _evaluate(part)
        if got is not None:
            return got
    return None


def steps(text: str) -> list[dict]:
    """Every checkable "lhs = rhs" in `text`: both sides arithmetic, at least one with an operator.

    A chain "a + b = c + d = e" gives two steps. The left side is the longest arithmetic suffix before the "=",
    the right side the longest prefix after it, so list numbers ("2. 3 + 4 = 7"), a leading word or an opening
    parenthesis do not spoil a step. "x" and "×" between numbers multiply; LaTeX \\times, \\cdot, \\div are read.
    Each step: {"lhs", "rhs" (values), "text", "ok" (equal within 1e-6 relative)}.
    """
    for latex, plain in _LATEX.items():
        text = text.replace(latex, plain)
    found = []
    for line in text.splitlines():
        for run in _RUN.finditer(line):
            parts = run.group().split("=")
            if len(parts) < 2:
                continue
            tokens = [_TOKEN.findall(p) for p in parts]
            for i in range(len(parts) - 1):
                left, right = _longest(tokens[i], suffix=True), _longest(tokens[i + 1], suffix=False)
                if left is None or right is None or not (left[1] or right[1]):
                    continue
                ok = math.isclose(left[0], right[0], rel_tol=1e-6, abs_tol=1e-9)
                found.append({"lhs": left[0], "rhs": right[0], "text": f"{parts[i].strip()} = {parts[i + 1].strip()}",
                              "ok": ok})
    return found


def classify(text: str) -> str:
    """"valid" (checkable steps, all right), "lucky" (a wrong step) or "no_working" (no checkable step)."""
    found = steps(text)
    if not found:
        return "no_working"
    return "valid" if all(s["ok"] for s in found) else "lucky"
