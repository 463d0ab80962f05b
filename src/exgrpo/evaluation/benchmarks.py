"""The paper's evaluation benchmarks (spec §8): a registry, and loaders for the ExGRPO parquet files or public HF sets.

In-distribution (graded as math): AIME24, AIME25, AMC, MATH-500, Minerva, OlympiadBench, all rows of
``test.id.parquet`` told apart by ``data_source``. Out-of-distribution (graded as multiple choice): ARC-c
(``ood.arc_c.parquet``) and GPQA-diamond (``ood.gpqa.parquet``). The parquet files replicate AIME/AMC rows ×32;
loading collapses them, so a benchmark is a list of distinct questions with each one's number of rows.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from exgrpo.data import DataError, Question, collapse_replicas, load_questions

ENV_DATA = "EXGRPO_BENCHMARKS"
ID_FILE = "test.id.parquet"


@dataclass(frozen=True)
class HFSource:
    """A public Hugging Face copy of a benchmark; `to_row` maps one dataset row to (user prompt, gold answer)."""

    path: str
    config: str | None
    split: str
    to_row: Callable[[dict, int], tuple[str, str]]


@dataclass(frozen=True)
class Benchmark:
    name: str
    column: str  # header in the paper's table
    file: str  # parquet file in the benchmark directory
    data_source: str  # `data_source` of its rows
    kind: str  # "math" (grade_math) or "choice" (grade_choice)
    ood: bool
    paper_samples: int  # samples per question in the paper (the replication in test.id.parquet)
    hf: HFSource


@dataclass
class BenchmarkData:
    benchmark: Benchmark
    items: list[tuple[Question, int]]  # distinct questions, with the number of rows each had in the source

    @property
    def questions(self) -> list[Question]:
        return [q for q, _ in self.items]

    @property
    def rows(self) -> int:
        return sum(n for _, n in self.items)


# --- Hugging Face row mappings (not exercised offline: `datasets` is optional) ------------------------------------


def _field(row: dict, names: Sequence[str], source: str):
    for name in names:
        if name in row and row[name] is not None:
            return row[name]
    raise DataError(f"{source}: row has none of the columns {list(names)} (columns: {sorted(row)})")


def _problem_answer(source: str, problem=("problem", "question"), answer=("answer",)):
    def to_row(row: dict, index: int) -> tuple[str, str]:
        gold = _field(row, answer, source)
        if isinstance(gold, list):  # OlympiadBench: final_answer is a list of "$...$" strings
            gold = ", ".join(str(a).strip().strip("$") for a in gold)
        return str(_field(row, problem, source)), str(gold)

    return to_row


def _arc_row(row: dict, index: int) -> tuple[str, str]:
    # The layout of ood.arc_c.parquet: question, blank line, one "L) text" line per option.
    options = "".join(f"{label}) {text}\n" for label, text in zip(row["choices"]["label"], row["choices"]["text"]))
    return f"{row['question']}\n\n{options}", row["answerKey"]


_GPQA_INSTRUCTION = (
    "Answer the following multiple choice question. The last line of your response should be of the following "
    "format: 'ANSWER: $LETTER' (without quotes) where LETTER is one of ABCD. Think step by step before answering."
)


def _gpqa_row(row: dict, index: int) -> tuple[str, str]:
    # GPQA stores the correct answer apart from the three wrong ones: shuffle them, seeded by the row index, so the
    # gold is not always A. (ood.gpqa.parquet's own permutation cannot be recovered from the public set.)
    options = [row["Correct Answer"], row["Incorrect Answer 1"], row["Incorrect Answer 2"], row["Incorrect Answer 3"]]
    order = list(range(4))
    random.Random(index).shuffle(order)
    lines = "\n".join(f"{'ABCD'[i]}) {options[j].strip()}" for i, j in enumerate(order))
    return f"{_GPQA_INSTRUCTION}\n\n{row['Question'].strip()}\n\n{lines}", "ABCD"[order.index(0)]


BENCHMARKS: dict[str, Benchmark] = {
    b.name: b
    for b in (
        Benchmark("aime24", "AIME24", ID_FILE, "aime", "math", False, 32,
                  HFSource("HuggingFaceH4/aime_2024", None, "train", _problem_answer("aime24"))),
        Benchmark("aime25", "AIME25", ID_FILE, "aime25", "math", False, 32,
                  HFSource("math-ai/aime25", None, "test", _problem_answer("aime25"))),
        Benchmark("amc", "AMC", ID_FILE, "amc", "math", False, 32,
                  HFSource("AI-MO/aimo-validation-amc", None, "train", _problem_answer("amc"))),
        Benchmark("math500", "MATH-500", ID_FILE, "math", "math", False, 1,
                  HFSource("HuggingFaceH4/MATH-500", None, "test", _problem_answer("math500"))),
        Benchmark("minerva", "Minerva", ID_FILE, "minerva", "math", False, 1,
                  HFSource("math-ai/minervamath", None, "test", _problem_answer("minerva"))),
        Benchmark("olympiad", "Olympiad", ID_FILE, "olympiad_bench", "math", False, 1,
                  HFSource("Hothan/OlympiadBench", "OE_TO_maths_en_COMP", "train",
                           _problem_answer("olympiad", ("question",), ("final_answer",)))),
        Benchmark("arc_c", "ARC-c", "ood.arc_c.parquet", "arc_c", "choice", True, 1,
                  HFSource("allenai/ai2_arc", "ARC-Challenge", "test", _arc_row)),
        Benchmark("gpqa", "GPQA", "ood.gpqa.parquet", "gpqa", "choice", True, 1,
                  HFSource("Idavidrein/gpqa", "gpqa_diamond", "train", _gpqa_row)),
    )
}
ID_BENCHMARKS = tuple(n for n, b in BENCHMARKS.items() if not b.ood)
OOD_BENCHMARKS = tuple(n for n, b in BENCHMARKS.items() if b.ood)


def resolve_benchmarks(spec: str) -> list[Benchmark]:
    """``"all"``, ``"id"``, ``"ood"`` or a comma list of names (groups may be mixed in), in registry order."""
    names: set[str] = set()
    for part in filter(None, (p.strip().lower() for p in spec.split(","))):
        if part == "all":
            names.update(BENCHMARKS)
        elif part in ("id", "ood"):
            names.update(ID_BENCHMARKS if part == "id" else OOD_BENCHMARKS)
        elif part in BENCHMARKS:
            names.add(part)
        else:
            raise ValueError(f"unknown benchmark {part!r}; known: {', '.join(BENCHMARKS)} (or all, id, ood)")
    if not names:
        raise ValueError(f"no benchmarks in {spec!r}")
    return [b for n, b in BENCHMARKS.items() if n in names]


def data_location(data: str | os.PathLike | None) -> Path:
    """`data`, else ``$EXGRPO_BENCHMARKS``; an error telling the user what to pass when neither is set."""
    if data is None:
        data = os.environ.get(ENV_DATA)
        if not data:
            raise FileNotFoundError(
                f"no benchmark data given: pass --data DIR (a directory with {ID_FILE}, ood.arc_c.parquet and "
                f"ood.gpqa.parquet, or one parquet file), set ${ENV_DATA}, or load the public sets with --hf"
            )
    path = Path(data).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"benchmark data not found: {path}")
    return path


def load_benchmarks(benchmarks: Sequence[Benchmark], data: str | os.PathLike | None = None) -> list[BenchmarkData]:
    """Load benchmarks from the verl/ExGRPO parquet files.

    `data` is a directory holding each benchmark's file (``Benchmark.file``) or a single file from which every
    benchmark takes the rows of its ``data_source`` (e.g. ``valid.parquet``). Each file is read once.
    """
    root = data_location(data)
    by_file: dict[Path, list] = {}
    out = []
    for b in benchmarks:
        path = root / b.file if root.is_dir() else root
        if not path.is_file():
            raise FileNotFoundError(f"benchmark {b.name!r} needs {b.file}, which is not in {root}")
        if path not in by_file:
            by_file[path] = load_questions(str(path))
        rows = [q for q in by_file[path] if q.columns.get("data_source") == b.data_source]
        if not rows:
            raise DataError(f"benchmark {b.name!r}: {path} has no rows with data_source {b.data_source!r}")
        out.append(BenchmarkData(b, collapse_replicas(rows)))
    return out


def load_benchmarks_hf(benchmarks: Sequence[Benchmark]) -> list[BenchmarkData]:
    """Load benchmarks from their public Hugging Face copies (`Benchmark.hf`); each question appears once."""
    try:
        import datasets
    except ImportError as e:
        raise ImportError("loading the benchmarks from Hugging Face needs the `datasets` package "
                          "(pip install datasets); or pass --data DIR with the ExGRPO parquet files") from e
    out = []
    for b in benchmarks:
        src = b.hf
        ds = datasets.load_dataset(src.path, src.config, split=src.split)
        questions = []
        for index, row in enumerate(ds):
            prompt, gold = src.to_row(dict(row), index)
            questions.append(Question(f"{b.name}/{index}", ({"role": "user", "content": prompt},), gold,
                                      {"data_source": b.data_source, "hf_dataset": src.path}))
        out.append(BenchmarkData(b, [(q, 1) for q in questions]))
    return out
