"""Tests for exgrpo.rewards against the real math-verify (0.9.0).

The expected labels are math-verify's actual behaviour. Those marked "GAP" are surprising labels that the released
reward inherits; they are kept as they are so that a math-verify upgrade that changes them shows up here.
"""

import os
import sys
import threading
import time
import types

import numpy as np
import pytest

from exgrpo.rewards import (ChoiceReward, GradingPool, MathReward, choice_letter, combine_rewards, grade_choice,
                            grade_math, grade_math_boxed, oat_boxed_answer)
from exgrpo.rewards.oat import is_repetitive

MATH_CASES = [
    # fractions and decimals
    (r"\boxed{\frac{1}{2}}", "0.5", 1.0),
    (r"\boxed{0.5}", r"\frac{1}{2}", 1.0),
    ("1/2", r"\frac12", 1.0),
    (r"\boxed{\dfrac{3}{4}}", r"\frac34", 1.0),
    (r"\boxed{\frac{6}{8}}", r"\frac{3}{4}", 1.0),
    (r"\boxed{0.33}", r"\frac{1}{3}", 0.0),
    (r"\boxed{0.333333}", r"\frac{1}{3}", 1.0),  # GAP: floats are compared after rounding to 6 decimals
    # sets
    (r"\boxed{\{1,2\}}", r"\{1,2\}", 1.0),
    (r"\boxed{\{2,1\}}", r"\{1,2\}", 1.0),
    (r"\boxed{\{1,3\}}", r"\{1,2\}", 0.0),
    (r"\boxed{1, 2}", r"\{1,2\}", 1.0),
    (r"\boxed{2}", r"\{1,2\}", 0.0),
    (r"\boxed{3, 2}", "2,3", 1.0),  # GAP: a bare comma list is a set, so an ordered answer's order is ignored
    # intervals
    (r"\boxed{[0, 1]}", "[0,1]", 1.0),
    (r"\boxed{(0, 1]}", "[0,1]", 0.0),
    (r"\boxed{(0, 1)}", "[0,1]", 0.0),
    (r"\boxed{x \in (0, 1]}", "(0,1]", 1.0),
    (r"\boxed{(-\infty, 2)}", r"(-\infty,2)", 1.0),
    # percent
    (r"\boxed{50\%}", "50", 1.0),
    (r"\boxed{0.5}", r"50\%", 1.0),
    (r"\boxed{50}", r"50\%", 1.0),  # GAP: both 50 and 0.5 match a gold of 50%
    # units
    (r"\boxed{5 \text{ cm}}", "5", 1.0),
    (r"\boxed{5}", r"5 \text{ cm}", 1.0),
    (r"\boxed{5 \text{ m}}", r"5 \text{ cm}", 1.0),  # GAP: units are dropped, not compared...
    (r"\boxed{500 \text{ cm}}", r"5 \text{ m}", 0.0),  # ...nor converted
    (r"\boxed{45^\circ}", "45", 1.0),
    # negatives
    (r"\boxed{-3}", "-3", 1.0),
    (r"\boxed{3}", "-3", 0.0),
    ("The answer is -3", "-3", 1.0),
    # roots and pi
    (r"\boxed{2\sqrt{2}}", r"\sqrt{8}", 1.0),
    (r"\boxed{\frac{\sqrt{2}}{2}}", r"\frac{1}{\sqrt{2}}", 1.0),
    (r"\boxed{\sqrt{3}}", r"\sqrt{2}", 0.0),
    (r"\boxed{1.414}", r"\sqrt{2}", 0.0),
    (r"\boxed{\sqrt{-1}}", "i", 0.0),  # GAP: sqrt(-1) is not simplified to i
    (r"\boxed{\pi}", r"\pi", 1.0),
    (r"\boxed{2\pi}", r"\pi \cdot 2", 1.0),
    (r"\boxed{3.14}", r"\pi", 0.0),
    # tuples, equations, expressions
    (r"\boxed{(1,2,3)}", "(1,2,3)", 1.0),
    (r"\boxed{(2, 1)}", "(1,2)", 0.0),
    (r"\boxed{x=3}", "3", 1.0),
    (r"\boxed{x^2+2x+1}", "(x+1)^2", 1.0),
    (r"\boxed{y^2+2y+1}", "(x+1)^2", 0.0),
    (r"\boxed{1.2e1}", "12", 0.0),  # GAP: scientific notation reads e as Euler's number
    # plain text: math-verify's expression fallback takes the last number
    ("12", "12", 1.0),
    ("The answer is 12.", "12", 1.0),
    ("After 3 steps we get 12.", "12", 1.0),
    ("12 is the answer, not 13", "12", 0.0),
    ("The answer is 12.5", "12", 0.0),
    ("It costs $12", "12", 1.0),
    ("1,000", "1000", 1.0),
    (r"\boxed{1,000}", "1000", 1.0),
    ("answer:12", "12", 0.0),  # GAP: a number glued to a preceding ':' is not extracted at all
    ("(12)", "12", 0.0),  # GAP: nor a number in parentheses
    # arithmetic: math-verify evaluates it (RESTATEMENT_CASES: what the training reward makes of it)
    ("752 * -611 + 290", "-459182", 1.0),
    (r"\boxed{3 \cdot 4}", "12", 1.0),
    (r"\boxed{2^{10}}", "1024", 1.0),
    ("3/4", r"\frac{3}{4}", 1.0),
    ("-3 / 4", "-0.75", 1.0),
    ("12.5%", "0.125", 1.0),
    (r"\boxed{x = 5}", "5", 1.0),
    # boxes
    (r"Therefore $\boxed{12}$. Check: 3*4 = 12, and 5", "12", 1.0),
    (r"\boxed{7} then \boxed{12}", "12", 0.0),  # GAP: every box is kept and they merge into the set {7, 12}
    # no answer
    ("no answer here", "12", 0.0),
    ("", "12", 0.0),
    (r"\boxed{}", "12", 0.0),
]

