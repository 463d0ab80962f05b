"""The math reward: math-verify on what a completion states as its answer, refusing restated arithmetic when it
knows the question. The benchmarks' evaluation grader is `exgrpo.rewards.oat`; multiple choice and reasoning-gym's
tasks are graded in `exgrpo.rewards.task_graders`."""

from __future__ import annotations

import re
import signal
import threading

import sympy
from math_verify import parse, verify

from exgrpo.rewards.arithmetic import (ARITHMETIC, CHAIN, OPERATION, RESULT, SIGNED_NUMBER, STATED_NUMBER, TOKEN,
                                       last_side, places_written)
from exgrpo.rewards.restatement import is_restatement

_MV_TIMEOUT_S = 5  # math-verify's default parse and verify timeouts, which the released reward used


def grade_math(completion: str, gold: str, think_gate: bool = False, question: str | None = None) -> float:
    """1.0 if math-verify judges the completion's answer equal to `gold`, else 0.0 (the released training reward).

    With `think_gate`, a completion without "</think>" scores 0.0 and only the text after the first "</think>" is
    graded. The "<think>" half of the released gate is implied: our prompts end with "<think>\\n".
    Plain text is graded too: math-verify's expression fallback takes the last number in the text (but finds
    none in "answer:12" or "(12)"; tests/rewards/test_rewards.py lists these grader gaps).
    With `question` (the prompt's text) and a numeric gold, an answer that restates the question's arithmetic
    instead of computing it scores 0.0 (`exgrpo.rewards.restatement.is_restatement`): math-verify would evaluate
    "752 * -611 + 290" and pay for the copy. Where math-verify reads a number the completion does not give as its
    answer, `question` corrects that too (`_final_answer`). Without `question` the released reward is reproduced
    as it is.
    """
    if question is not None and not isinstance(question, str):
        raise TypeError(f"grade_math: question must be the prompt's text (str) or None, got {type(question).__name__}")
    if think_gate:
        completion = after_think(completion)
        if completion is None:
            return 0.0
    # math-verify times out with SIGALRM, which only works on the main thread (elsewhere it would raise) and would
    # disarm an in-process GradingPool's own timer: there its timeouts are off and the pool bounds the time.
    own_timer = threading.current_thread() is threading.main_thread() and not signal.getitimer(signal.ITIMER_REAL)[0]
    timeout = _MV_TIMEOUT_S if own_timer else None
    try:
        gold_parsed = parse("$" + gold + "$", parsing_timeout=timeout)
        answer_parsed = parse(completion, parsing_timeout=timeout)
        if question is not None and _numeric(gold_parsed):
            answer_parsed = _final_answer(completion, answer_parsed, question, timeout)
        return float(verify(gold_parsed, answer_parsed, timeout_seconds=timeout))
    except Exception:
        return 0.0


def _final_answer(completion: str, answer_parsed: list, question: str, timeout: int | None) -> list:
    """What a completion answers to a numeric gold, from math-verify's reading of it ([sympy, text]; [] for no
    answer): a plain-text reading corrected by `_plain_text_answer`; no answer for a restatement of the question's
    arithmetic (`is_restatement`)."""
    if len(answer_parsed) == 2 and "\\boxed" not in completion:
        answer_parsed = _plain_text_answer(completion, answer_parsed, question, timeout)
    if len(answer_parsed) == 2 and is_restatement(*answer_parsed, question):
        return []
    return answer_parsed


def _plain_text_answer(completion: str, answer_parsed: list, question: str, timeout: int | None) -> list:
    """math-verify's reading of a plain-text answer, where it reads a number the completion does not give as its
    answer, corrected:
    * an answer the completion states in so many words ("The answer is 71, which is 48 + 23."; "71 is the answer
      since ..."; "The answer is not 70, it is 71."): that number (`stated_answer`), whatever working follows it;
    * an answer denied at the end ("The answer is not 71."): none; an answer asked ("The answer is 70? No, 71."):
      what follows it;
    * a list item's number ("gives 6 as final answer\\n3. This is ..."): read again without the list's numbers;
    * the start of an equation ("the final answer is 15 - 6 = 7"): read as the equation's result;
    * a number its sentence goes on computing with ("the final answer follows: multiplying 2 by 3 and adding 5"),
      or one whose sentence equates the question's arithmetic to another number ("So 7 - 2 + 0 = 15 and 27 - 9 =
      5"): no answer.
    """
    if (stated := stated_answer(completion)) is not None:
        return parse("$" + stated + "$", parsing_timeout=timeout)
    if _NEGATED_ANSWER.search(completion):
        return []
    if asked := list(_QUESTIONED_ANSWER.finditer(completion)):  # "The answer is 70? No, 71.": what follows
        return parse(completion[asked[-1].end():], parsing_timeout=timeout)
    if _only_list_markers(completion, answer_parsed):
        completion = _LIST_MARKER.sub(r"\1", completion)
        answer_parsed = parse(completion, parsing_timeout=timeout)
    if len(answer_parsed) == 2 and (result := _equation_result(completion, answer_parsed)):
        answer_parsed = parse("$" + result + "$", parsing_timeout=timeout)
    if len(answer_parsed) == 2 and (sentence := _answer_sentence(completion, answer_parsed)):
        before, after = sentence
        if re.search(r"\d", after) or _states_otherwise(before + answer_parsed[1] + after, answer_parsed, question):
            return []
    return answer_parsed


