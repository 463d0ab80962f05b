"""`exgrpo eval`: models × benchmarks under one protocol, with generations, summaries and the paper's table.

Output directory layout::

    <output>/<model>/generations.jsonl   one line per sample (see `evaluation.Sample`)
    <output>/<model>/summary.json        per-benchmark metrics and the ID/OOD averages
    <output>/summary.json                every model's summary, the protocol and the command
    <output>/results.md                  the command, the protocol and the table (one row per model)
"""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
import sys
import time
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)

from exgrpo.evaluation.benchmarks import (BENCHMARKS, BenchmarkData, load_benchmarks, load_benchmarks_hf,
                                         resolve_benchmarks)
from exgrpo.evaluation.protocol import THINK, EvalProtocol, Sample, evaluate_questions
from exgrpo.data import PromptEncoder
from exgrpo.errors import ExgrpoError
from exgrpo.models import load_policy
from exgrpo.rewards import GradingPool
from exgrpo.rollout import build_engine, derive_seed


def run_eval(models: Sequence[str], data: Sequence[BenchmarkData], protocol: EvalProtocol, output: str | Path, *,
             samples: int | None = None, seed: int = 0, batch_size: int = 64, dtype: str = "float32",
             workers: int = 2, command: str = "", console: Console | None = None, engine: str = "hf") -> str:
    """Evaluate each model on each benchmark and write the outputs; returns the markdown table.

    Each question gets `samples` samples, or its benchmark's `paper_samples` when None (the paper preset).
    `engine` is "hf" (transformers generate) or "vllm".
    """
    console = console or Console()
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    summaries = []
    with GradingPool(num_workers=workers) as pool:
        for label, slug in zip(models, _slugs(models)):
            summaries.append(_evaluate_model(label, output / slug, data, protocol, pool, samples, seed, batch_size,
                                             dtype, console, engine))
    table = markdown_table(summaries)
    run = {"command": command, "protocol": dataclasses.asdict(protocol), "seed": seed, "models": summaries}
    (output / "summary.json").write_text(json.dumps(run, indent=2) + "\n")
    (output / "results.md").write_text(_results_markdown(table, summaries, protocol, command))
    return table


def _evaluate_model(label: str, out_dir: Path, data: Sequence[BenchmarkData], protocol: EvalProtocol,
                    pool: GradingPool, samples: int | None, seed: int, batch_size: int, dtype: str,
                    console: Console, engine_name: str) -> dict:
    """Every benchmark of `data` on model `label`; the engine is released whatever a benchmark raises."""
    out_dir.mkdir(parents=True, exist_ok=True)
    model, tokenizer = load_policy(label, dtype=dtype)
    model.to("cuda" if torch.cuda.is_available() else "cpu")
    engine = build_eval_engine(engine_name, model, tokenizer, data, protocol, batch_size, dtype)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[acc]}"),
               TimeElapsedColumn(), TimeRemainingColumn())
    try:
        with (out_dir / "generations.jsonl").open("w") as jsonl, Progress(*columns, console=console) as progress:
            results = {}
            for bench in data:
                results[bench.benchmark.name] = _evaluate_benchmark(
                    bench, engine, tokenizer, protocol, pool, samples or bench.benchmark.paper_samples, seed,
                    batch_size, jsonl, progress, f"{label} {bench.benchmark.name}")
                _warn_failed_gradings(console, label, bench.benchmark.name, results[bench.benchmark.name]["grading"])
    finally:
        engine.close()
        del model, engine  # free the weights before the next model loads
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    summary = {"model": label, "benchmarks": results, **group_averages(results)}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _evaluate_benchmark(bench: BenchmarkData, engine, tokenizer, protocol: EvalProtocol, pool: GradingPool,
                        samples: int, seed: int, batch_size: int, jsonl, progress: Progress,
                        description: str) -> dict:
    """One benchmark, `samples` per question: its summary entry; each graded batch goes to `jsonl` as it comes."""
    task = progress.add_task(description, total=len(bench.items) * samples, acc="")
    graded = [0, 0.0]  # samples so far, their grade sum

    def on_batch(records: list[Sample]) -> None:
        jsonl.writelines(json.dumps(dataclasses.asdict(r)) + "\n" for r in records)
        jsonl.flush()  # a long run that dies keeps what it generated
        graded[0] += len(records)
        graded[1] += sum(r.grade for r in records)
        progress.update(task, advance=len(records), acc=f"acc {100 * graded[1] / graded[0]:.1f}%")

    b = bench.benchmark
    start = time.perf_counter()
    # Seeded by the benchmark's registry position: its samples do not depend on which others run.
    result = evaluate_questions(engine, tokenizer, bench.questions, name=b.name, kind=b.kind, samples=samples,
                                protocol=protocol, pool=pool, batch_size=batch_size, on_batch=on_batch,
                                seed=derive_seed(seed, list(BENCHMARKS).index(b.name)))
    return {"questions": len(bench.items), "rows": bench.rows, "samples": samples, "metrics": result.metrics(),
            "grading": pool.pop_stats(), "wall_s": round(time.perf_counter() - start, 1)}


def _warn_failed_gradings(console: Console, label: str, benchmark: str, grading: dict[str, int]) -> None:
    """A sample whose grading timed out, crashed or raised counts as incorrect: say how many there were."""
    failed = {k: grading[k] for k in ("timeouts", "crashes", "errors") if grading.get(k)}
    if failed:
        console.print(f"[yellow]{label} {benchmark}: {failed} of {grading['graded']} gradings failed and count as "
                      "incorrect (docs/evaluation.md, \"Time, not labels\")[/yellow]")


