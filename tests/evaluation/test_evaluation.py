"""Tests for the evaluation protocol: benchmark registry and loaders, graders on the real golds, metrics, CLI."""

import dataclasses
import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
from conftest import run_cli

from exgrpo.cli import main
from exgrpo.config import ExGRPOConfig
from exgrpo.data import Question
from exgrpo.errors import ExgrpoWarning
from exgrpo.evaluation import (EvalProtocol, avg_at_k, benchmark_metrics, evaluate_accuracy, evaluate_questions,
                               extract_answer, grader_for, grading_text, mean_pass_at_k, pass_at_k, report_ks)
from exgrpo.evaluation.benchmarks import BENCHMARKS, ENV_DATA, load_benchmarks, resolve_benchmarks
from exgrpo.evaluation.evaluate import group_averages, markdown_table
from exgrpo.records import Group, Member
from exgrpo.rewards import GradingPool, MathReward
from exgrpo.rewards.scorer import GroupScorer
from exgrpo.rollout import SamplingSettings, derive_seed

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT.parent / "shared" / "data" / "benchmarks"
needs_bench = pytest.mark.skipif(not BENCH.is_dir(), reason=f"benchmark parquet files not found at {BENCH}")

# (rows, distinct questions) per benchmark, from shared/data/benchmarks/README.md
README_COUNTS = {"aime24": (960, 30), "aime25": (960, 30), "amc": (2656, 83), "math500": (500, 500),
                 "minerva": (272, 272), "olympiad": (675, 675), "arc_c": (1172, 1172), "gpqa": (198, 198)}

# Golds that do not grade correct against themselves, documented in docs/evaluation.md: none under the released
# grader. (The Minerva gold with a stray "$ $", r"x_{0} \cos (\omega t)+$ $\dot{x}_{0} \sin (\omega t) / \omega",
# failed under math-verify alone; the released grader's string comparison accepts it.)
KNOWN_GAPS: dict[str, set[str]] = {}


@pytest.fixture(scope="module")
def bench_data():
    return {d.benchmark.name: d for d in load_benchmarks(list(BENCHMARKS.values()), BENCH)}


@pytest.fixture(scope="module")
def pool():
    with GradingPool(num_workers=2) as p:
        yield p


# --- registry and loaders on the real files ----------------------------------------------------------------------


@needs_bench
def test_rows_and_distinct_questions_match_the_data_readme(bench_data):
    counts = {name: (d.rows, len(d.items)) for name, d in bench_data.items()}
    assert counts == README_COUNTS


@needs_bench
def test_paper_preset_samples_are_the_replication_in_test_id(bench_data):
    for name, d in bench_data.items():
        assert {n for _, n in d.items} == {BENCHMARKS[name].paper_samples}, name


@needs_bench
def test_a_single_file_gives_each_benchmark_its_data_source_rows():
    (aime, math500) = load_benchmarks(resolve_benchmarks("aime24,math500"), BENCH / "valid.parquet")
    assert (aime.rows, len(aime.items), math500.rows) == (240, 30, 500)  # valid.parquet: AIME ×8
    with pytest.raises(Exception, match="benchmark 'gpqa'.*no rows with data_source 'gpqa'"):
        load_benchmarks(resolve_benchmarks("gpqa"), BENCH / "valid.parquet")


def test_missing_data_names_the_option(monkeypatch, tmp_path):
    monkeypatch.delenv(ENV_DATA, raising=False)
    with pytest.raises(FileNotFoundError, match="pass --data DIR"):
        load_benchmarks(resolve_benchmarks("math500"))
    with pytest.raises(FileNotFoundError, match="benchmark 'gpqa' needs ood.gpqa.parquet"):
        load_benchmarks(resolve_benchmarks("gpqa"), tmp_path)


def test_resolve_benchmarks():
    assert [b.name for b in resolve_benchmarks("id")] == ["aime24", "aime25", "amc", "math500", "minerva", "olympiad"]
    assert [b.name for b in resolve_benchmarks("gpqa, math500")] == ["math500", "gpqa"]  # registry order
    assert len(resolve_benchmarks("all")) == 8 and [b.name for b in resolve_benchmarks("ood")] == ["arc_c", "gpqa"]
    with pytest.raises(ValueError, match="unknown benchmark 'math'"):
        resolve_benchmarks("math")


# --- graders on the real golds: a sample of each benchmark by default, every gold with `-m exhaustive` -----------

