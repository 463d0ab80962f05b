"""Question loading: parquet/jsonl files, Hugging Face datasets and reasoning-gym tasks, as one `Question` type.

Accepted row schemas:
* verl/ExGRPO: ``prompt`` = chat list of {role, content}, ``reward_model.ground_truth`` = answer, optional
  ``data_source`` and ``extra_info.index`` (used for the id);
* TRL: ``prompt`` = string or chat list, answer in ``answer`` (preferred) or ``solution``.
A string prompt becomes one user message. Numeric answers (int/float) are converted to str.

Ids are ``f"{data_source or file stem}/{extra_info.index or row number}"``. The ExGRPO benchmark files replicate
AIME/AMC rows x32 under one index, so a repeated id gets a ``#k`` suffix (k-th repeat); `collapse_replicas`
groups such rows back by content (`Question.text_key`).
"""

from __future__ import annotations

import json
import math
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, NamedTuple
from urllib.parse import unquote

from exgrpo.errors import ExgrpoError

logger = logging.getLogger(__name__)

RG_PREFIX = "reasoning_gym:"
_FILE_SUFFIXES = (".parquet", ".jsonl")
_PROMPT_EXPECTED = "a string or a non-empty list of {role, content} chat messages"


class DataError(ExgrpoError, ValueError):
    """A dataset row or source that cannot be turned into questions."""


@dataclass(frozen=True)
class Question:
    """One prompt with its gold answer; `columns` holds the row's other fields for reward functions."""

    id: str
    messages: tuple[dict, ...]
    answer: str
    columns: dict

    @property
    def text_key(self) -> tuple:
        """Hashable content key (messages, answer): equal for replicated rows whatever their ids."""
        return tuple((m["role"], m["content"]) for m in self.messages), self.answer


class QuestionSet(list):
    """A list of questions that also records how many invalid rows were skipped and how many files were read."""

    def __init__(self, questions: Iterable[Question] = (), skipped: int = 0, files: int = 0):
        super().__init__(questions)
        self.skipped, self.files = skipped, files


class _Row(NamedTuple):
    where: str  # location for error messages, e.g. "train.jsonl row 3 (line 4)"
    prefix: str  # default id prefix when the row has no data_source
    index: int  # row number within its file (0-based)
    data: Any  # the row, or the DataError met while reading it


def load_questions(
    source: str,
    *,
    split: str = "train",
    limit: int | None = None,
    skip_invalid: bool = False,
    prompt_suffix: str = "",
) -> QuestionSet:
    """Load questions from a .parquet/.jsonl file, a directory of them, ``reasoning_gym:<task>?...`` or a HF dataset.

    `split` is used for Hugging Face datasets only. `limit` keeps the first `limit` valid questions.
    `prompt_suffix` is appended to the last user message of every question (e.g. an answer-format instruction).
    Invalid rows raise `DataError`, or with `skip_invalid` are skipped and counted in the result's ``.skipped``.
    """
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be a positive integer or None, got {limit!r}")
    source = str(source)
    if source.startswith(RG_PREFIX):
        return _load_reasoning_gym(source, limit, prompt_suffix)
    path = Path(source).expanduser()
    if path.is_dir():
        files = _data_files(path)
        rows = (row for f in files for row in _read_file(f))
    elif path.is_file():
        if path.suffix.lower() not in _FILE_SUFFIXES:
            raise DataError(f"{source}: unsupported file type {path.suffix!r} (expected .parquet or .jsonl)")
        files, rows = [path], _read_file(path)
    elif path.suffix.lower() in _FILE_SUFFIXES or source.startswith((".", "/", "~")) or source.endswith("/") \
            or source.count("/") > 1 or "\\" in source:  # a path, so never a dataset name
        raise DataError(f"{source}: no such file or directory ({path.resolve()})")
    else:
        files, rows = [], _read_hf(source, split)
    questions = _build(rows, source, limit, skip_invalid, prompt_suffix)
    questions.files = len(files)
    return questions


def _data_files(directory: Path) -> list[Path]:
    """Every file below `directory` (recursively; extensions in any case), all of them .parquet or .jsonl: a file it
    could not read is named with the reason, never left out silently."""
    files = sorted(p for p in directory.rglob("*") if p.is_file())
    unread = [p for p in files if p.suffix.lower() not in _FILE_SUFFIXES]
    if unread:
        names = ", ".join(str(p.relative_to(directory)) for p in unread[:5]) + (" ..." if len(unread) > 5 else "")
        raise DataError(f"{directory}: {len(unread)} of {len(files)} files are neither .parquet nor .jsonl ({names}); "
                        "a data directory is read whole: move them out, or name the files to read")
    if not files:
        raise DataError(f"{directory}: directory has no .parquet or .jsonl files")
    return files


