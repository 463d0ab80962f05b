"""Benchmark test questions must not be trained on or used to select checkpoints (spec §9.16): find them by
content, not by file name.

`benchmark_questions.txt` (shipped with the package) lists a 64-bit SHA-256 prefix of every distinct user message
of the paper's benchmark files with the benchmark it belongs to; the texts themselves are not shipped. A question
matches when one of its user messages (without `data.prompt_suffix`), whitespace-collapsed and lower-cased, hashes
to a listed fingerprint. A benchmark question embedded in a longer message (another template around it) is not
found.
Regenerate the list with `python -m exgrpo.evaluation.contamination DIR` (DIR: the benchmark parquet files).
"""

from __future__ import annotations

import functools
import hashlib
import sys
import warnings
from pathlib import Path
from typing import Callable, Sequence

from exgrpo.data import DataError, Question, drop_long_prompts
from exgrpo.errors import ExgrpoWarning

FINGERPRINTS = Path(__file__).with_name("benchmark_questions.txt")


def fingerprint(text: str) -> str:
    return hashlib.sha256(" ".join(text.split()).lower().encode()).hexdigest()[:16]


@functools.lru_cache(maxsize=1)
def _known() -> dict[str, str]:
    lines = FINGERPRINTS.read_text().split("\n")
    return dict(line.split(" ", 1) for line in lines if line and not line.startswith("#"))


def benchmark_of(question: Question, suffix: str = "") -> str | None:
    """The benchmark a question's text comes from, or None; `suffix` was appended to its last user message."""
    known = _known()
    for m in question.messages:
        if m["role"] == "user":
            text = m["content"]
            for candidate in (text, text[: -len(suffix)] if suffix and text.endswith(suffix) else None):
                hit = candidate is not None and known.get(fingerprint(candidate))
                if hit:
                    return hit
    return None


def screen_benchmark_questions(questions: Sequence[Question], policy: str, where: str,
                               suffix: str = "") -> list[Question]:
    """Apply `data.benchmark_overlap` to a question set named `where` (loaded with prompt suffix `suffix`):
    "refuse" raises a DataError listing the first matches, "drop" returns the others with a warning that counts
    them (an error when none is left), "allow" returns all."""
    if policy == "allow":
        return list(questions)
    hits = [(q, b) for q in questions if (b := benchmark_of(q, suffix)) is not None]
    if not hits:
        return list(questions)
    examples = ", ".join(f"{q.id} ({b})" for q, b in hits[:3])
    if policy == "drop":
        if len(hits) == len(questions):
            raise DataError(f"{where}: all {len(questions)} questions are benchmark test questions (e.g. {examples}), "
                            "so data.benchmark_overlap=drop leaves none; use a disjoint set")
        warnings.warn(ExgrpoWarning(f"{where}: dropped {len(hits)} of {len(questions)} questions that are benchmark "
                                    f"test questions (data.benchmark_overlap=drop), e.g. {examples}"), stacklevel=2)
        dropped = {id(q) for q, _ in hits}
        return [q for q in questions if id(q) not in dropped]
    raise DataError(f"{where}: {len(hits)} of {len(questions)} questions are benchmark test questions, e.g. "
                    f"{examples}; use a disjoint set, or set data.benchmark_overlap to drop (skip them) or allow "
                    "(a deliberate contamination study)")


def usable_questions(questions: Sequence[Question], data, prompt_ids: Callable[[Question], list[int]],
                     which: str) -> list[Question]:
    """The questions of the `which` set a run may use, by its `data` settings (a DataConfig): benchmark test
    questions handled as data.benchmark_overlap says, and, with data.max_prompt_length, longer prompts dropped
    (released) with a warning."""
    kept = screen_benchmark_questions(questions, data.benchmark_overlap, f"{which} questions", data.prompt_suffix)
    return drop_long_prompts(kept, prompt_ids, data.max_prompt_length, which) if data.max_prompt_length else kept


def write_fingerprints(data_dir: str | Path) -> str:
    """The text of benchmark_questions.txt for the benchmark files in `data_dir`."""
    from exgrpo.evaluation.benchmarks import BENCHMARKS, load_benchmarks

    lines = {}
    for bench in load_benchmarks(list(BENCHMARKS.values()), data_dir):
        for q in bench.questions:
            for m in q.messages:
                if m["role"] == "user":
                    lines.setdefault(fingerprint(m["content"]), bench.benchmark.name)
    header = "# sha256(whitespace-collapsed, lower-cased user message)[:16] benchmark; see contamination.py\n"
    return header + "".join(f"{h} {b}\n" for h, b in sorted(lines.items()))


if __name__ == "__main__":
    sys.stdout.write(write_fingerprints(sys.argv[1]))
