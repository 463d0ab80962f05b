"""Reward grading throughput and worst-case latency: GradingPool serial (num_workers=0) vs worker processes.

    .venv/bin/python bench/rewards.py [--items 400] [--repeats 3] [--timeout 2]

One JSON line per measurement:

* "reward_startup": seconds until a pool's workers are ready (each is a fresh interpreter importing math-verify).
* "reward_throughput": gradings/s of `grade_math` over the same realistic batch, serial vs 1 and 2 workers
  (R repeats after a discarded warm-up pass, alternating; median), and the speed-ups over serial.
* "reward_serial_fresh_process": the serial loop in a fresh interpreter (a worker's work without the pipe), so
  that the 1-worker pool's deficit can be split into process effects and round-trip cost.
* "reward_ipc": ms per item with a grader that costs ~nothing (grade_choice), i.e. the pool's per-item round trip.
* "reward_adversarial": per adversarial input, the wall time of grading it alone in a warm 2-worker pool with
  `--timeout` seconds, its score, how long until the pool is ready again (the timed-out worker is replaced inside
  the call), and the same input in a batch with the realistic items (latency vs the batch without it).
* "reward_adversarial_serial": the same input graded serially (num_workers=0: math-verify's own 5 s SIGALRM
  timeouts, no pool deadline), in a child process that is killed after `--serial-limit` seconds.

The realistic batch mixes what policies emit on math data: bare numbers, "The answer is N.", \\boxed{} integers,
fractions, radicals and expressions, short chains of thought ending in a box, long LaTeX solutions, right and wrong,
against golds in the datasets' forms (integers, \\frac, \\sqrt, decimals, intervals).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

from exgrpo.rewards import GradingPool, grade_choice, grade_math

# graded against a gold that is not a number: against one, arithmetic is refused before math-verify compares
ADVERSARIAL_GOLD = "\\sqrt{2}"
ADVERSARIAL = {
    "power_tower": "\\boxed{9^{9^{9}}}",
    "power_tower_10": "The answer is $10^{10^{10}}$.",
    "factorial": "\\boxed{100000000!}",
    "deep_braces": "\\boxed{" + "{" * 5000 + "1" + "}" * 5000 + "}",
    "long_text": "1 + " * 20000 + "1",
}


def out(record: dict) -> None:
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in record.items()}), flush=True)


def realistic_batch(n: int, seed: int = 0) -> tuple[list[str], list[str]]:
    rng = random.Random(seed)
    completions, golds = [], []
    for i in range(n):
        a, b = rng.randint(1, 99), rng.randint(1, 99)
        right = rng.random() < 0.6
        value = a + b if right else a + b + rng.choice([-10, -1, 1, 2, 10])
        kind = i % 10
        if kind == 0:
            c, g = f"{value}", str(a + b)
        elif kind == 1:
            c, g = f"The answer is {value}.", str(a + b)
        elif kind == 2:
            c, g = f"{a} + {b} = {value}. So the final answer is \\boxed{{{value}}}.", str(a + b)
        elif kind == 3:
            p, q = rng.randint(1, 9), rng.randint(10, 20)
            c = f"Simplifying, the probability is \\boxed{{\\frac{{{p if right else p + 1}}}{{{q}}}}}."
            g = f"\\frac{{{p}}}{{{q}}}"
        elif kind == 4:
            k, m = rng.randint(2, 9), rng.choice([2, 3, 5, 7])
            c = f"Thus $x = {k}\\sqrt{{{m}}}$, i.e. \\boxed{{{k if right else k + 1}\\sqrt{{{m}}}}}"
            g = f"{k}\\sqrt{{{m}}}"
        elif kind == 5:
            c = f"Half of {2 * a} is {a}, so the answer is \\boxed{{{a / 4 if right else a / 4 + 1}}}"
            g = f"\\frac{{{a}}}{{4}}"
        elif kind == 6:
            c = f"The solution set is $x \\in \\boxed{{({a}, {a + b}]}}$" if right else f"\\boxed{{[{a}, {a + b})}}"
            g = f"({a}, {a + b}]"
        elif kind == 7:
            c = (f"Expanding, $(x+{a})(x-{b}) = x^2 + ({a - b})x - {a * b}$. " * 3
                 + f"The polynomial is \\boxed{{x^2 {'+' if a >= b else '-'} {abs(a - b) if right else 1}x - {a * b}}}")
            g = f"x^2 {'+' if a >= b else '-'} {abs(a - b)}x - {a * b}"
        elif kind == 8:
            steps = " ".join(f"Step {j}: we have ${j} \\cdot {a} = {j * a}$ and "
                             f"$\\sum_{{k=1}}^{{{j}}} k = {j * (j + 1) // 2}$." for j in range(1, 12))
            c, g = f"{steps} Therefore the total is $\\boxed{{{value}}}$.", str(a + b)
        else:
            c, g = f"Let me think. {a} plus {b}... I believe it is {value}, maybe.", str(a + b)
        completions.append(c)
        golds.append(g)
    return completions, golds


def timed_grade(pool: GradingPool, completions, golds) -> tuple[float, list[float]]:
    t = time.perf_counter()
    scores = pool.grade(grade_math, completions, golds)
    return time.perf_counter() - t, scores


def serial_adversarial(text: str, limit: float) -> dict:
    code = ("import sys, time; from exgrpo.rewards import grade_math; t = time.perf_counter(); "
            "s = grade_math(sys.argv[1], sys.argv[2]); print(time.perf_counter() - t, s)")
    t = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "-c", code, text, ADVERSARIAL_GOLD], capture_output=True, text=True,
                              timeout=limit)
        seconds, score = done.stdout.split()
        return {"finished": True, "seconds": float(seconds), "score": float(score)}
    except subprocess.TimeoutExpired:
        return {"finished": False, "seconds": time.perf_counter() - t, "killed_after_s": limit}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=2.0)
    parser.add_argument("--serial-limit", type=float, default=60.0)
    parser.add_argument("--skip-serial-adversarial", action="store_true")
    args = parser.parse_args()
    completions, golds = realistic_batch(args.items)

    pools = {0: GradingPool(num_workers=0, timeout=args.timeout)}
    for workers in (1, 2):
        pool = GradingPool(num_workers=workers, timeout=args.timeout)
        seconds, _ = timed_grade(pool, completions[:1], golds[:1])  # starts the workers
        out({"bench": "reward_startup", "workers": workers, "seconds": seconds})
        pools[workers] = pool
    runs: dict[int, list[float]] = {w: [] for w in pools}
    reference = None
    for r in range(args.repeats + 1):  # repeat 0 warms every process's lazy imports and parser caches
        for workers, pool in pools.items():
            seconds, scores = timed_grade(pool, completions, golds)
            reference = reference or scores
            if r == 0:
                continue
            runs[workers].append(seconds)
            out({"bench": "reward_run", "workers": workers, "repeat": r, "items": len(completions),
                 "seconds": seconds, "gradings_per_s": len(completions) / seconds,
                 "scores_equal_serial": scores == reference, "mean_score": sum(scores) / len(scores)})
    rate = {w: len(completions) / statistics.median(s) for w, s in runs.items()}
    out({"bench": "reward_throughput", "items": len(completions), "repeats": args.repeats,
         "serial_gradings_per_s": rate[0], "workers1_gradings_per_s": rate[1], "workers2_gradings_per_s": rate[2],
         "speedup_workers2_over_serial": rate[2] / rate[0], "speedup_workers1_over_serial": rate[1] / rate[0],
         "target_speedup_workers2": 1.7, "pool_timeouts": pools[2].stats["timeouts"] + pools[1].stats["timeouts"]})

    # the same serial loop in a fresh interpreter (what a worker runs, minus the pipe round trips)
    code = ("import sys, time; sys.path.insert(0, sys.argv[1]); from rewards import realistic_batch; "
            "from exgrpo.rewards import grade_math; c, g = realistic_batch(int(sys.argv[2])); rates = []\n"
            "for r in range(int(sys.argv[3]) + 1):\n"
            "    t = time.perf_counter(); [grade_math(a, b) for a, b in zip(c, g)]; "
            "rates.append(len(c) / (time.perf_counter() - t))\n"
            "print(sorted(rates[1:])[len(rates[1:]) // 2])")
    here = os.path.dirname(os.path.abspath(__file__))
    fresh = float(subprocess.run([sys.executable, "-c", code, here, str(args.items), str(args.repeats)],
                                 capture_output=True, text=True, check=True).stdout)
    out({"bench": "reward_serial_fresh_process", "items": len(completions), "gradings_per_s": fresh,
         "workers1_over_this": rate[1] / fresh})

    # per-item round trip: a grader that costs ~nothing (the multiple-choice letter regex)
    letters = [f"The answer is \\boxed{{{'ABCD'[i % 4]}}}" for i in range(len(completions))]
    cheap = {}
    for workers, pool in pools.items():
        t = time.perf_counter()
        pool.grade(grade_choice, letters, ["A"] * len(letters))
        cheap[workers] = time.perf_counter() - t
    out({"bench": "reward_ipc", "items": len(letters), "grader": "grade_choice",
         **{f"workers{w}_ms_per_item": 1e3 * s / len(letters) for w, s in cheap.items()}})

    pool = pools[2]
    batch_seconds, _ = timed_grade(pool, completions[:100], golds[:100])
    for name, text in ADVERSARIAL.items():
        alone, scores = timed_grade(pool, [text], [ADVERSARIAL_GOLD])
        t = time.perf_counter()
        timed_grade(pool, completions[:2], golds[:2])  # the pool is ready again (replacement done in the call)
        ready_after = time.perf_counter() - t
        mixed = completions[:50] + [text] + completions[50:100]
        mixed_golds = golds[:50] + [ADVERSARIAL_GOLD] + golds[50:100]
        with_adv, _ = timed_grade(pool, mixed, mixed_golds)
        record = {"bench": "reward_adversarial", "input": name, "chars": len(text), "timeout": args.timeout,
                  "workers": 2, "alone_seconds": alone, "score": scores[0],
                  "next_call_seconds": ready_after, "batch100_seconds": batch_seconds,
                  "batch100_plus_input_seconds": with_adv, "added_latency_s": with_adv - batch_seconds,
                  "within_timeout_plus_1s": alone <= args.timeout + 1.0}
        out(record)
    stats = pool.pop_stats()
    out({"bench": "reward_pool_stats", **stats})
    if not args.skip_serial_adversarial:
        for name, text in ADVERSARIAL.items():
            out({"bench": "reward_adversarial_serial", "input": name, "chars": len(text),
                 **serial_adversarial(text, args.serial_limit)})
    for p in pools.values():
        p.close()


if __name__ == "__main__":
    main()
