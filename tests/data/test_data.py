"""Tests for exgrpo.data on the real benchmark files and on small hand-made files."""

import json
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from exgrpo.data import (
    conflicting_answers,
    DataError,
    Question,
    collapse_replicas,
    load_questions,
    parse_reasoning_gym_source,
    render_prompt,
    split_holdout,
)
from exgrpo.rewards import extract_final_answer, score_reasoning_gym

BENCH = Path("/work/shared/data/benchmarks")
needs_bench = pytest.mark.skipif(not BENCH.is_dir(), reason="shared benchmark files not available")
RG_SOURCE = "reasoning_gym:basic_arithmetic?size=20&seed=1&min_terms=2&max_terms=2&min_digits=1&max_digits=1"


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def verl_row(i, gt="42"):
    return {
        "data_source": "toy",
        "prompt": [{"role": "system", "content": "Think."}, {"role": "user", "content": f"What is {i}?"}],
        "reward_model": {"ground_truth": gt, "style": "rule"},
        "extra_info": {"index": i, "split": "default"},
    }


# --- real benchmark files ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def test_id():
    return load_questions(str(BENCH / "test.id.parquet"))


@needs_bench
def test_test_id_unique_problems_per_source(test_id):
    assert len(test_id) == 6023
    assert len({q.id for q in test_id}) == 6023  # replicas share data_source/index but get distinct ids
    unique = Counter(q.columns["data_source"] for q, _ in collapse_replicas(test_id))
    assert unique == {"amc": 83, "aime": 30, "aime25": 30, "olympiad_bench": 675, "math": 500, "minerva": 272}
    copies = {q.columns["data_source"]: n for q, n in collapse_replicas(test_id)}
    assert copies["aime"] == 32 and copies["math"] == 1


@needs_bench
def test_test_id_row_contents(test_id):
    q = test_id[0]
    assert q.id == "math/0"
    assert [m["role"] for m in q.messages] == ["system", "user"]
    assert q.answer == r"\left( 3, \frac{\pi}{2} \right)"
    assert q.columns["extra_info"] == {"index": 0, "split": "default"}
    assert "prompt" not in q.columns and "__index_level_0__" not in q.columns  # pandas index artefact dropped
    json.dumps(q.columns)
    # First copy keeps the clean id; collapse keeps the first id.
    first_ids = {q.id for q, _ in collapse_replicas(test_id)}
    assert all("#" not in i for i in first_ids)


@needs_bench
@pytest.mark.parametrize(
    "name,rows,source,answers",
    [
        ("ood.gpqa", 198, "gpqa", set("ABCD")),
        # 22 ARC-c rows number their options 1)-4), so their gold is a digit, not a letter.
        ("ood.arc_c", 1172, "arc_c", set("ABCD1234")),
    ],
)
def test_ood_files(name, rows, source, answers):
    qs = load_questions(str(BENCH / f"{name}.parquet"))
    assert len(qs) == rows and qs.skipped == 0
    assert {q.columns["data_source"] for q in qs} == {source}
    assert len({q.id for q in qs}) == rows
    assert {q.answer for q in qs} == answers


@needs_bench
def test_limit_and_prompt_suffix():
    qs = load_questions(str(BENCH / "ood.gpqa.parquet"), limit=3, prompt_suffix=" Box it.")
    assert len(qs) == 3
    assert all(q.messages[-1]["content"].endswith(" Box it.") for q in qs)
    assert not qs[0].messages[0]["content"].endswith(" Box it.")  # system message untouched


# --- small files: schemas -----------------------------------------------------------------------------------------


def test_trl_schema_jsonl(tmp_path):
    path = write_jsonl(
        tmp_path / "trl.jsonl",
        [
            {"prompt": "1+1?", "answer": "2"},
            {"prompt": [{"role": "user", "content": "2+2?"}], "solution": 4},  # numeric answer -> "4"
            {"prompt": "3*3?", "answer": 9.5, "solution": "long text"},  # 'answer' preferred over 'solution'
        ],
    )
    qs = load_questions(str(path))
    assert [q.id for q in qs] == ["trl/0", "trl/1", "trl/2"]
    assert qs[0].messages == ({"role": "user", "content": "1+1?"},)
    assert [q.answer for q in qs] == ["2", "4", "9.5"]
    assert qs[2].columns == {"answer": 9.5, "solution": "long text"}


