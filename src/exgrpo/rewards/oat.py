"""The released evaluation grader, reimplemented: what ExGRPO's `eval_scripts/oat_math_grader.py` decides with
`boxed_reward_fn(text, gold, fast=False)` (spec §8), written for exgrpo and tested case by case against it.

An answer is the content of the last ``\\boxed{...}``; it equals the gold when any of three checks says so:

1. `hendrycks_equal`: the two strings are equal after the MATH normalisation (Hendrycks et al.; units, ``\\left``,
   ``\\dfrac``, ``x =``, ``0.5`` and ``a/b`` rewritten...);
2. `sympy_equal`: after a second normalisation (LaTeX turned into plain text), the strings are equal, or each
   element of a tuple or interval is equal under sympy (integers and fractions must match exactly);
3. `math_verify_equal`: math-verify on both, LaTeX (boxed first) or expression extraction, without fallback.

Deliberate differences, both about time: the released grader gives check 3 one second of wall-clock time
(SIGALRM) and math-verify its own one-second timeouts, so a slow but finite comparison can flip with machine load;
here check 3 runs to completion and the caller's `GradingPool` timeout bounds a hang. The released check 2 has no
bound at all; here a tower or an exponent of two digits or more written with ``**`` is kept from sympy as the
released grader keeps one written with ``^`` (``9**9**9`` would compute a number of 370 million digits).
The unit word lists below are data taken over from the released grader (Apache-2.0, from MathQA and the MATH
normalisation), in their order: substitutions run one after another, so the order is part of the semantics.
"""

from __future__ import annotations

import re

import sympy
from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
from pylatexenc.latex2text import LatexNodes2Text
from sympy.parsing import sympy_parser

# --- the last box -------------------------------------------------------------------------------------------------