# (completion, gold, question, label): with the question, an answer restating its arithmetic scores 0 where the
# gold is a number; the same form written with numbers the question does not hold is an answer
RESTATEMENT_CASES = [
    ("752 * -611 + 290", "-459182", "Calculate 752 * -611 + 290.", 0.0),
    ("To calculate 752 * -611 + 290 using only the final number, we can", "-459182", "Calculate 752 * -611 + 290.",
     0.0),
    ("The answer is $x = 752 * -611 + 290$.", "-459182", "Calculate 752 * -611 + 290.", 0.0),  # an equation
    (r"\boxed{752 \times (-611) + 290}", "-459182", "Calculate 752 * -611 + 290.", 0.0),
    (r"\boxed{y = 3 \cdot 4}", "12", "Calculate 3 * 4.", 0.0),
    (r"\boxed{3 \cdot 4 + 0x}", "12", "Calculate 3 * 4.", 0.0),  # a free symbol, padding with 0
    (r"\boxed{3 \cdot 4 \cdot 1}", "12", "Calculate 3 * 4.", 0.0),
    (r"\boxed{2^{10}}", "1024", "Compute $2^{10}$.", 0.0),
    # math-verify reads 6 + 62 + 100 paired with the text "(10).": the value is judged too (round five's study)
    ("To get 100 + 6 + 62, I added the number of rows (6) and subtracted the number of columns (10).", "168",
     "Calculate 100 + 6 + 62. Answer with only the final number.", 0.0),
    ("752 * -611 + 290 = -459182", "-459182", "Calculate 752 * -611 + 290.", 1.0),  # restated, then computed
    ("The answer is $x = -459182$.", "-459182", "Calculate 752 * -611 + 290.", 1.0),
    ("-459182", "-459182", "Calculate 752 * -611 + 290.", 1.0),
    (r"\boxed{2^{10}}", "1024", "How many subsets does a set of ten elements have?", 1.0),
    (r"\boxed{2^{10}}", "1024", "How many subsets does a set of 10 elements have?", 1.0),  # 2 is not the question's
    (r"\boxed{10^3}", "1000", "How many grams are in a kilogram?", 1.0),
    (r"\boxed{3 \times 10^2}", "300", "How many seconds are in five minutes?", 1.0),
    (r"\boxed{1.5 \times 10^{-3}}", "0.0015", "Write one and a half thousandths as a decimal.", 1.0),
    (r"\boxed{\sqrt{4}}", "2", "What is the smallest prime?", 1.0),
    (r"\boxed{\sqrt[3]{8}}", "2", "What is the smallest prime?", 1.0),
    (r"\boxed{4!}", "24", "In how many orders can four books stand on a shelf?", 1.0),
    (r"\boxed{|-3|}", "3", "How many sides does a triangle have?", 1.0),
    (r"\boxed{\log_2 8}", "3", "How many sides does a triangle have?", 1.0),
    (r"\boxed{6 \cdot 2}", "12", "How many months are in a year?", 1.0),
    ("3/4", "0.75", "What is 3 divided by 4?", 1.0),  # a plain fraction is a number written as one
    ("12.5%", "0.125", "What is 12.5% as a decimal?", 1.0),  # and so is a percentage
    (r"\boxed{3 \cdot x}", r"3x", "Simplify x + x + x. Use 3 terms.", 1.0),  # not a numeric gold: no rule
    (r"\boxed{3 \cdot 5}", "12", "Calculate 3 * 4.", 0.0),  # wrong, restated or not
]


@pytest.mark.parametrize(("completion", "gold", "question", "expected"), RESTATEMENT_CASES)
def test_grade_math_refuses_restatements_given_the_question(completion, gold, question, expected):
    assert grade_math(completion, gold, question=question) == expected