SAMPLED_GOLDS = 50
sampled_or_every = pytest.mark.parametrize("exhaustive", [False, pytest.param(True, marks=pytest.mark.exhaustive)],
                                           ids=["sampled", "every"])


def _rows(data, exhaustive: bool) -> list[int]:
    """Every row, or a seeded sample of SAMPLED_GOLDS rows plus those of the documented gaps."""
    golds = [q.answer for q in data.questions]
    if exhaustive or len(golds) <= SAMPLED_GOLDS:
        return list(range(len(golds)))
    gaps = [i for i, g in enumerate(golds) if g in KNOWN_GAPS.get(data.benchmark.name, set())]
    return sorted(set(random.Random(0).sample(range(len(golds)), SAMPLED_GOLDS)) | set(gaps))


def _grade_golds(pool, data, completions_from, rows):
    golds = [data.questions[i].answer for i in rows]
    grader = grader_for(data.benchmark.kind, EvalProtocol())
    return golds, pool.grade(grader, ["\\boxed{" + g + "}" for g in completions_from(golds)], golds)


def _derangement(n: int, seed: int) -> list[int]:
    """A seeded permutation without fixed points: each question gets another question's gold."""
    order = list(range(n))
    random.Random(seed).shuffle(order)
    perm = [0] * n
    for j, i in enumerate(order):
        perm[i] = order[(j + 1) % n]
    return perm


@needs_bench
@sampled_or_every
@pytest.mark.parametrize("name", list(BENCHMARKS))
def test_golds_grade_correct_against_themselves(bench_data, pool, name, exhaustive):
    rows = _rows(bench_data[name], exhaustive)
    golds, grades = _grade_golds(pool, bench_data[name], lambda gs: gs, rows)
    failed = {g for g, x in zip(golds, grades) if x != 1.0}
    print(f"\n{name}: gold as completion {int(sum(grades))}/{len(golds)} correct; failing: {sorted(failed)}")
    assert failed == KNOWN_GAPS.get(name, set())


@needs_bench
@sampled_or_every
@pytest.mark.parametrize("name", list(BENCHMARKS))
def test_shuffled_golds_grade_near_zero(bench_data, pool, name, exhaustive):
    rows = _rows(bench_data[name], exhaustive)
    perm = _derangement(len(rows), seed=0)
    golds, grades = _grade_golds(pool, bench_data[name], lambda gs: [gs[j] for j in perm], rows)
    same = sum(golds[i] == golds[j] for i, j in enumerate(perm))  # another question with the very same gold
    print(f"\n{name}: shuffled golds {int(sum(grades))}/{len(golds)} correct; identical gold strings {same}")
    if BENCHMARKS[name].kind == "choice":  # a letter is right exactly when the other question's letter is the same
        assert sum(grades) == same
    else:  # equal values written differently (e.g. 0.5 and \frac12) may match too, but rarely
        assert same <= sum(grades) <= same + 0.01 * len(golds)


# --- metrics -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("n", "c", "k", "expected"), [
    (5, 0, 1, 0.0),
    (5, 5, 3, 1.0),
    (4, 1, 1, 0.25),
    (4, 2, 2, 1 - 1 / 6),  # 1 - C(2,2)/C(4,2)
    (10, 3, 5, 1 - 21 / 252),  # 1 - C(7,5)/C(10,5)
    (32, 1, 32, 1.0),
    (32, 0, 32, 0.0),
])
def test_pass_at_k_hand_computed(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_is_stable_for_large_n():
    assert pass_at_k(1000, 1, 1) == pytest.approx(0.001)
    exact = 1 - math.comb(900, 500) / math.comb(1000, 500)  # Python's exact integers as reference
    assert pass_at_k(1000, 100, 500) == pytest.approx(exact, rel=1e-12)
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)


def test_avg_and_pass_at_k_of_a_correctness_matrix():
    correct = np.array([[1, 0, 1, 1], [0, 0, 0, 0], [0, 1, 0, 0]], dtype=bool)
    assert avg_at_k(correct) == pytest.approx(4 / 12)
    # pass@2 per question: 1 - C(1,2)/C(4,2) = 1; 0; 1 - C(3,2)/C(4,2) = 1/2
    assert mean_pass_at_k(correct, 2) == pytest.approx((1 + 0 + 0.5) / 3)
    assert benchmark_metrics(correct) == pytest.approx(
        {"avg@4": 4 / 12, "pass@1": 4 / 12, "pass@2": 0.5, "pass@4": 2 / 3})
    assert report_ks(32) == [1, 2, 4, 8, 16, 32] and report_ks(1) == [1] and report_ks(6) == [1, 2, 4, 6]