def test_verl_parquet_and_directory(tmp_path):
    pq.write_table(pa.Table.from_pylist([verl_row(i) for i in range(3)]), tmp_path / "b.parquet")
    write_jsonl(tmp_path / "a.jsonl", [{"prompt": "x?", "answer": "1"}])
    (tmp_path / "notes.txt").write_text("not data")
    with pytest.raises(DataError, match=r"1 of 3 files are neither .parquet nor .jsonl \(notes.txt\)"):
        load_questions(str(tmp_path))  # read whole or refused: never a silent part
    (tmp_path / "notes.txt").unlink()
    qs = load_questions(str(tmp_path))
    assert [q.id for q in qs] == ["a/0", "toy/0", "toy/1", "toy/2"]  # files sorted; data_source wins over stem
    assert qs[1].answer == "42" and qs[1].messages[0]["role"] == "system"


def test_duplicate_ids_get_suffix(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [verl_row(5), verl_row(5), verl_row(6)])
    qs = load_questions(str(path))
    assert [q.id for q in qs] == ["toy/5", "toy/5#1", "toy/6"]
    assert [n for _, n in collapse_replicas(qs)] == [2, 1]


# --- small files: bad inputs --------------------------------------------------------------------------------------

BAD_ROWS = [
    ({"answer": "1"}, "field 'prompt' is missing"),
    ({"prompt": 7, "answer": "1"}, "field 'prompt' is of type int"),
    ({"prompt": [{"role": "user"}], "answer": "1"}, "field 'prompt[0].content' is missing"),
    ({"prompt": [{"role": "system", "content": "s"}], "answer": "1"}, "field 'prompt' has no 'user' message"),
    ({"prompt": "q"}, "field 'reward_model.ground_truth' is missing"),
    ({"prompt": "q", "reward_model": {"style": "rule"}}, "field 'reward_model.ground_truth' is missing"),
    (
        {"prompt": "q", "reward_model": {"ground_truth": ["1", "2"]}},
        "field 'reward_model.ground_truth' is of type list (expected a string answer; verl schema)",
    ),
    ({"prompt": "q", "reward_model": "1"}, "field 'reward_model' is of type str"),
    ({"prompt": "q", "answer": True}, "field 'answer' is of type bool"),
    ({"prompt": "q", "answer": ""}, "field 'answer' is an empty string"),
    ("{not json", "malformed JSON"),
    ("[1, 2]", "expected a JSON object, got list"),
]


@pytest.mark.parametrize("bad,message", BAD_ROWS)
def test_bad_row_names_file_row_field(tmp_path, bad, message):
    path = write_jsonl(tmp_path / "train.jsonl", [{"prompt": "ok", "answer": "1"}, "", bad])
    with pytest.raises(DataError) as err:
        load_questions(str(path))
    text = str(err.value)
    assert "train.jsonl row 1 (line 3)" in text and message in text  # the blank line 2 is not a row
    assert "expected" in text


def test_a_missing_numeric_answer_is_refused_and_integral_floats_read_as_integers(tmp_path):
    # what pandas writes for an int column with a missing value: floats, NaN for the missing one
    pq.write_table(pa.table({"prompt": ["a", "b", "c"], "answer": [1.0, 2.0, float("nan")]}), tmp_path / "nan.parquet")
    with pytest.raises(DataError, match=r"nan\.parquet row 2: field 'answer' is nan \(a missing value\)"):
        load_questions(str(tmp_path / "nan.parquet"))
    pq.write_table(pa.table({"prompt": ["a", "b"], "answer": [1.0, 2.0]}), tmp_path / "floats.parquet")
    assert [q.answer for q in load_questions(str(tmp_path / "floats.parquet"))] == ["1", "2"]
    path = write_jsonl(tmp_path / "x.jsonl", [{"prompt": "a", "answer": 2.5}, {"prompt": "b", "answer": -7}])
    assert [q.answer for q in load_questions(str(path))] == ["2.5", "-7"]