# (completion, label) on "9 + 6 - 6 =" (gold 9): math-verify reads "final answer:" or "final answer is" up to the
# first expression, which the completion then carries on into an equation: the equation's last side is the answer
# (found in round five's pilot, where two wrong completions were paid)
NINE = "State the final answer to the following arithmetic problem: 9 + 6 - 6 ="
EQUATION_CASES = [
    ("To find the final answer:\n9 + 6 = 15\n15 - 6 = 8\nThe solution is 8.", 0.0),  # math-verify read 9
    ("So, 9 + 6 = 15. Therefore, the final answer is 15 - 6 = 7.", 0.0),  # math-verify read 15 - 6
    ("The final answer is 15 - 6 = 9.", 1.0),
    ("The final answer is 9 + 6 - 6 = 15 - 6 = 9", 1.0),  # restated, then computed: the chain's last side
    ("The final answer is 9 + 6 - 6", 0.0),  # restated only
    ("9 + 6 = 15, 15 - 6 = 9. The final answer is 9.", 1.0),  # 9 is also written on its own
    ("9 + 6 = 15 and 15 - 6 = 9, so the answer: 9", 1.0),
    (r"\boxed{9}", 1.0),
]


@pytest.mark.parametrize(("completion", "expected"), EQUATION_CASES)
def test_grade_math_reads_an_answer_that_starts_an_equation_as_its_result(completion, expected):
    assert grade_math(completion, "9", question=NINE) == expected


THREE = "State the final answer to the following arithmetic problem: 6 + 0 - 3 ="
LIST_CASES = [  # math-verify reads "final answer" across the line break: the next item's number
    ("1. 6 - 6 = 1\n2. Then, subtract 1 from 1, which gives 6 as final answer \n3. This is a task 6 smoke.", 0.0),
    ("so it gives 6 as final answer\n  3) This is it", 0.0),
    ("Steps:\n3. Subtract: 6 - 3 = 4", 0.0),
    ("1. 6 + 0 = 6\n2. 6 - 3 = 3", 1.0),  # 3 is written as a result too
    ("1. 6 + 0 = 6\n2. 6 - 3 = 3\n3. The final answer is 3.", 1.0),
    ("The final answer is:\n3.", 1.0),  # a line of its own, not an item
]


@pytest.mark.parametrize(("completion", "expected"), LIST_CASES)
def test_grade_math_does_not_read_a_list_items_number_as_the_answer(completion, expected):
    assert grade_math(completion, "3", question=THREE) == expected


# (completion, gold, label) on "2 + 3 - 3 =": math-verify reads "answer" and the first number within 50 characters;
# a number its sentence goes on computing with is not the answer (round five's fourth pilot, where the first
# completion below was paid and then replayed)
TWO = "State the final answer to the following arithmetic problem: 2 + 3 - 3 ="
FOLLOWED_CASES = [
    ("To solve 2 + 3 = 5, follow these steps:\nNotice that 2 + 3 = 5, and the final answer essentially follows this "
     "line: multiplying 2 by 3 and adding 5, highlighting the alternating nature of it's structure.", "2", 0.0),
    ("The final answer is 2 É 5, which is exactly 5.", "2", 0.0),
    ("The answer is 2 (5 - 3 = 2)", "2", 1.0),  # the sentence's last number is the answer
    ("Therefore, the final answer is 2. countdown(5)", "2", 1.0),  # a later sentence is not read
    ("2 + 3 = 5 and 5 - 3 = 2. The answer is 2.", "2", 1.0),  # working before the answer is fine
    ("2 + 3 - 3 = 2\n\n#### 2\nThe final answer is 2.", "2", 1.0),
    ("The answer is 2. I hope it helps!", "2", 1.0),
    ("\\boxed{2} since 2 + 3 = 5 and 5 - 3 = 2", "2", 1.0),  # a boxed answer is the answer
    ("2 - 43 - 0 = -41", "-41", 1.0),
]


@pytest.mark.parametrize(("completion", "gold", "expected"), FOLLOWED_CASES)
def test_grade_math_does_not_read_a_number_followed_by_others_as_the_answer(completion, gold, expected):
    assert grade_math(completion, gold, question=TWO) == expected


# (completion, label) on "7 - 2 + 0 =" (gold 5): a sentence that equates the question's arithmetic to another number
# and calls nothing the answer does not answer with its last number (round five's fifth pilot)
SEVEN = "State the final answer to the following arithmetic problem: 7 - 2 + 0 ="
STATES_OTHERWISE_CASES = [
    ("7 - 2 + 0 = 15\n\nFor Addition\n27 - 7 = 6\n\nSo 7 - 2 + 0 = 15 and 27 - 9 = 5.", 0.0),
    ("7-2+0 = 3 + 2 = 15 and 10 / 2 = 5", 0.0),  # a chain's last side, written without spaces
    ("7 - 2 + 0 = 9 so 9 less 4 is 5 which is the final answer.", 1.0),  # it names its answer
    ("7 - 2 + 0 = 7 - 2 = 5", 1.0),
    ("7 - 2 + 0 = 15. No: 7 - 2 = 5 and 5 + 0 = 5.", 1.0),  # corrected in a later sentence
]