def test_averages_and_table_blank_the_benchmarks_not_run():
    res = {"aime24": {"samples": 32, "metrics": {"avg@32": 0.25}},
           "math500": {"samples": 1, "metrics": {"avg@1": 0.5}},
           "gpqa": {"samples": 1, "metrics": {"avg@1": 0.3}}}
    summary = {"model": "m", "benchmarks": res, **group_averages(res)}
    assert summary["id_avg"] == pytest.approx(0.375) and summary["ood_avg"] == pytest.approx(0.3)
    lines = markdown_table([summary, {**summary, "model": "n"}]).splitlines()
    assert lines[0] == ("| Model | AIME24 | AIME25 | AMC | MATH-500 | Minerva | Olympiad | Avg | ARC-c | GPQA "
                        "| OOD Avg |")
    assert lines[2] == "| m | 25.0 |  |  | 50.0 |  |  | 37.5* |  | 30.0 | 30.0* |"
    assert lines[3].startswith("| n |") and "average over the benchmarks run only" in lines[-1]


# --- protocol, grading and the evaluation loop -------------------------------------------------------------------


def test_think_split_as_released_and_gate():
    p, gated = EvalProtocol(), EvalProtocol(think_gate=True)
    # a think prompt: "<think>\n" is prepended, and what follows the first "</think>" is graded, else the whole text
    assert grading_text("...assistant\n<think>\n", "a \\boxed{2} </think> \\boxed{1}", p) == " \\boxed{1}"
    assert grading_text("x<think>\n", "a </think> \\boxed{1} </think> 2", p) == " \\boxed{1} "
    assert grading_text("x<think>\n", "\\boxed{1} with no closing tag", p) == "<think>\n\\boxed{1} with no closing tag"
    # any other prompt: the completion as it is, "</think>" or not (the released script splits think prompts only)
    assert grading_text("...assistant\n", "a \\boxed{1}", p) == "a \\boxed{1}"
    assert grading_text("...assistant\n", "a \\boxed{2} </think> \\boxed{1}", p) == "a \\boxed{2} </think> \\boxed{1}"
    assert grading_text("x<think>\n", "a </think> \\boxed{1} </think> 2", gated) == " \\boxed{1} "
    assert grading_text("x<think>\n", "\\boxed{1} with no closing tag", gated) == ""


def test_a_box_inside_the_reasoning_is_not_graded():
    completion = "Let me see... so it is $\\boxed{104}$.\n</think>\n\nThe answer is $104$."
    protocol = EvalProtocol()
    assert grader_for("math", protocol)(grading_text("<|im_start|>assistant\n<think>\n", completion, protocol),
                                        "104") == 0.0


def test_extract_answer_is_what_is_graded():
    assert extract_answer("so \\boxed{3} then \\boxed{\\frac{1}{2}}", "math") == "\\frac{1}{2}"
    assert extract_answer("no box: 12", "math") == ""
    assert extract_answer("\\boxed{3} then \\boxed 4", "math") == ""  # the released grader reads no answer here
    assert extract_answer("\\boxed{\\text{(b)}}", "choice") == "B"
    assert extract_answer("thinking\nANSWER: 3", "choice") == "3"


class EchoTokenizer:
    """One token per character; the chat template is the user text plus a marker."""

    chat_template = "echo"

    def apply_chat_template(self, msgs, tokenize, add_generation_prompt):
        return "".join(m["content"] for m in msgs) + "|"

    def __call__(self, text, add_special_tokens):
        return {"input_ids": [ord(ch) for ch in text]}

    def decode(self, ids, skip_special_tokens=False):
        return "".join(map(chr, ids))


def boxed_on_even_samples(prompt_ids, n):
    """Answers question "q<i>" with \\boxed{<i>} on its even samples and \\boxed{wrong} on odd ones."""
    prompt = "".join(map(chr, prompt_ids))
    return [ord(ch) for ch in ("\\boxed{%s}" % prompt[1:-1] if n % 2 == 0 else "\\boxed{wrong}")], False


def _questions(n, source="heldout"):
    return [Question(f"{source}/{i}", ({"role": "system", "content": "S"}, {"role": "user", "content": f"q{i}"}),
                     str(i), {"data_source": source}) for i in range(n)]