def test_bad_parquet_row(tmp_path):
    rows = [verl_row(0), verl_row(1, gt=None)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "v.parquet")
    with pytest.raises(DataError, match=r"v\.parquet row 1: field 'reward_model\.ground_truth' is missing .*verl"):
        load_questions(str(tmp_path / "v.parquet"))


def test_skip_invalid_counts(tmp_path, caplog):
    path = write_jsonl(tmp_path / "mix.jsonl", [{"prompt": "a", "answer": "1"}, "{bad", {"prompt": 3}, verl_row(2)])
    qs = load_questions(str(path), skip_invalid=True)
    assert [q.id for q in qs] == ["mix/0", "toy/2"] and qs.skipped == 2
    assert "skipped 2 invalid rows" in caplog.text
    bad_only = write_jsonl(tmp_path / "bad.jsonl", ["{bad"])
    with pytest.raises(DataError, match="no valid rows"):
        load_questions(str(bad_only), skip_invalid=True)


def test_empty_and_missing_sources(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match="empty.jsonl: no rows"):
        load_questions(str(tmp_path / "empty.jsonl"))
    (tmp_path / "empty.parquet").write_bytes(b"")
    with pytest.raises(DataError, match="empty.parquet: not a readable parquet file"):
        load_questions(str(tmp_path / "empty.parquet"))
    with pytest.raises(DataError, match="nope.parquet: no such file or directory"):
        load_questions(str(tmp_path / "nope.parquet"))
    for path_like in ("no_such_dir/", "a/b/c", "./x"):  # a path, never taken for a dataset name
        with pytest.raises(DataError, match="no such file or directory") as err:
            load_questions(path_like)
        assert "datasets" not in str(err.value)
    (tmp_path / "d").mkdir()
    with pytest.raises(DataError, match="no .parquet or .jsonl files"):
        load_questions(str(tmp_path / "d"))
    with pytest.raises(ValueError, match="limit"):
        load_questions(str(tmp_path / "empty.jsonl"), limit=0)


def test_hf_name_without_datasets_is_clear():
    try:
        import datasets  # noqa: F401
    except ImportError:
        with pytest.raises(DataError, match=r"some-org/some-dataset: no such file or directory .*as a Hugging "
                                             r"Face dataset name it would need the `datasets` package"):
            load_questions("some-org/some-dataset")
    else:
        pytest.skip("datasets is installed; the offline error path is not reachable")


# --- reasoning-gym ------------------------------------------------------------------------------------------------


def test_reasoning_gym_source_parsing():
    task, opts = parse_reasoning_gym_source("reasoning_gym:basic_arithmetic?size=3&seed=7&x=2.5&f=False&s=ab&o=+,-")
    assert task == "basic_arithmetic"
    assert opts == {"size": 3, "seed": 7, "x": 2.5, "f": False, "s": "ab", "o": ["+", "-"]}
    for bad in ("reasoning_gym:?size=1", "reasoning_gym:t?size", "reasoning_gym:t?a=1&a=2"):
        with pytest.raises(DataError):
            parse_reasoning_gym_source(bad)


def test_reasoning_gym_load_determinism_and_score():
    qs = load_questions(RG_SOURCE, prompt_suffix=" Answer with only the final number.")
    assert len(qs) == 20 and qs[3].id == "basic_arithmetic/1/3"
    assert qs == load_questions(RG_SOURCE, prompt_suffix=" Answer with only the final number.")
    assert [q.answer for q in qs] != [q.answer for q in load_questions(RG_SOURCE.replace("seed=1", "seed=2"))]
    q = qs[0]
    entry = q.columns["rg_entry"]
    assert q.messages[0]["content"] == entry["question"] + " Answer with only the final number."
    json.dumps(q.columns)
    assert entry["metadata"]["num_terms"] == 2 and entry["answer"] == q.answer
    assert score_reasoning_gym(f"<think>some work</think>\n{q.answer}", entry) == 1.0
    assert score_reasoning_gym(f"The result is \\boxed{{{q.answer}}}.", entry) == 1.0
    assert score_reasoning_gym(f"<answer>{int(q.answer) + 1}</answer>", entry) == 0.0
    # reasoning-gym's default scorer gives partial credit len(gold)/len(answer) when the gold is a substring.
    assert score_reasoning_gym(f"x = {q.answer}", entry) == pytest.approx(len(q.answer) / len(f"x = {q.answer}"))
    assert len(load_questions(RG_SOURCE, limit=4)) == 4