@pytest.mark.parametrize(("completion", "expected"), STATES_OTHERWISE_CASES)
def test_grade_math_does_not_read_the_last_number_of_a_sentence_that_states_another_answer(completion, expected):
    assert grade_math(completion, "5", question=SEVEN) == expected


# (completion, gold, label) on "48 + 23": an answer stated in so many words is the answer, with its working after it
# in any form; math-verify reads a later number, or the working, instead (found by a hostile read of the demo)
STATED = "Calculate 48 + 23. Answer with only the final number."
STATED_CASES = [
    ("The answer is 71, which is 48 + 23.", "71", 1.0),
    ("The answer is 71 = 48 + 23", "71", 1.0),
    ("The answer is 71 (from 48 + 23).", "71", 1.0),
    ("Answer: 71 (48 + 23)", "71", 1.0),
    ("71 is the answer since 40 + 20 = 60 and 8 + 3 = 11", "71", 1.0),
    ("So the answer is **71**, as 40 + 30 = 70 and 8 + 3 = 11.", "71", 1.0),
    ("48 + 23 = 71 is the final answer", "71", 1.0),
    ("The answer to 48 + 23 is 71 because 8 + 3 = 11.", "71", 1.0),
    ("The answer is 1,071 since ...", "1071", 1.0),
    ("The answer is 1,071.", "1071", 1.0),  # a full stop after a thousands comma: it was read as "1" (gold 1071: 0)
    ("The answer is 1,071.", "1", 0.0),
    ("The answer is 70. No: 8 + 3 = 11, so the answer is 71.", "71", 1.0),  # the last statement
    ("The answer is 70, which is 48 + 23.", "71", 0.0),  # wrong, whatever follows
    ("The answer is 71 = 48 + 23", "48", 0.0),  # the working's numbers are not the answer
    ("The answer is 48 + 23", "71", 0.0),  # the question restated, not computed
    ("The answer is 71 É 5, which is exactly 5.", "5", 0.0),  # not a statement: math-verify's reading stands
    # an answer denied at the end is no answer: math-verify read the denied number and paid it
    ("The answer is not 71.", "71", 0.0),
    ("The answer isn't **71**", "71", 0.0),
    ("48 + 23 = 71 is not the final answer.", "71", 0.0),
    ("71 is not the answer, the answer is 72", "71", 0.0),
    # a question is not a statement; a correction is; a thousands comma with decimals is one number
    ("The answer is 70? No, 71.", "71", 1.0),
    ("The answer is 70? No, 71.", "70", 0.0),
    ("The answer is not 70, it is 71.", "71", 1.0),
    ("The answer isn't 70 but 71.", "71", 1.0),
    ("The answer is not 70, it is 71.", "70", 0.0),
    ("The answer is 1,071.5.", "1071.5", 1.0),
    ("The answer is 1,071.5", "1", 0.0),
]


@pytest.mark.parametrize(("completion", "gold", "expected"), STATED_CASES)
def test_grade_math_pays_an_answer_stated_in_words_whatever_working_follows(completion, gold, expected):
    assert grade_math(completion, gold, question=STATED) == expected


def test_without_the_question_the_released_reward_pays_what_math_verify_reads():
    assert grade_math(EQUATION_CASES[1][0], "9") == 1.0  # the released reward, reproduced as it is
    assert grade_math(LIST_CASES[0][0], "3") == 1.0
    assert grade_math(FOLLOWED_CASES[0][0], "2") == 1.0


def test_grade_math_needs_the_question_as_text():
    with pytest.raises(TypeError, match="question must be the prompt's text"):
        grade_math("12", "12", question=[{"role": "user", "content": "3 * 4"}])


# (completion, gold, label with think_gate=True, label without)
THINK_CASES = [
    ("so 12 </think> The answer is \\boxed{12}", "12", 1.0, 1.0),
    ("the answer is \\boxed{12} but no closing tag", "12", 0.0, 1.0),
    ("thinking 13 </think> \\boxed{12}", "12", 1.0, 1.0),
    ("thinking 12 </think> \\boxed{13}", "12", 0.0, 0.0),
    ("a </think> \\boxed{12} </think> \\boxed{13}", "12", 1.0, 0.0),  # a second </think> ends the answer
    ("a </think> \\boxed{13} </think> \\boxed{12}", "12", 0.0, 1.0),
    ("so 12 </think>", "12", 0.0, 1.0),  # nothing after </think>
    ("</think>12", "12", 1.0, 0.0),  # GAP (ungated): a number glued to a tag is not extracted
]