#: what may wrap an answer: markdown bold, LaTeX math delimiters
_WRAP_OPEN, _WRAP_CLOSE = r"(?:\*\*|\$|\\\(|\\\[)?", r"(?:\*\*|\$|\\\)|\\\])?"
#: what may follow a stated answer: the end, punctuation, a bracket, or a word that gives the working (a question
#: mark makes it a question: "The answer is 5? No, 6.")
_STATEMENT_END = r"(?=\s*(?:$|[.,;:!()\n]|(?:which|since|because|as|from|by|given|so|after)\b))"
#: "the answer is 71", "Answer: 71", "the answer to 48 + 23 is 71", "the final answer equals 71"
_ANSWER_IS = re.compile(rf"\banswer(?:[ \t]+to[ \t]+[^.!?\n]{{1,40}}?)?[ \t]*(?:is|equals|=|:)[ \t]*:?\s*"
                        rf"{_WRAP_OPEN}[ \t]*(?P<chain>{CHAIN}){_WRAP_CLOSE}{_STATEMENT_END}", re.IGNORECASE)
#: "71 is the answer", "48 + 23 = 71 is the final answer"
_IS_THE_ANSWER = re.compile(rf"(?<![\d.,]){_WRAP_OPEN}(?P<chain>{CHAIN}){_WRAP_CLOSE}[ \t]+is[ \t]+(?:the|our|my)"
                            rf"[ \t]+(?:final[ \t]+|correct[ \t]+)?answer\b", re.IGNORECASE)

#: "is not", "isn't" between an answer and a number
_IS_NOT = r"[ \t]+(?:is[ \t]+not|isn't)[ \t]+"
#: "the answer is not 70, it is 71", "the answer isn't 70 but 71": the correction states the answer
_CORRECTED_ANSWER = re.compile(rf"\banswer{_IS_NOT}{_WRAP_OPEN}(?:{STATED_NUMBER}){_WRAP_CLOSE}"
                               rf"[ \t]*[,;]?[ \t]*(?:but[ \t]+)?(?:it[ \t]+is[ \t]+|it's[ \t]+)?{_WRAP_OPEN}[ \t]*"
                               rf"(?P<chain>{CHAIN}){_WRAP_CLOSE}{_STATEMENT_END}", re.IGNORECASE)

#: an answer asked, not stated ("The answer is 70? No, 71."): math-verify reads the asked number
_QUESTIONED_ANSWER = re.compile(rf"\banswer[ \t]*(?:is|equals|=|:)[ \t]*{_WRAP_OPEN}[ \t]*(?:{STATED_NUMBER})"
                                rf"{_WRAP_CLOSE}[ \t]*\?", re.IGNORECASE)

#: a completion that ends by denying its last number is the answer ("The answer is not 5."; "5 is not the answer"):
#: math-verify reads that number; it states no answer
_NEGATED_ANSWER = re.compile(rf"(?:\banswer{_IS_NOT}{_WRAP_OPEN}(?:{STATED_NUMBER}){_WRAP_CLOSE}|(?:{STATED_NUMBER})"
                             rf"{_WRAP_CLOSE}{_IS_NOT}(?:the|my|our)[ \t]+(?:final[ \t]+|correct[ \t]+)?answer)\W*$",
                             re.IGNORECASE)