def test_evaluate_questions_grades_every_sample_in_batches(scripted_engine):
    engine, batches = scripted_engine(boxed_on_even_samples), []
    result = evaluate_questions(engine, EchoTokenizer(), _questions(3), name="toy", kind="math", samples=4,
                                protocol=EvalProtocol(max_new_tokens=16), pool=GradingPool(num_workers=0), seed=7,
                                batch_size=4, on_batch=batches.append)
    assert result.correct.tolist() == [[True, False, True, False]] * 3  # the system message was removed
    assert [c[0] for c in engine.calls] == [4, 4, 4]
    assert engine.calls[0][1].temperature == 0.6 and engine.calls[0][1].max_new_tokens == 16
    seeds = [s for c in engine.calls for s in c[2]]
    assert len(set(seeds)) == 12 and seeds[:4] == [derive_seed(7, 0, s) for s in range(4)]
    records = [r for b in batches for r in b]
    expected = [(f"heldout/{i}", s) for i in range(3) for s in range(4)]
    assert sorted((r.question_id, r.sample) for r in records) == expected
    first = next(r for r in records if (r.question_id, r.sample) == ("heldout/2", 0))
    assert (first.completion, first.answer, first.gold, first.grade) == ("\\boxed{2}", "2", "2", 1.0)
    assert result.metrics()["avg@4"] == 0.5 and result.metrics()["pass@2"] == pytest.approx(1 - 1 / 6)


def test_evaluate_accuracy_grades_with_the_reward_functions(scripted_engine):
    engine = scripted_engine(boxed_on_even_samples)
    questions = [Question(f"h/{i}", ({"role": "user", "content": f"q{i}"},), str(i), {}) for i in range(3)]
    accuracy = evaluate_accuracy(engine, EchoTokenizer(), questions, [MathReward()], SamplingSettings(16),
                                 samples=4, seed=5)
    assert (accuracy.mean, accuracy.stderr, accuracy.num_questions, accuracy.per_question) == (0.5, 0.0, 3, [0.5] * 3)
    assert [c[0] for c in engine.calls] == [12]  # one engine call; the same seeds as evaluate_questions
    assert engine.calls[0][2] == [derive_seed(5, i, s) for i in range(3) for s in range(4)]
    assert str(accuracy) == "50.0% ± 0.0 (n=3×4)"
    # the first sample of each question (an even one: right), graded, for reading by hand
    assert [(s["question_id"], s["completion"], s["reward"]) for s in accuracy.samples] == \
        [(f"h/{i}", f"\\boxed{{{i}}}", 1.0) for i in range(3)]


def right_but_cut_on_even_samples(prompt_ids, n):
    """Answers question "q<i>" with \\boxed{<i>}, cut at the token cap (no EOS) on its even samples."""
    prompt = "".join(map(chr, prompt_ids))
    return [ord(ch) for ch in "\\boxed{%s}" % prompt[1:-1]], n % 2 == 0


@pytest.mark.parametrize("truncated", ["grade", "fail"])
def test_reward_truncated_fail_scores_a_cut_completion_as_wrong_in_training_and_evaluation(scripted_engine, truncated):
    reward = dataclasses.replace(ExGRPOConfig().reward, truncated=truncated, workers=0)
    scorer = GroupScorer.from_config([MathReward()], EchoTokenizer(), reward)
    questions = [Question(f"h/{i}", ({"role": "user", "content": f"q{i}"},), str(i), {}) for i in range(3)]
    groups = [Group(q, [0], [Member([ord(c) for c in f"\\boxed{{{i}}}"], truncated=k % 2 == 0) for k in range(4)])
              for i, q in enumerate(questions)]
    accuracy = evaluate_accuracy(scripted_engine(right_but_cut_on_even_samples), EchoTokenizer(), questions,
                                 scorer.reward_funcs, SamplingSettings(16), samples=4, seed=5,
                                 truncated_reward=scorer.truncated_reward)
    expected = [1.0, 1.0, 1.0, 1.0] if truncated == "grade" else [0.0, 1.0, 0.0, 1.0]
    assert scorer(groups, step=1).total.tolist() == [expected] * 3
    assert accuracy.mean == np.mean(expected)
    assert [(s["reward"], s["truncated"]) for s in accuracy.samples] == [(expected[0], True)] * 3  # sample 0: cut