CHOICE_CASES = [
    (r"so \boxed{C}", "C", 1.0),
    (r"\boxed{\text{C}}", "C", 1.0),
    (r"\boxed{(C)}", "C", 1.0),
    (r"\boxed{\textbf{(B)}}", "B", 1.0),
    (r"\boxed{c}", "C", 1.0),
    (r"\boxed{B}", "C", 0.0),
    (r"\boxed{A}, no wait: \boxed{D}", "D", 1.0),
    (r"\boxed{A}, no wait: \boxed{D}", "A", 0.0),
    ("reasoning\nANSWER: C", "C", 1.0),
    ("reasoning\nAnswer:(c)", "C", 1.0),
    ("reasoning\nanswer : D.", "D", 1.0),
    ("reasoning\nANSWER: B", "(B)", 1.0),
    ("reasoning\nANSWER: B", "C", 0.0),
    ("\\boxed{42}\nANSWER: B", "B", 1.0),  # a box without a letter defers to the ANSWER line
    ("ANSWER: C\nbut wait, let me check", "C", 0.0),  # the ANSWER line must be the last line
    ("ANSWER: CD", "C", 0.0),
    ("The answer is C", "C", 0.0),
    (r"\boxed{C", "C", 0.0),
    ("", "C", 0.0),
    # 22 ARC-c rows number their options 1-4
    (r"\boxed{2}", "2", 1.0),
    (r"\boxed{\text{(3)}}", "3", 1.0),
    ("reasoning\nANSWER: 4", "4", 1.0),
    (r"\boxed{2}", "B", 0.0),  # a digit is not mapped to a letter
    (r"\boxed{12}", "1", 0.0),
]


def misbehaving_grader(completion: str, gold: str) -> float:
    """Test grader: hangs, crashes or raises on request. The spawned workers can import this module because
    multiprocessing's spawn hands them the parent's sys.path, where pytest put this tests directory."""
    if completion == "hang":
        time.sleep(3600)
    if completion == "crash":
        os._exit(1)
    if completion == "raise":
        raise ZeroDivisionError
    if completion == "exit":
        raise SystemExit(0)
    return float(completion == gold)


@pytest.fixture(scope="module")
def pool():
    with GradingPool(num_workers=2, timeout=2.0) as p:
        yield p


@pytest.mark.parametrize(("completion", "gold", "expected"), MATH_CASES)
def test_grade_math(completion, gold, expected):
    assert grade_math(completion, gold) == expected


@pytest.mark.parametrize(("completion", "gold", "gated", "ungated"), THINK_CASES)
def test_grade_math_think_gate(completion, gold, gated, ungated):
    assert grade_math(completion, gold, think_gate=True) == gated
    assert grade_math(completion, gold) == ungated


@pytest.mark.parametrize(("completion", "gold", "expected"), CHOICE_CASES)
def test_grade_choice(completion, gold, expected):
    assert grade_choice(completion, gold) == expected


BOXED_CASES = [
    (r"\boxed{7} then \boxed{12}", "12", 1.0),  # only the last box counts (grade_math merges both: 0.0)
    (r"\boxed{12} then \boxed{7}", "12", 0.0),
    ("The answer is 12.", "12", 0.0),  # no box: incorrect, whatever the text says
    (r"so $\boxed{\frac{1}{2}}$.", "0.5", 1.0),
    (r"\boxed{12", "12", 0.0),  # unbalanced: no usable box
]


@pytest.mark.parametrize(("completion", "gold", "expected"), BOXED_CASES)
def test_grade_math_boxed(completion, gold, expected):
    assert grade_math_boxed(completion, gold) == expected