def test_reasoning_gym_bad_task_or_option():
    with pytest.raises(DataError, match="no_such_task"):
        load_questions("reasoning_gym:no_such_task?size=2")
    with pytest.raises(DataError, match="basic_arithmetic"):
        load_questions("reasoning_gym:basic_arithmetic?size=2&bogus_option=1")


def test_extract_final_answer():
    assert extract_final_answer("<think>\\boxed{1}</think> so \\boxed{\\frac{1}{2}} done") == "\\frac{1}{2}"
    assert extract_final_answer("a <answer> 3 </answer> b <answer>4</answer>") == "4"
    assert extract_final_answer("work\n\n  17  \n\n") == "17"
    assert extract_final_answer("") == ""


# --- prompts and splits -------------------------------------------------------------------------------------------

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    vocab.update({c: i + 3 for i, c in enumerate(sorted(set("abcdefghijklmnopqrstuvwxyz?0123456789 \n")))})
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")  # one token per character
    return PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=CHATML, unk_token="[UNK]")


MESSAGES = ({"role": "system", "content": "be brief"}, {"role": "user", "content": "hi?"})


def test_render_prompt(tokenizer):
    full = render_prompt(tokenizer, MESSAGES)
    assert full == "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi?<|im_end|>\n<|im_start|>assistant\n"
    no_sys = render_prompt(tokenizer, MESSAGES, remove_system=True, think_prefix="<think>\n")
    assert no_sys == "<|im_start|>user\nhi?<|im_end|>\n<|im_start|>assistant\n<think>\n"
    other = render_prompt(tokenizer, MESSAGES, system_prompt="other")
    assert other.startswith("<|im_start|>system\nother<|im_end|>") and "be brief" not in other


def test_render_prompt_think_prefix_not_doubled(tokenizer):
    tokenizer.chat_template = CHATML.replace("assistant\\n", "assistant\n<think>\\n")
    try:
        text = render_prompt(tokenizer, MESSAGES[1:], think_prefix="<think>\n")
        assert text.endswith("assistant\n<think>\n") and text.count("<think>") == 1
    finally:
        tokenizer.chat_template = CHATML


def test_render_prompt_without_template(tokenizer):
    from transformers import PreTrainedTokenizerFast

    bare = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer)
    with pytest.raises(ValueError, match="no chat template"):
        render_prompt(bare, MESSAGES)


def _q(i: int, text: str) -> Question:
    return Question(f"t/{i}", ({"role": "user", "content": text},), "1", {})


def test_split_holdout_keeps_replicas_together():
    qs = [_q(i, f"p{i % 10}") for i in range(40)]  # 10 distinct questions x4 replicas
    train, hold = split_holdout(qs, 3, seed=0)
    assert len(hold) == 12 and len(train) == 28
    assert not {q.text_key for q in train} & {q.text_key for q in hold}
    assert len({q.text_key for q in hold}) == 3
    assert [q.id for q in hold] == [q.id for q in split_holdout(qs, 3, seed=0)[1]]
    assert [q.id for q in hold] != [q.id for q in split_holdout(qs, 3, seed=1)[1]]
    with pytest.raises(ValueError):
        split_holdout(qs, 11, seed=0)


def test_a_prompt_with_two_answers_stays_on_one_side_of_the_split():
    qs = [_q(i, f"p{i % 10}") for i in range(20)]
    qs += [Question("t/x", qs[3].messages, "2", {}), Question("t/y", qs[7].messages, "5", {})]
    assert [[q.id for q in rows] for rows in conflicting_answers(qs)] == [["t/3", "t/13", "t/x"],
                                                                         ["t/7", "t/17", "t/y"]]
    for seed in range(5):
        train, hold = split_holdout(qs, 4, seed=seed)
        assert not {q.text_key[0] for q in train} & {q.text_key[0] for q in hold}


@needs_bench
def test_split_holdout_on_benchmark(test_id):
    train, hold = split_holdout(test_id, 100, seed=3)
    assert len(train) + len(hold) == len(test_id)
    assert len({q.text_key for q in hold}) == 100
    assert not {q.text_key for q in train} & {q.text_key for q in hold}