def stated_answer(completion: str) -> str | None:
    """The number a completion states in so many words as its answer ("The answer is 71, which is 48 + 23." ->
    "71"; "71 is the answer since 40 + 20 = 60 ..." -> "71"; "the final answer is 15 - 6 = 9" -> "9"), from its
    last such statement; None where it states none. Of arithmetic stated as the answer, the last side that is a
    number is the answer ("71 = 48 + 23" -> "71"); arithmetic with no such side ("the answer is 48 + 23") states
    none. Working may follow the answer after punctuation or a word such as "which", "since", "as"; anything else
    after the number ("the answer is 2 É 5") makes it no statement."""
    statements = sorted([*_ANSWER_IS.finditer(completion), *_IS_THE_ANSWER.finditer(completion),
                         *_CORRECTED_ANSWER.finditer(completion)], key=lambda m: m.start())
    for statement in reversed(statements):
        sides = [side.strip() for side in statement.group("chain").split("=")]
        numbers = [side for side in sides if re.fullmatch(STATED_NUMBER, side)]
        if numbers:
            return numbers[-1].replace(",", "")
    return None


def _numeric(gold_parsed: list) -> bool:
    """Whether math-verify's parse of the gold ([sympy, text]) is a number."""
    return len(gold_parsed) == 2 and isinstance(gold_parsed[0], sympy.Number)


#: a numbered list item's marker at the start of a line ("3. This is"); group 1 is the indent before it
_LIST_MARKER = re.compile(r"(?m)^([ \t]*)\d+[.)][ \t]+(?=\D)")


def _only_list_markers(completion: str, answer_parsed: list) -> bool:
    """Whether math-verify's answer is written in the completion only as list items' numbers."""
    markers = {m.end(1) for m in _LIST_MARKER.finditer(completion)}
    written = places_written(answer_parsed[1], completion)
    return bool(written) and all(w.start() in markers for w in written)


#: what follows the left side of an equation on its line: more operands, then its result
_EQUATION_TAIL = re.compile(rf"(?:{OPERATION})*{RESULT}")


def _equation_result(completion: str, answer_parsed: list) -> str | None:
    """Where math-verify's answer is, everywhere the completion writes it, the start of an equation ("the final
    answer is 15 - 6 = 7"; "final answer:\\n9 + 6 = 15"), the equation's last side (7; 15; of a chain
    "9 + 6 - 6 = 15 - 6 = 9", 9): the completion's answer, which math-verify would not read. None otherwise (an
    answer also written on its own)."""
    written = places_written(answer_parsed[1], completion)
    results = [_EQUATION_TAIL.match(completion, w.end()) for w in written]
    if not written or not all(results):
        return None
    return last_side(results[-1].group(1)) or None


#: the end of a sentence: a full stop, "!" or "?" before a space or the end, or a line break
_SENTENCE_END = re.compile(r"[.!?](?=\s|$)|\n")


def _answer_sentence(completion: str, answer_parsed: list) -> tuple[str, str] | None:
    """The text before and after the last place the completion writes math-verify's answer, within its sentence;
    None where the answer is not written as such."""
    written = places_written(answer_parsed[1], completion)
    if not written:
        return None
    head, tail = completion[:written[-1].start()], completion[written[-1].end():]
    start = max((m.end() for m in _SENTENCE_END.finditer(head)), default=0)
    end = _SENTENCE_END.search(tail)
    return head[start:], tail[:end.start()] if end else tail


def _states_otherwise(sentence: str, answer_parsed: list, question: str) -> bool:
    """Whether `sentence`, which does not call anything the answer, equates the question's arithmetic (the last
    written in `question`) to a number other than math-verify's answer ("So 7 - 2 + 0 = 15 and 27 - 9 = 5" on
    "7 - 2 + 0 =": 15; of a chain, its last side). A sentence that names its answer ("... = 9 division of 9 is 4
    which is the final answer") is taken at its word."""
    asked = ARITHMETIC.findall(question)
    if not asked or not isinstance(answer_parsed[0], sympy.Number) or "answer" in sentence.lower():
        return False
    expression = r"[ \t]*".join(map(re.escape, TOKEN.findall(asked[-1])))
    for equation in re.finditer(rf"(?<![\d.]){expression}{RESULT}", sentence):
        result = last_side(equation.group(1))
        if re.fullmatch(SIGNED_NUMBER, result) and float(result) != float(answer_parsed[0]):
            return True
    return False


def after_think(text: str) -> str | None:
    """The solution part of a think-formatted text: what follows the first "</think>" (up to a second one, as
    released: spec §6); None when there is no "</think>"."""
    return text.split("</think>")[1] if "</think>" in text else None