# The released evaluation grader's labels (oat_math_grader.boxed_reward_fn(completion, gold, fast=False), run on
# each case): grade_math_boxed must give the same. Issue #35's examples first.
RELEASED_CASES = [
    (r"\boxed{26000.}", "26000", 1.0),  # a trailing period inside the box (math-verify alone: 0)
    (r"\boxed{\frac{\sqrt{3}}{3}.}", r"\frac{\sqrt{3}}{3}", 1.0),
    (r"\boxed{\text{27}}", "27.0", 1.0),
    (r"\boxed{\frac{13}{4}.}", r"\frac{13}{4}", 0.0),  # (math-verify alone: 1)
    (r"\boxed{2^{10}}", "1024", 1.0),  # arithmetic for a numeric gold counts in evaluation (ebe365f refused it)
    (r"\boxed{10^3}", "1000", 1.0),
    (r"\boxed{3 \times 10^2}", "300", 1.0),
    (r"\boxed{1.5 \times 10^{-3}}", "0.0015", 1.0),
    (r"\boxed{\sqrt{4}}", "2", 1.0),
    (r"\boxed{\sqrt[3]{8}}", "2", 1.0),
    (r"\boxed{4!}", "24", 1.0),
    (r"\boxed{|-3|}", "3", 1.0),
    (r"\boxed{\log_2 8}", "3", 1.0),
    (r"\boxed{6 \cdot 2}", "12", 1.0),
    (r"\boxed{3 \times 10^{-3}}", "0.003", 1.0),
    (r"\boxed{4 \times 10^{5}}", "400000", 1.0),
    (r"The answer is $\boxed{x = 752 * -611 + 290}$.", "-459182", 1.0),
    (r"\boxed{y = 3 \cdot 4}", "12", 1.0),
    (r"\boxed{3 \cdot 4 + 0x}", "12", 1.0),
    # normalisations and their limits
    (r"\boxed{1,000}", "1000", 1.0),
    (r"\boxed{\dfrac{1}{2}}", "0.5", 1.0),
    (r"\boxed{50\%}", "50", 1.0),
    (r"\boxed{5 \text{ cm}}", "5", 1.0),
    (r"\boxed{45^\circ}", "45", 1.0),
    (r"\boxed{(3, \frac{\pi}{2})}", r"\left( 3, \frac{\pi}{2} \right)", 1.0),
    (r"\boxed{2, 1}", "1,2", 1.0),
    (r"\boxed{\frac{6}{8}}", r"\frac{3}{4}", 1.0),
    (r"\boxed{0.333333}", r"\frac{1}{3}", 1.0),
    (r"\boxed{1.2e1}", "12", 1.0),  # (math-verify alone: 0)
    (r"\boxed{evelyn}", r"\text{Evelyn}", 1.0),
    (r"\boxed{25}", "025", 1.0),
    (r"\boxed{21}", "21.0", 1.0),
    (r"\boxed{x=5}", "5", 1.0),
    (r"\boxed{12}", r"\boxed{12}", 1.0),  # a boxed gold is unboxed
    (r"\boxed{\sqrt{-1}}", "i", 0.0),
    (r"\boxed{3.14}", r"\pi", 0.0),
    # the last "\boxed" is the answer, and only as "\boxed{...}"
    (r"\fbox{12}", "12", 0.0),
    (r"\boxed{12} and \boxed 13", "12", 0.0),
    (r"x_{0} \boxed{x_{0} \cos (\omega t)+$ $\dot{x}_{0} \sin (\omega t) / \omega}",
     r"x_{0} \cos (\omega t)+$ $\dot{x}_{0} \sin (\omega t) / \omega", 1.0),  # the Minerva gold with "$ $"
]


@pytest.mark.parametrize(("completion", "gold", "expected"), RELEASED_CASES)
def test_grade_math_boxed_grades_as_the_released_grader(completion, gold, expected):
    assert grade_math_boxed(completion, gold) == expected


def test_oat_boxed_answer_finds_what_the_released_grader_finds():
    assert oat_boxed_answer(r"a \boxed{1} b \boxed{\frac{1}{2}} c") == r"\frac{1}{2}"
    assert oat_boxed_answer(r"\boxed{1} then \fbox{2}") == "1"  # an \fbox is looked for only without any \boxed
    assert oat_boxed_answer(r"\fbox{2}") is None  # and then not read
    assert oat_boxed_answer(r"\boxed{1} then \boxed 2") is None
    assert oat_boxed_answer(r"\boxed{12") is None and oat_boxed_answer("no box") is None
    assert oat_boxed_answer(r"\boxed{1} then \boxed{} ") == ""


def test_the_sympy_check_refuses_exponents_written_with_stars():
    # The released grader evaluates 9**9**9 in sympy (a number of 370 million digits) and hangs; "^" it refuses.
    start = time.monotonic()
    assert grade_math_boxed(r"\boxed{9**9**9}", r"\sqrt{2}") == 0.0
    assert time.monotonic() - start < 5
    assert grade_math_boxed(r"\boxed{2**(1/2)}", r"\sqrt{2}") == 1.0  # other exponents go to sympy, as released


def test_is_repetitive():
    assert is_repetitive("ab" * 80) and not is_repetitive("The quick brown fox jumps over the lazy dog, 0123456789.")


def test_choice_letter_is_what_grade_choice_grades():
    assert [choice_letter(c) for c in (r"\boxed{\textbf{(b)}}", "x\nANSWER: 3", "The answer is C")] == ["B", "3", ""]


def test_pool_matches_serial_grading(pool):
    completions, golds, expected = map(list, zip(*MATH_CASES))
    assert pool.grade(grade_math, completions, golds) == expected
    gated = pool.grade(grade_math, [c[0] for c in THINK_CASES], [c[1] for c in THINK_CASES], think_gate=True)
    assert gated == [c[2] for c in THINK_CASES]


def test_hanging_math_input_times_out(pool):
    # sympy evaluates 9^(9^9) when comparing it with sqrt(2); the pool's 2 s timeout fires before math-verify's own
    # 5 s one (against a numeric gold the expression is refused before any comparison).
    pool.pop_stats()
    assert pool.grade(grade_math, [r"\boxed{9^{9^{9}}}", r"\boxed{12}"], [r"\sqrt{2}", "12"]) == [0.0, 1.0]
    assert pool.pop_stats() == {"graded": 2, "timeouts": 1, "crashes": 0, "errors": 0}
    # the evaluation grader as well: its math-verify check runs without a timeout of its own (as the released one
    # effectively does: a signal cannot stop sympy's big-integer power), so the pool's timeout bounds it
    assert pool.grade(grade_math_boxed, [r"\boxed{9^{9^{9}}}", r"\boxed{12}"], ["12", "12"]) == [0.0, 1.0]
    assert pool.pop_stats() == {"graded": 2, "timeouts": 1, "crashes": 0, "errors": 0}