# --- the command line --------------------------------------------------------------------------------------------


def test_eval_without_data_tells_the_user_to_pass_it(monkeypatch, capsys):
    monkeypatch.delenv(ENV_DATA, raising=False)
    assert main(["eval", "--model", "tiny", "--benchmarks", "math500"]) == 2
    assert "pass --data DIR" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["eval", "--model", "tiny", "--samples", "0"])


@pytest.mark.slow
@needs_bench
def test_eval_cli_end_to_end_with_two_models(tmp_path):
    out = tmp_path / "eval"
    proc = run_cli(["eval", "--model", "tiny", "--model", "tiny:1", "--benchmarks", "math500,gpqa", "--data",
                    str(BENCH), "--limit", "2", "--samples", "2", "--max-new-tokens", "8", "--workers", "1",
                    "--output", str(out)])
    assert proc.returncode == 0, proc.stderr
    table = proc.stdout.strip().splitlines()
    assert table[0].startswith("| Model | AIME24 |")
    assert [row.split("|")[1].strip() for row in table[2:4]] == ["tiny", "tiny:1"]
    for model in ("tiny", "tiny_1"):
        lines = [json.loads(x) for x in (out / model / "generations.jsonl").read_text().splitlines()]
        assert len(lines) == 2 * 2 * 2  # benchmarks × questions × samples
        assert set(lines[0]) == {"benchmark", "question_id", "sample", "completion", "answer", "gold", "grade",
                                 "truncated", "completion_tokens"}
        assert {(x["benchmark"], x["sample"]) for x in lines} == {(b, s) for b in ("math500", "gpqa") for s in (0, 1)}
        summary = json.loads((out / model / "summary.json").read_text())
        assert summary["benchmarks"]["gpqa"]["samples"] == 2 and "pass@2" in summary["benchmarks"]["gpqa"]["metrics"]
        assert summary["benchmarks"]["math500"]["grading"] == {"graded": 4, "timeouts": 0, "crashes": 0, "errors": 0}
    run = json.loads((out / "summary.json").read_text())
    assert [m["model"] for m in run["models"]] == ["tiny", "tiny:1"] and run["protocol"]["temperature"] == 0.6
    results = (out / "results.md").read_text()
    assert "exgrpo eval --model tiny" in results and table[0] in results


# --- benchmark questions in training or held-out data ------------------------------------------------------------


@needs_bench
def test_shipped_benchmark_fingerprints_match_the_benchmark_files():
    from exgrpo.evaluation.contamination import FINGERPRINTS, write_fingerprints

    assert FINGERPRINTS.read_text() == write_fingerprints(BENCH)


@needs_bench
def test_benchmark_questions_are_found_by_content():
    from exgrpo.data import DataError, load_questions
    from exgrpo.evaluation.contamination import benchmark_of, screen_benchmark_questions

    suffix = " Answer with only the final number."
    valid = load_questions(str(BENCH / "valid.parquet"), prompt_suffix=suffix)  # valid.parquet = the test questions
    assert {benchmark_of(q, suffix) for q in valid} == {"aime24", "aime25", "amc", "math500", "minerva", "olympiad"}
    assert benchmark_of(valid[0]) is None  # the suffix must be known to see through it
    user = next(m for m in valid[0].messages if m["role"] == "user")
    retyped = Question("mine/1", ({"role": "user", "content": "  " + user["content"].upper()[:-len(suffix)]},), "1", {})
    clean = Question("mine/2", ({"role": "user", "content": "What is 2 + 2?"},), "4", {})
    assert benchmark_of(retyped) == benchmark_of(valid[0], suffix)  # case and whitespace do not hide it
    with pytest.raises(DataError, match="held-out: 1 of 2 questions are benchmark test questions, e.g. mine/1"):
        screen_benchmark_questions([retyped, clean], "refuse", "held-out")
    with pytest.warns(ExgrpoWarning, match=r"x: dropped 1 of 2 questions that are benchmark test questions "
                                           r"\(data.benchmark_overlap=drop\), e.g. mine/1"):
        assert screen_benchmark_questions([retyped, clean], "drop", "x") == [clean]
    with pytest.raises(DataError, match="all 1 questions are benchmark test questions .* data.benchmark_overlap=drop "
                                        "leaves none"):
        screen_benchmark_questions([retyped], "drop", "x")
    assert screen_benchmark_questions([retyped, clean], "allow", "x") == [retyped, clean]