def oat_boxed_answer(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` as the released grader finds it; None if there is none.

    The last ``\\boxed`` is taken (the last ``\\fbox`` if there is none), extended to the brace that closes the
    first one opened after it, and kept only if it reads ``\\boxed{...}``: a last ``\\boxed 5`` gives None even
    when an earlier box exists, and so does an ``\\fbox{5}``.
    """
    start = text.rfind("\\boxed")
    if start < 0:
        start = text.rfind("\\fbox")
        if start < 0:
            return None
    depth = 0
    for end in range(start, len(text)):
        if text[end] == "{":
            depth += 1
        elif text[end] == "}":
            depth -= 1
            if depth == 0:
                box = text[start:end + 1]
                return box[len("\\boxed{"):-1] if box.startswith("\\boxed{") else None
    return None


def grade_oat(text: str, gold: str) -> float:
    """1.0 if the last box of `text` equals `gold` for the released evaluation grader, else 0.0 (no box: 0.0).

    A gold that itself holds a ``\\boxed`` is replaced by its box content (None then matches nothing).
    """
    if not isinstance(text, str) or not isinstance(gold, str):
        raise TypeError(f"grade_oat grades a str against a str gold, got {type(text).__name__} and "
                        f"{type(gold).__name__}")
    answer = oat_boxed_answer(text)
    if answer is None:
        return 0.0
    if "\\boxed" in gold:
        gold = oat_boxed_answer(gold)
        if gold is None:
            return 0.0
    return float(oat_equal(answer, gold))


def grade_math_boxed(completion: str, gold: str) -> float:
    """The paper's evaluation label (spec §8): the released evaluation grader (OAT's ``boxed_reward_fn`` with
    ``fast=False``) on the last \\boxed{...}; no box is 0.0. See the module docstring.

    Unlike `grade_math`, neither an earlier box nor a bare number elsewhere in the text counts, and an answer
    written as arithmetic is graded as the released grader grades it (never as a restatement).
    """
    return grade_oat(completion, gold)


def oat_equal(answer: str, gold: str) -> bool:
    """Whether a boxed `answer` equals `gold`: the three checks of the module docstring, in order."""
    return hendrycks_equal(answer, gold) or sympy_equal(answer, gold) or math_verify_equal(answer, gold)


# --- check 1: the MATH normalisation ------------------------------------------------------------------------------

_WHOLE_TEXT = re.compile(r"^\\text\{(?P<text>.+?)\}$")
_UNIT_WORDS = (  # the released list, in order; each entry is used as a regular expression between non-word chars
    "east|degree|mph|kmph|ft|m sqaure| m east|sq m|deg|mile|q .|monkey|prime|ratio|profit of rs|rd|o|gm|p . m|lb|"
    "tile|per|dm|lt|gain|ab|way|west|a .|b .|c .|d .|e .|f .|g .|h .|t|a|h|no change|men|soldier|pie|bc|excess|st|"
    "inches|noon|percent|by|gal|kmh|c|acre|rise|a . m|th|π r 2|sq|mark|l|toy|coin|sq . m|gallon|° f|profit|minw|yr|"
    "women|feet|am|pm|hr|cu cm|square|v â € ™|are|rupee|rounds|cubic|cc|mtr|s|ohm|number|kmph|day|hour|minute|min|"
    "second|man|woman|sec|cube|mt|sq inch|mp|∏ cm ³|hectare|more|sec|unit|cu . m|cm 2|rs .|rs|kg|g|month|km|m|cm|mm|"
    "apple|liter|loss|yard|pure|year|increase|decrease|d|less|Surface|litre|pi sq m|s .|metre|meter|inch"
).split("|")
_UNIT_PATTERNS = [re.compile(r"(^|\W)" + word + r"($|\W)") for word in _UNIT_WORDS + [w + "s" for w in _UNIT_WORDS]]


class _Unnormalisable(Exception):
    """The MATH normalisation gives up (the released code raises there); the answer is then compared as written."""


def hendrycks_normalize(answer: str) -> str:
    """The MATH normalisation of an answer: an enclosing ``\\text{}`` removed, then `_hendrycks_rewrite`."""
    answer = answer.strip()
    whole = _WHOLE_TEXT.search(answer)
    if whole:
        answer = whole.group("text").strip()
    try:
        return _hendrycks_rewrite(answer)
    except _Unnormalisable:
        return answer


def hendrycks_equal(answer: str, gold: str) -> bool:
    return hendrycks_normalize(answer) == hendrycks_normalize(gold)


def _hendrycks_rewrite(s: str) -> str:
    s = s.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    s = re.sub(r"\\begin\{array\}\{.*?\}", r"\\begin{pmatrix}", s)
    s = re.sub(r"\\end\{array\}", r"\\end{pmatrix}", s).replace("bmatrix", "pmatrix")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac")
    s = s.replace("\\neq", "\\ne").replace("\\leq", "\\le").replace("\\geq", "\\ge")
    s = s.replace("\\left", "").replace("\\right", "")
    without_unit = re.sub(r"\\text\{.*?\}$", "", s).strip()  # a trailing \text{...}, from its first \text{
    if without_unit not in ("", s):
        s = without_unit
    s = _drop_unit_words(s)
    s = s.replace("^{\\circ}", "").replace("^\\circ", "").replace("\\$", "")
    if "\\text{ " in s:
        parts = s.split("\\text{ ")
        if len(parts) != 2:
            raise _Unnormalisable(s)
        s = parts[0]
    s = s.replace("\\%", "").replace(" .", " 0.").replace("{.", "{0.")
    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    sides = s.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:  # "x = 3", "k=3": the right side
        s = sides[1]
    s = _braced_sqrt(s).replace(" ", "")
    s = _braced_fracs(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _slash_to_frac(s)


def _drop_unit_words(s: str) -> str:
    """Two passes of the unit words; a removal that would leave nothing is skipped."""
    for _ in range(2):
        for pattern in _UNIT_PATTERNS:
            shorter = pattern.sub(r"\1\2", s)
            if shorter:
                s = shorter
    return s


def _braced_sqrt(s: str) -> str:
    """``\\sqrt3`` -> ``\\sqrt{3}`` (one character)."""
    head, *pieces = s.split("\\sqrt")
    for piece in pieces:
        if not piece:
            raise _Unnormalisable(s)
        head += "\\sqrt" + (piece if piece[0] == "{" else "{" + piece[0] + "}" + piece[1:])
    return head


def _braced_fracs(s: str) -> str:
    """``\\frac12`` -> ``\\frac{1}{2}``, ``\\frac1{72}`` -> ``\\frac{1}{72}``; unchanged if a ``\\frac`` is followed
    by a single character."""
    head, *pieces = s.split("\\frac")
    for piece in pieces:
        if not piece:
            raise _Unnormalisable(s)
        if piece[0] == "{":
            head += "\\frac" + piece
        elif len(piece) < 2:
            return s
        elif piece[1] == "{":
            head += "\\frac{" + piece[0] + "}" + piece[1:]
        else:
            head += "\\frac{" + piece[0] + "}{" + piece[1] + "}" + piece[2:]
    return head


def _slash_to_frac(s: str) -> str:
    """``a/b`` of two integers written plainly -> ``\\frac{a}{b}``."""
    parts = s.split("/")
    if len(parts) != 2:
        return s
    try:
        a, b = int(parts[0]), int(parts[1])
    except ValueError:
        return s
    return f"\\frac{{{a}}}{{{b}}}" if s == f"{a}/{b}" else s


# --- check 2: plain-text normalisation and sympy ------------------------------------------------------------------

_LENGTH_TIME_UNITS = ("degree", "cm", "centimeter", "meter", "mile", "second", "minute", "hour", "day", "week", "month",
                      "year", "foot", "feet", "inch", "yard")
_UNIT_SUFFIXES = [re.compile(unit + r"(es)?(s)? *(\^[0-9]+)?") for unit in _LENGTH_TIME_UNITS]
_GROUPED_THOUSANDS = re.compile(r"(\d)(,)(\d\d\d)($|\D)")
_TUPLE_CHARS = "()[]"
_LATEX_TO_TEXT = LatexNodes2Text()


def plain_normalize(expr: str) -> str:
    """The second normalisation: units, ``$``, ``%`` and braces dropped, LaTeX turned into plain text (``√`` ->
    ``sqrt``), lower case, and a number that is an integer written as one (``27.0`` -> ``27``, ``1,000`` -> ``1000``).
    """
    whole = _WHOLE_TEXT.search(expr)
    if whole:
        expr = whole.group("text")
    expr = expr.replace("\\%", "%").replace("\\$", "$").replace("$", "").replace("%", "")
    expr = expr.replace(" or ", " , ").replace(" and ", " , ")
    expr = expr.replace("million", "*10^6").replace("billion", "*10^9").replace("trillion", "*10^12")
    for unit in _UNIT_SUFFIXES:
        expr = unit.sub("", expr)
    expr = re.sub(r"\^ *\\circ", "", expr)
    if expr[:1] == "{" and expr[-1:] == "}":
        expr = expr[1:-1]
    expr = re.sub(r",\\! *", "", expr)
    if _is_integral(_as_float(expr)):
        expr = str(int(round(float(expr))))
    if "\\" in expr:
        expr = _latex_to_plain(expr)
    expr = re.sub("- *", "-", expr)
    expr = re.sub("([0-9]) +([0-9])", r"\1+\2", expr)  # a mixed number: 7 3/4 -> 7+3/4
    expr = expr.replace(" ", "").replace("{", "").replace("}", "").lower()
    if _is_integral(_as_float(_strip_grouping_commas(expr))):
        expr = str(int(float(expr.replace(",", ""))))
    return expr


def _as_float(s: str) -> float | None:
    try:
        return float(s)
    except ValueError:
        return None


def _is_integral(x: float | None) -> bool:
    """Within 1e-7 of an integer (False for None, infinities and NaN)."""
    try:
        return x is not None and abs(x - int(round(x))) <= 1e-7
    except (OverflowError, ValueError):
        return False


def _strip_grouping_commas(expr: str) -> str:
    """1,000,000 -> 1000000, leaving the commas of a tuple such as (1,2) alone."""
    while True:
        stripped = _GROUPED_THOUSANDS.sub(r"\1\3\4", expr)
        if stripped == expr:
            return expr
        expr = stripped


def _latex_to_plain(expr: str) -> str:
    """LaTeX as text by pylatexenc, with the symbols sympy needs spelled out; unchanged if pylatexenc fails."""
    spaced = expr.replace("\\tfrac", "\\frac").replace("\\dfrac", "\\frac").replace("\\frac", " \\frac")
    try:
        text = _LATEX_TO_TEXT.latex_to_text(spaced)
    except Exception:  # pylatexenc's own parse errors on malformed LaTeX: the released grader keeps the input
        return expr
    for symbol, name in (("√", "sqrt"), ("π", "pi"), ("∞", "inf"), ("∪", "U"), ("·", "*"), ("×", "*")):
        text = text.replace(symbol, name)
    return text.strip()


def sympy_equal(answer: str, gold: str) -> bool:
    """Check 2: equal plain normalisations, or element-wise equality of two tuples/intervals (or two single values)
    with the same brackets, each pair of elements equal under `_elements_equal`."""
    gold_plain, answer_plain = plain_normalize(gold), plain_normalize(answer)
    if gold_plain == answer_plain:
        return True
    if not answer_plain:
        return False
    gold_elements, answer_elements = _split_tuple(gold_plain), _split_tuple(answer_plain)
    if len(gold_elements) > 1 and (gold_plain[0] != answer_plain[0] or gold_plain[-1] != answer_plain[-1]):
        return False
    if len(gold_elements) != len(answer_elements):
        return False
    return all(_elements_equal(g, a) for g, a in zip(gold_elements, answer_elements))


def _split_tuple(expr: str) -> list[str]:
    """The elements of ``(a,b)`` or ``[a,b)`` (no nested brackets), else [expr]; [] for ""."""
    expr = _strip_grouping_commas(expr)
    if not expr:
        return []
    if (len(expr) > 2 and expr[0] in _TUPLE_CHARS and expr[-1] in _TUPLE_CHARS
            and not any(ch in expr[1:-1] for ch in _TUPLE_CHARS)):
        return [element.strip() for element in expr[1:-1].split(",")]
    return [expr]


def _elements_equal(gold: str, answer: str) -> bool:
    """Two fractions a/b must be written alike; an integer gold needs an integer answer (and vice versa); other
    pairs are equal when sympy simplifies their difference to 0."""
    if _is_fraction(gold) and _is_fraction(answer):
        return gold == answer
    if _is_integral(_as_float(_strip_grouping_commas(gold))) != _is_integral(_as_float(_strip_grouping_commas(answer))):
        return False
    return _difference_is_zero(gold, answer)


def _is_fraction(expr: str) -> bool:
    return re.search(r"^-?[0-9]+.?/0*[1-9][0-9]*.?$", expr) is not None


def _difference_is_zero(gold: str, answer: str) -> bool:
    """sympy.simplify((gold) - (answer)) == 0, for expressions the released grader lets sympy evaluate."""
    difference = f"({gold})-({answer})"
    if not _safe_for_sympy(difference):
        return False
    transformations = sympy_parser.standard_transformations + (sympy_parser.implicit_multiplication_application,)
    try:
        parsed = sympy_parser.parse_expr(difference.replace("^", "**"), transformations=transformations)
        return sympy.simplify(parsed) == 0
    except Exception:  # sympy's parser runs arbitrary text; anything it cannot read is "not equal", as released
        return False


def _safe_for_sympy(expr: str) -> bool:
    """At most two distinct letters (``sqrt`` and ``frac`` aside), and no exponent that may hang sympy: a braced or
    parenthesised ``^`` one, a tower, or one of two digits or more (for the last two, ``**`` counts as ``^``: see
    the module docstring)."""
    if len({ch for ch in expr.replace("sqrt", "").replace("frac", "") if ch.isalpha()}) > 2:
        return False
    if "^{" in expr or "^(" in expr:
        return False
    powers = expr.replace("**", "^")
    return re.search(r"\^[0-9]+\^", powers) is None and re.search(r"\^[0-9][0-9]+", powers) is None


# --- check 3: math-verify -----------------------------------------------------------------------------------------

_MV_EXTRACTION = (LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig())
_REPETITION_MIN_LENGTH = 128


def math_verify_equal(answer: str, gold: str) -> bool:
    """Check 3: math-verify on both strings (each wrapped in ``$...$`` unless it has a ``$``), LaTeX or expression
    extraction without fallback; False for a string over 128 characters that is highly repetitive.

    The released call passes extraction_mode=["first_match"], a list that math-verify compares unequal to
    "first_match", so it extracts as "any_match" does; that is what is reproduced. No timeouts (module docstring).
    """
    if any(len(s) > _REPETITION_MIN_LENGTH and is_repetitive(s) for s in (answer, gold)):
        return False

    def read(s: str) -> list:
        return parse(s if "$" in s else f"${s}$", extraction_config=_MV_EXTRACTION, fallback_mode="no_fallback",
                     extraction_mode="any_match", parsing_timeout=None)

    try:
        return bool(verify(read(gold), read(answer), timeout_seconds=None))
    except Exception:  # math-verify raises on some inputs it cannot compare; the released grader says "not equal"
        return False


def is_repetitive(s: str) -> bool:
    """More than 20% of the string's substrings are repeats: the sum over adjacent suffixes in sorted order of their
    longest common prefix, times 2 / (n (n + 1)), exceeds 0.2."""
    n = len(s)
    if n <= 1:
        return False
    order = _suffix_array(s)
    rank = [0] * n
    for position, start in enumerate(order):
        rank[start] = position
    total, common = 0, 0
    for start in range(n):  # Kasai's algorithm: common prefixes of each suffix with the next one in sorted order
        if rank[start] == n - 1:
            common = 0
            continue
        other = order[rank[start] + 1]
        while start + common < n and other + common < n and s[start + common] == s[other + common]:
            common += 1
        total += common
        common = max(common - 1, 0)
    return total * 2 / (n * (n + 1)) > 0.2


def _suffix_array(s: str) -> list[int]:
    """Start positions of the suffixes of `s` in sorted order (prefix doubling, O(n log² n))."""
    n = len(s)
    rank = [ord(ch) for ch in s]
    order = list(range(n))
    width = 1
    while True:
        key = [(rank[i], rank[i + width] if i + width < n else -1) for i in range(n)]
        order.sort(key=key.__getitem__)
        new_rank = [0] * n
        for previous, current in zip(order, order[1:]):
            new_rank[current] = new_rank[previous] + (key[current] != key[previous])
        rank = new_rank
        if rank[order[-1]] == n - 1:
            return order
        width *= 2
