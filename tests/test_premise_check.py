"""bench/premise_check.py's reading of a completion's working: which "lhs = rhs" it checks and how it classifies,
on completions of the kind SmolLM2-135M writes (issue #47's premise check), and the selection-rule comparison."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("premise_check", ROOT / "bench" / "premise_check.py")
premise_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(premise_check)


def checked(text):
    return [(s["text"], s["ok"]) for s in premise_check.steps(text)]


def test_chains_give_one_step_per_equals_sign():
    assert checked("So 20 + 67 + -59 = 20 + 67 - 59 = 20 - 9 = 11.") == [
        ("20 + 67 + -59 = 20 + 67 - 59", True), ("20 + 67 - 59 = 20 - 9", False), ("20 - 9 = 11.", True)]


def test_list_numbers_words_and_colons_do_not_spoil_a_step():
    assert checked("1. Add 23 and 71: 23 + 71 = 94\nStep 2. 94 + 60 = 154") == [
        ("23 + 71 = 94", True), ("2. 94 + 60 = 154", True)]
    assert checked("Step 1: 98 + 93 = 181, and 93 - 77 = 16") == [("98 + 93 = 181", False), ("93 - 77 = 16", True)]


def test_multiplication_signs_latex_parentheses_and_negatives():
    assert checked("23 x 23 = 669 and \\(5 \\times 3 = 15\\)") == [("23 x 23 = 669", False), ("(5 * 3 = 15", True)]
    assert checked("( -9 - 8 ) = -17, then -17 + 6 = -11, and 85 - -82 = 167") == [
        ("( -9 - 8 ) = -17", True), ("-17 + 6 = -11", True), ("85 - -82 = 167", True)]


@pytest.mark.parametrize("text", ["The final answer is 114.", "x = 5", "The answer = 21", "5 + 9 + 7 =", "21 = 21",
                                  "9 times 19 is 19"])
def test_no_checkable_step(text):
    assert premise_check.steps(text) == [] and premise_check.classify(text) == "no_working"


def test_classes():
    assert premise_check.classify("5 + 9 = 14, 14 + 7 = 21. The answer is 21.") == "valid"
    assert premise_check.classify("5 + 9 = 15, 15 + 7 = 21. The answer is 21.") == "lucky"


def test_rule_against_random_counts_only_mixed_questions():
    groups = [[(0.1, True), (0.9, False)],                 # lowest valid; a random pick is valid half the time
              [(0.2, False), (0.3, True), (0.4, True)],    # lowest invalid; random: 2/3
              [(0.5, True), (0.6, True)],                  # all valid: left out
              [(0.7, False)]]                              # one completion: left out
    got = premise_check.rule_vs_random(groups, seed=0, resamples=200)
    assert got["questions"] == 2
    assert got["p_valid_lowest"] == 0.5 and got["p_valid_random"] == pytest.approx((0.5 + 2 / 3) / 2, abs=1e-3)
    assert got["ci95"][0] <= got["difference"] <= got["ci95"][1]
    assert premise_check.rule_vs_random([[(0.1, True)]], seed=0) == {"questions": 0}