def build_eval_engine(name: str, model, tokenizer, data: Sequence[BenchmarkData], protocol: EvalProtocol,
                      batch_size: int, dtype: str):
    """The evaluation engine `name` names; vllm sequences hold the longest rendered prompt + max_new_tokens."""
    max_model_len = None
    if name == "vllm":
        encode = PromptEncoder(tokenizer, remove_system=protocol.remove_system, system_prompt=protocol.system_prompt,
                               think_prefix=protocol.think_prefix)
        max_model_len = max(len(encode(q)) for d in data for q in d.questions) + protocol.max_new_tokens
    return build_engine(name, model, tokenizer, batch_size=batch_size, dtype=dtype, max_model_len=max_model_len)


def headline(result: dict) -> float:
    """A benchmark's table value: avg@k, the mean accuracy over its k samples per question."""
    return result["metrics"][f"avg@{result['samples']}"]


def group_averages(results: dict[str, dict]) -> dict:
    """Unweighted means of the headline values over the ID and the OOD benchmarks that were run (None if none)."""
    out = {}
    for group, ood in (("id", False), ("ood", True)):
        names = [n for n in results if BENCHMARKS[n].ood == ood]
        out[f"{group}_avg"] = float(np.mean([headline(results[n]) for n in names])) if names else None
        out[f"{group}_benchmarks"] = names
    return out


def markdown_table(summaries: Sequence[dict]) -> str:
    """The paper's columns (AIME24 … Olympiad, Avg, ARC-c, GPQA, OOD Avg), one row per model, in percent.

    Cells of benchmarks that were not run are blank; an average over only part of its group is marked with *.
    """
    id_names = [n for n, b in BENCHMARKS.items() if not b.ood]
    ood_names = [n for n, b in BENCHMARKS.items() if b.ood]
    header = ["Model", *(BENCHMARKS[n].column for n in id_names), "Avg", *(BENCHMARKS[n].column for n in ood_names),
              "OOD Avg"]
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    partial = False
    for s in summaries:
        res = s["benchmarks"]
        row = [s["model"]]
        for group, names in (("id", id_names), ("ood", ood_names)):
            row += [_pct(headline(res[n])) if n in res else "" for n in names]
            avg, ran = s[f"{group}_avg"], s[f"{group}_benchmarks"]
            star = "*" if avg is not None and len(ran) < len(names) else ""
            partial |= bool(star)
            row.append("" if avg is None else _pct(avg) + star)
        lines.append("| " + " | ".join(row) + " |")
    note = ["", "\\* average over the benchmarks run only, not the paper's full set."] if partial else []
    return "\n".join(lines + note) + "\n"


def _pct(x: float) -> str:
    return f"{100 * x:.1f}"


def _results_markdown(table: str, summaries: Sequence[dict], protocol: EvalProtocol, command: str) -> str:
    ks = {n: r["samples"] for n, r in summaries[0]["benchmarks"].items()} if summaries else {}
    cells = ", ".join(f"{BENCHMARKS[n].column} avg@{k}" for n, k in ks.items())
    proto = ", ".join(f"{f.name}={getattr(protocol, f.name)!r}" for f in dataclasses.fields(protocol))
    return f"# Evaluation\n\n```\n{command}\n```\n\nProtocol: {proto}\n\nCells: accuracy in %, {cells}.\n\n{table}"


def _slugs(labels: Sequence[str]) -> list[str]:
    """Directory names for the models: the label with path separators and odd characters replaced, made unique."""
    out: list[str] = []
    for label in labels:
        slug = re.sub(r"[^A-Za-z0-9._-]+", "_", label).strip("_.") or "model"
        base, i = slug, 1
        while slug in out:
            i += 1
            slug = f"{base}-{i}"
        out.append(slug)
    return out


# --- the command line --------------------------------------------------------------------------------------


def eval_command(args, argv: list[str]) -> int:
    """The paper's evaluation protocol (spec §8) for one or more models; prints the paper's table."""
    console = Console(stderr=True)  # progress and notes on stderr; the table alone on stdout
    try:
        benchmarks = resolve_benchmarks(args.benchmarks)
        data = load_benchmarks_hf(benchmarks) if args.hf else load_benchmarks(benchmarks, args.data)
    except (ValueError, FileNotFoundError, ImportError) as e:  # DataError is a ValueError
        print(f"exgrpo eval: {e}", file=sys.stderr)
        return 2
    if args.limit:
        for d in data:
            d.items = d.items[: args.limit]
    protocol = EvalProtocol(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                            remove_system=not args.keep_system, think_prefix=THINK if args.think else "",
                            think_gate=args.think_gate, last_box_only=not args.grade_all_text)
    command = "exgrpo " + shlex.join(argv)
    try:
        table = run_eval(args.model, data, protocol, args.output, samples=args.samples, seed=args.seed,
                         batch_size=args.batch_size, dtype=args.dtype, workers=args.workers, command=command,
                         console=console, engine=args.engine)
    except ExgrpoError as e:  # a model that cannot be found, an engine that cannot run it
        print(f"exgrpo eval: {e}", file=sys.stderr)
        return 2
    print(table)
    console.print(f"outputs: {args.output}")
    return 0