def _build(rows: Iterator[_Row], source: str, limit: int | None, skip_invalid: bool, suffix: str) -> QuestionSet:
    out = QuestionSet()
    seen_ids: set[str] = set()
    n_rows = 0
    for row in rows:
        n_rows += 1
        try:
            if isinstance(row.data, DataError):
                raise row.data
            q = _to_question(row, suffix)
        except DataError:
            if not skip_invalid:
                raise
            out.skipped += 1
            continue
        # Replicated rows share data_source/index; suffix repeats so ids stay unique but the first keeps the clean id.
        qid, k = q.id, 0
        while qid in seen_ids:
            k += 1
            qid = f"{q.id}#{k}"
        seen_ids.add(qid)
        out.append(Question(qid, q.messages, q.answer, q.columns))
        if limit is not None and len(out) >= limit:
            break
    if out.skipped:
        logger.warning("%s: skipped %d invalid rows, kept %d", source, out.skipped, len(out))
    if not out:
        if n_rows == 0:
            raise DataError(f"{source}: no rows (empty dataset)")
        raise DataError(f"{source}: no valid rows (all {n_rows} rows were invalid and skipped)")
    return out


def _read_file(path: Path) -> Iterator[_Row]:
    if path.suffix.lower() == ".jsonl":
        yield from _read_jsonl(path)
    else:
        yield from _read_parquet(path)


def _read_jsonl(path: Path) -> Iterator[_Row]:
    index = 0
    with path.open("rb") as f:
        for line_no, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{path} line {line_no}: not UTF-8 text ({e.reason} at byte {e.start} of the "
                                "line)") from None
            if not line.strip():  # blank lines (e.g. a trailing one) are not rows
                continue
            where = f"{path} row {index} (line {line_no})"
            try:
                data: Any = json.loads(line)
                if not isinstance(data, dict):
                    data = DataError(f"{where}: expected a JSON object, got {type(data).__name__}")
            except json.JSONDecodeError as e:
                data = DataError(f"{where}: malformed JSON ({e}; expected one JSON object per line)")
            yield _Row(where, path.stem, index, data)
            index += 1


def _read_parquet(path: Path) -> Iterator[_Row]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: not a readable parquet file ({e})") from e
    index = 0
    for batch in pf.iter_batches(batch_size=1024):
        for data in batch.to_pylist():
            yield _Row(f"{path} row {index}", path.stem, index, data)
            index += 1


def _read_hf(source: str, split: str) -> Iterator[_Row]:
    try:
        import datasets
    except ImportError as e:
        raise DataError(f"{source}: no such file or directory ({Path(source).resolve()}); as a Hugging Face "
                        "dataset name it would need the `datasets` package (pip install datasets)") from e
    ds = datasets.load_dataset(source, split=split)
    for index, data in enumerate(ds):
        yield _Row(f"{source}[{split}] row {index}", source, index, data)


def _to_question(row: _Row, suffix: str) -> Question:
    data, where = row.data, row.where
    if "prompt" not in data:
        raise _field_error(where, "prompt", "is missing", _PROMPT_EXPECTED)
    messages = _parse_messages(data["prompt"], where)
    if suffix:
        last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
        messages[last_user]["content"] += suffix
    answer = _parse_answer(data, where)

    extra = data.get("extra_info")
    index = extra.get("index") if isinstance(extra, dict) else None
    if isinstance(index, bool) or not isinstance(index, (int, str)) or index == "":
        index = row.index
    source = data.get("data_source")
    prefix = source if isinstance(source, str) and source else row.prefix
    # pandas writes its index as `__index_level_0__`; it is an artefact, not a dataset column.
    columns = {k: v for k, v in data.items() if k != "prompt" and not k.startswith("__index_level_")}
    columns = json.loads(json.dumps(columns, default=str))
    return Question(f"{prefix}/{index}", tuple(messages), answer, columns)


