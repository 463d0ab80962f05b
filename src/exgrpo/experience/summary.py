"""What an experience buffer holds, as plain data (the `exgrpo buffer` command prints it as tables or JSON):
questions and trajectories per bucket, the trajectories' ages and use counts, and a few questions' stored
trajectories with their recorded behaviour log-probs."""

from __future__ import annotations

from collections import Counter
from typing import Callable

import numpy as np

from exgrpo.experience.buffer import ExperienceBuffer
from exgrpo.records import Trajectory


def buffer_summary(buffer: ExperienceBuffer, step: int, examples: int = 3,
                   decode: Callable[[list[int]], str] | None = None) -> dict:
    """The buffer as it is before training step `step` (the steps done so far): ages are `step` minus the step
    that collected a trajectory. `examples` questions (those holding the most trajectories, then by id) are
    listed with every stored trajectory, decoded with `decode` when given."""
    stored = {qid: buffer.trajectories(qid) for qid in buffer.questions()}
    everything = [t for ts in stored.values() for t in ts]
    buckets = [{"k": k, "questions": len(ids), **_describe([t for qid in ids for t in stored[qid]], step)}
               for k, ids in buffer.buckets().items()]
    shown = sorted(stored, key=lambda qid: (-len(stored[qid]), qid))[:examples]
    return {
        "step": step,
        "num_generations": buffer.num_generations,
        "questions": len(buffer),
        "retired": buffer.num_retired,
        "tokens": buffer.num_tokens,
        **_describe(everything, step),
        "uses_histogram": {str(n): c for n, c in sorted(Counter(t.uses for t in everything).items())},
        "buckets": buckets,
        "examples": [{"question_id": qid, "bucket": buffer.bucket_of(qid),
                      "trajectories": [_trajectory(t, step, decode) for t in stored[qid]]} for qid in shown],
    }


def _describe(trajectories: list[Trajectory], step: int) -> dict:
    """Count, age (steps) and use statistics of a set of trajectories."""
    if not trajectories:
        return {"trajectories": 0}
    ages = np.array([step - t.step for t in trajectories])
    uses = np.array([t.uses for t in trajectories])
    return {"trajectories": len(trajectories), "age_min": int(ages.min()), "age_mean": round(float(ages.mean()), 2),
            "age_max": int(ages.max()), "uses_mean": round(float(uses.mean()), 2), "uses_max": int(uses.max()),
            "never_replayed": int((uses == 0).sum())}


def _trajectory(t: Trajectory, step: int, decode: Callable[[list[int]], str] | None) -> dict:
    out = {"collected_at_step": t.step, "age": step - t.step, "policy_version": t.version, "uses": t.uses,
           "tokens": len(t.token_ids), "logprob_mean": round(float(t.logprobs.mean()), 4),
           "logprob_sum": round(float(t.logprobs.sum()), 4)}
    if decode is not None:
        out["text"] = decode(t.token_ids.tolist())
    return out


def print_summary(summary: dict, source: str) -> None:
    """`buffer_summary` as rich tables: totals, one row per bucket, then the example questions' trajectories."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    s = summary
    console.print(f"[bold]{source}[/bold]: before step {s['step']}, K = {s['num_generations']}: {s['questions']} "
                  f"questions hold {s['trajectories']} trajectories ({s['tokens']} tokens); {s['retired']} retired")
    buckets = Table("k", "questions", "trajectories", "age min / mean / max", "uses mean / max", "never replayed",
                    title="buckets (age in steps; uses: steps that trained on a trajectory as a replay)")
    for b in s["buckets"] + [{"k": "all", "questions": s["questions"], **_totals(s)}]:
        age = f"{b['age_min']} / {b['age_mean']} / {b['age_max']}" if b["trajectories"] else "—"
        uses = f"{b['uses_mean']} / {b['uses_max']}" if b["trajectories"] else "—"
        buckets.add_row(str(b["k"]), str(b["questions"]), str(b["trajectories"]), age, uses,
                        str(b.get("never_replayed", "—")))
    console.print(buckets)
    for example in s["examples"]:
        table = Table("collected", "age", "version", "uses", "tokens", "mean log-prob", "text",
                      title=f"question {example['question_id']} (bucket {example['bucket']})")
        for t in example["trajectories"]:
            table.add_row(str(t["collected_at_step"]), str(t["age"]), str(t["policy_version"]), str(t["uses"]),
                          str(t["tokens"]), f"{t['logprob_mean']:.3f}", t.get("text", "").replace("\n", "⏎"))
        console.print(table)


def _totals(summary: dict) -> dict:
    keys = ("trajectories", "age_min", "age_mean", "age_max", "uses_mean", "uses_max", "never_replayed")
    return {k: summary[k] for k in keys if k in summary}