def test_hung_and_crashed_items_score_zero_and_the_pool_recovers(pool):
    pool.pop_stats()
    before = dict(pool.stats)
    start = time.monotonic()
    scores = pool.grade(misbehaving_grader, ["hang", "a", "crash", "raise", "b"], ["a", "a", "a", "a", "x"])
    # The margin covers restarting two workers, which takes seconds on a busy 2-core machine.
    assert time.monotonic() - start < pool.timeout + 15
    assert scores == [0.0, 1.0, 0.0, 0.0, 0.0]
    assert pool.pop_stats() == {"graded": 5, "timeouts": 1, "crashes": 1, "errors": 1}
    assert pool.stats == {"graded": before["graded"] + 5, "timeouts": before["timeouts"] + 1,
                          "crashes": before["crashes"] + 1, "errors": before["errors"] + 1}
    assert pool.grade(misbehaving_grader, ["a", "b", "c"], ["a", "b", "x"]) == [1.0, 1.0, 0.0]
    assert pool.pop_stats() == {"graded": 3, "timeouts": 0, "crashes": 0, "errors": 0}


def test_serial_pool_scores_exceptions_zero():
    serial = GradingPool(num_workers=0)
    assert serial.grade(misbehaving_grader, ["raise", "a"], ["a", "a"]) == [0.0, 1.0]
    assert serial.grade(grade_math, [r"\boxed{12}"], ["12"]) == [1.0]
    assert serial.stats == {"graded": 3, "timeouts": 0, "crashes": 0, "errors": 1}


@pytest.mark.parametrize("workers", [0, 2], ids=["in-process", "workers"])
def test_failures_are_kept_per_grader_with_the_first_traceback(workers):
    with GradingPool(num_workers=workers, timeout=5.0) as p:
        p.grade(misbehaving_grader, ["a", "raise", "raise"], ["a", "a", "a"], label="mine")
        p.grade(grade_math, [r"\boxed{1}"], ["1"])
        failures = p.pop_failures()
        assert p.pop_failures() == {}
    assert (failures["mine"].graded, failures["mine"].failed) == (3, 2)
    assert failures["mine"].first.startswith("ZeroDivisionError") and "in misbehaving_grader" in failures["mine"].first
    assert (failures["grade_math"].graded, failures["grade_math"].failed, failures["grade_math"].first) == (1, 0, None)


def test_every_failure_kind_is_counted_per_grader(pool):
    """Timed out, crashed, raised and exited (SystemExit) items are failures of their grader, each of its kind."""
    pool.pop_stats(), pool.pop_failures()
    scores = pool.grade(misbehaving_grader, ["crash", "hang", "raise", "exit", "a"], ["a"] * 5, label="mine")
    failures = pool.pop_failures()["mine"]
    assert scores == [0.0, 0.0, 0.0, 0.0, 1.0] and (failures.graded, failures.failed) == (5, 4)
    assert failures.kinds == {"crashed": 1, "timed out": 1, "raised": 1, "exited": 1}
    assert (failures.first_kind, failures.first) == ("crashed", "its grading worker died (exit code 1)")
    assert pool.pop_stats() == {"graded": 5, "timeouts": 1, "crashes": 1, "errors": 2}


def test_serial_pool_counts_a_grader_that_exits():
    serial = GradingPool(num_workers=0, timeout=5.0)
    assert serial.grade(misbehaving_grader, ["exit", "a"], ["a", "a"], label="mine") == [0.0, 1.0]
    failures = serial.pop_failures()["mine"]
    assert failures.kinds == {"exited": 1} and failures.first.startswith("SystemExit: 0")


def test_grade_rejects_mismatched_lengths(pool):
    with pytest.raises(ValueError, match="2 completions but 1 golds"):
        pool.grade(grade_math, ["1", "2"], ["1"])