def _parse_messages(prompt: Any, where: str) -> list[dict]:
    if isinstance(prompt, str):
        if not prompt.strip():
            raise _field_error(where, "prompt", "is an empty string", _PROMPT_EXPECTED)
        return [{"role": "user", "content": prompt}]
    if not isinstance(prompt, (list, tuple)) or not prompt:
        problem = "is an empty list" if isinstance(prompt, (list, tuple)) else f"is {_type(prompt)}"
        raise _field_error(where, "prompt", problem, _PROMPT_EXPECTED)
    messages = []
    for i, m in enumerate(prompt):
        if not isinstance(m, dict):
            raise _field_error(where, f"prompt[{i}]", f"is {_type(m)}", "a {role, content} dict")
        for key in ("role", "content"):
            if key not in m or m[key] is None:
                raise _field_error(where, f"prompt[{i}].{key}", "is missing", "a string")
            if not isinstance(m[key], str):
                raise _field_error(where, f"prompt[{i}].{key}", f"is {_type(m[key])}", "a string")
        messages.append({"role": m["role"], "content": m["content"]})
    if not any(m["role"] == "user" for m in messages):
        raise _field_error(where, "prompt", "has no 'user' message", _PROMPT_EXPECTED)
    return messages


def _parse_answer(data: dict, where: str) -> str:
    if "reward_model" in data:
        rm, field, schema = data["reward_model"], "reward_model.ground_truth", "verl schema"
        if not isinstance(rm, dict):
            raise _field_error(where, "reward_model", f"is {_type(rm)}", "a dict with a 'ground_truth' string")
        value = rm.get("ground_truth")
    elif "answer" in data or "solution" in data:
        field = "answer" if "answer" in data else "solution"
        value, schema = data[field], "TRL schema"
    else:
        raise _field_error(
            where,
            "reward_model.ground_truth",
            "is missing",
            "a string answer in 'reward_model.ground_truth' (verl schema) or 'answer'/'solution' (TRL schema)",
        )
    if value is None:
        raise _field_error(where, field, "is missing", f"a string answer; {schema}")
    if isinstance(value, float) and not math.isfinite(value):  # pandas writes a missing int as NaN
        raise _field_error(where, field, f"is {value} (a missing value)", f"a string answer; {schema}")
    if isinstance(value, float) and value.is_integer():  # an int column with a missing value became floats
        value = int(value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str):
        raise _field_error(where, field, f"is {_type(value)}", f"a string answer; {schema}")
    if not value.strip():
        raise _field_error(where, field, "is an empty string", f"a string answer; {schema}")
    return value


def _field_error(where: str, field: str, problem: str, expected: str) -> DataError:
    return DataError(f"{where}: field '{field}' {problem} (expected {expected})")


def _type(value: Any) -> str:
    return "null" if value is None else f"of type {type(value).__name__}"


# --- reasoning-gym ---------------------------------------------------------------------------------------------


def parse_reasoning_gym_source(source: str) -> tuple[str, dict[str, Any]]:
    """Split ``reasoning_gym:<task>?k=v&...`` into (task, options); values become int/float/bool where they look it.

    A value with commas becomes a list (e.g. ``operators=+,-``). '+' is kept literally, not read as a space.
    """
    spec = source[len(RG_PREFIX) :] if source.startswith(RG_PREFIX) else source
    task, _, query = spec.partition("?")
    if not task:
        raise DataError(f"{source}: no reasoning-gym task name (expected reasoning_gym:<task>?size=N&seed=S&...)")
    options: dict[str, Any] = {}
    for part in filter(None, query.split("&")):
        key, eq, value = part.partition("=")
        key = unquote(key)
        if not eq or not key:
            raise DataError(f"{source}: option {part!r} is not of the form key=value")
        if key in options:
            raise DataError(f"{source}: option {key!r} is given twice")
        value = unquote(value)
        options[key] = [_parse_value(v) for v in value.split(",")] if "," in value else _parse_value(value)
    return task, options


def _parse_value(text: str) -> Any:
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _load_reasoning_gym(source: str, limit: int | None, suffix: str) -> QuestionSet:
    import reasoning_gym

    task, options = parse_reasoning_gym_source(source)
    # reasoning-gym draws a random seed when none is given; default to 0 so ids and questions are reproducible.
    options.setdefault("seed", 0)
    if limit is not None:
        options["size"] = min(options.get("size", limit), limit)
    try:
        dataset = reasoning_gym.create_dataset(task, **options)
    except (TypeError, ValueError, AssertionError) as e:
        raise DataError(f"{source}: cannot create reasoning-gym dataset {task!r} ({type(e).__name__}: {e})") from e
    seed = options["seed"]
    questions = QuestionSet()
    for i in range(len(dataset)):
        # JSON round trip: metadata holds tuples etc.; columns must be JSON-able for storage.
        entry = json.loads(json.dumps(dataset[i], default=str))
        messages = ({"role": "user", "content": entry["question"] + suffix},)
        columns = {"task": task, "rg_entry": entry}
        questions.append(Question(f"{task}/{seed}/{i}", messages, str(entry["answer"]), columns))
    if not questions:
        raise DataError(f"{source}: no rows (empty dataset)")
    return questions