def test_grading_from_other_threads(pool):
    # Off the main thread math-verify's signal timeouts would raise, and every answer would score 0.0.
    results = {}

    def work(key, completions):
        results[key] = grade_math(r"\boxed{\frac{1}{2}}", "0.5"), pool.grade(grade_math, completions, ["12"] * 4)

    threads = [threading.Thread(target=work, args=(k, [f"{k} {n}" for n in (12, 13, 12, 7)])) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results == {k: (1.0, [1.0, 0.0, 1.0, 0.0]) for k in range(3)}


def test_unimportable_grader_raises_and_close_stops_workers():
    ghost = types.ModuleType("exgrpo_test_ghost_module")  # importable here but not in a spawned worker
    exec("def grade(completion, gold):\n    return 1.0", ghost.__dict__)
    sys.modules[ghost.__name__] = ghost
    try:
        with GradingPool(num_workers=1) as p:
            with pytest.raises(RuntimeError, match="cannot load the grader"):
                p.grade(ghost.grade, ["a"], ["a"])
            assert p.grade(grade_math, ["12"], ["12"]) == [1.0]  # restarted after the error
            procs = [w.proc for w in p._workers]
            assert len(procs) == 1 and procs[0].poll() is None
        assert all(proc.poll() is not None for proc in procs)  # close() stopped the workers
    finally:
        del sys.modules[ghost.__name__]


def test_reward_functions_read_the_answer_column(pool):
    math_reward = MathReward(think_gate=True, pool=pool)
    completions = ["x </think> \\boxed{12}", "\\boxed{12}", "x </think> 13"]
    out = math_reward(prompts=["p"] * 3, completions=completions, completion_ids=[[1]] * 3, answer=["12"] * 3,
                      level=[1, 2, 3])
    assert out == [1.0, 0.0, 0.0]
    # the question's numbers come from the prompt: a copy of its arithmetic scores 0
    out = MathReward(pool=pool)(prompts=["Calculate 3 * 4.", "Calculate 3 * 4.", "How many months in a year?"],
                                completions=[r"\boxed{3 \cdot 4}", r"\boxed{12}", r"\boxed{3 \cdot 4}"],
                                completion_ids=None, answer=["12"] * 3)
    assert out == [0.0, 1.0, 1.0]
    with pytest.raises(TypeError, match="reads each question's numbers from its prompt, which must be text"):
        MathReward()(prompts=[[{"role": "user", "content": "3 * 4"}]], completions=["12"], completion_ids=None,
                     answer=["12"])
    with pytest.raises(ValueError, match="1 prompts but 2 completions"):
        MathReward()(prompts=["p"], completions=["12", "12"], completion_ids=None, answer=["12"] * 2)
    assert (MathReward.name, ChoiceReward.name) == ("math", "choice")
    out = ChoiceReward()(prompts=["p"] * 2, completions=[r"\boxed{B}", "ANSWER: c"], completion_ids=None,
                         answer=["B", "D"])
    assert out == [1.0, 0.0]


def brevity(prompts, completions, completion_ids, **columns):
    """No opinion (None) on empty completions; TRL skips those in the weighted sum."""
    return [None if c == "" else -0.1 * len(c) for c in completions]


def test_combine_rewards_weights_and_skips_none():
    completions = [r"\boxed{12}", r"\boxed{1}", ""]
    total, per_func = combine_rewards([MathReward(), brevity], [1.0, 0.5], ["p"] * 3, completions, [[1]] * 3,
                                      {"answer": ["12", "12", "12"]})
    np.testing.assert_allclose(per_func["math"], [1.0, 0.0, 0.0])
    np.testing.assert_allclose(per_func["brevity"], [-1.0, -0.9, np.nan])
    np.testing.assert_allclose(total, [1.0 - 0.5, -0.45, 0.0])
    assert list(per_func) == ["math", "brevity"]


def test_combine_rewards_rejects_wrong_lengths():
    def short(prompts, completions, completion_ids, **columns):
        return [1.0]

    with pytest.raises(ValueError, match="'short' returned 1 rewards for 2 completions"):
        combine_rewards([short], [1.0], ["p", "q"], ["a", "b"], [[1], [2]], {})


def test_items_queued_behind_a_lost_item_are_graded_on_a_new_worker(pool):
    """Workers get items ahead of time; when one hangs or dies, only its current item scores 0."""
    pool.pop_stats()
    completions = ["crash", "a", "crash", "b", "hang", "c", "a", "crash"]
    scores = pool.grade(misbehaving_grader, completions, ["a", "a", "a", "b", "a", "c", "a", "a"])
    assert scores == [0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0]
    assert pool.pop_stats() == {"graded": 8, "timeouts": 1, "crashes": 3, "errors": 0}


def test_serial_pool_stops_a_hung_item_at_its_timeout():
    serial = GradingPool(num_workers=0, timeout=1.0)
    start = time.monotonic()
    assert serial.grade(misbehaving_grader, ["a", "hang", "b"], ["a", "a", "b"]) == [1.0, 0.0, 1.0]
    assert time.monotonic() - start < 5
    assert serial.stats == {"graded": 3, "timeouts": 1, "crashes": 0, "errors": 0}
    assert serial.grade(grade_math, [r"\boxed{\frac{1}{2}}"], ["0.5"]) == [1.0]  # math-verify under the pool's timer


def test_serial_pool_with_a_timeout_refuses_other_threads():
    errors = []
    worker = threading.Thread(target=lambda: errors.append(pytest.raises(
        RuntimeError, GradingPool(num_workers=0).grade, grade_math, ["1"], ["1"])))
    worker.start()
    worker.join(timeout=60)
    assert "only the main thread receives" in str(errors[0].value)
