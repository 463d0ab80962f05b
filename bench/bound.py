"""A step against its matmul bound on the step's own shapes, per phase, for the demo setting and round five's study
setting; with `--base COMMIT`, that commit's code against the working tree's, one whole process after the other.

    .venv-vllm/bin/python bench/bound.py                          # both settings, the working tree
    .venv-vllm/bin/python bench/bound.py --base 814198f --steps 6 # an old commit first, then the working tree
    .venv-vllm/bin/python bench/bound.py --base HEAD --settings study --overrides train.compile=true

The settings (vLLM engine in process, bf16 engine and trainer, GRPO so that every step does the same work):
* demo: configs/demo.yaml, 6 questions x 8 rollouts of up to 24 tokens, LoRA r 32;
* study: round five's (experiments/round-five.yaml): three-term addition, up to 64 tokens.

The rate: each distinct matmul the step runs, timed here in bf16 at its own shape: decode (48 rows, one token each, by
every linear layer of SmolLM2-135M-Instruct, the LM head included), prefill (the 6 distinct prompts' tokens), and
the update's rows (prompt tokens once per group plus every completion token). The bound of a phase is its FLOPs at
those rates: rollout 2 flops per weight per token (prefill + decode), update 4 (forward; the backward's activation
gradient; LoRA's own weight gradients are under 1% and not counted); attention scores, norms and the optimizer are
not counted. The same FLOPs at a 1024^3 bf16 matmul's rate give the 1024^3 bound. Each phase's time is the median
of `time/rollout` and `time/update` over the steps after the first (vLLM compiles in the first); "step" is
`time/step`, whose bound is the two phases'.
One JSON line per measurement, then a table per commit and setting.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
COMMON = ["rollout.engine=vllm", "rollout.max_model_len=256", "rollout.generation_batch_size=48", "train.dtype=bf16",
          "experience.ratio=0", "eval.every=0", "logging.progress=false", "train.save_every=0"]
STUDY_DATA = ("reasoning_gym:basic_arithmetic?min_terms=3&max_terms=3&min_digits=1&max_digits=2&operators=+"
              "&allow_negation=false&allow_parentheses=false&size=820&seed=56")
SETTINGS = {"demo": COMMON,
            "study": COMMON + [f"data.train={STUDY_DATA}", "rollout.max_completion_length=64",
                               "objective.normalizer=64", "reward.truncated=fail", "train.learning_rate=1e-4"]}


def out(record: dict) -> None:
    print(json.dumps(record), flush=True)


def seconds_per_matmul(m: int, k: int, n: int, repeats: int = 10) -> float:
    """Median seconds of a bf16 (m, k) @ (k, n) matmul on this machine."""
    a, b = torch.randn(m, k, dtype=torch.bfloat16), torch.randn(k, n, dtype=torch.bfloat16)
    a @ b
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def linear_shapes() -> list[tuple[int, int]]:
    """(in, out) of every linear layer of SmolLM2-135M-Instruct, the LM head included."""
    from transformers import AutoConfig

    from exgrpo.models import smollm2_directory

    c = AutoConfig.from_pretrained(smollm2_directory())
    head_dim = c.hidden_size // c.num_attention_heads
    kv = c.num_key_value_heads * head_dim
    layer = [(c.hidden_size, c.hidden_size), (c.hidden_size, kv), (c.hidden_size, kv), (c.hidden_size, c.hidden_size),
             (c.hidden_size, c.intermediate_size), (c.hidden_size, c.intermediate_size),
             (c.intermediate_size, c.hidden_size)]
    return layer * c.num_hidden_layers + [(c.hidden_size, c.vocab_size)]


def phase_seconds(rows: int, shapes: list[tuple[int, int]], flops_per_weight: int, cache: dict) -> float:
    """Seconds of `rows` tokens through every linear layer at the measured rates of those shapes: a forward
    (flops_per_weight 2), or a forward and an activation gradient (4)."""
    total = 0.0
    for k, n in shapes:
        if (rows, k, n) not in cache:
            cache[(rows, k, n)] = seconds_per_matmul(rows, k, n)
        total += cache[(rows, k, n)] * flops_per_weight / 2
    return total


def bounds(metrics: dict, setting: str, shapes: list[tuple[int, int]], rate_1024: float, cache: dict) -> dict:
    """Each phase's bound on its own shapes and at the 1024^3 rate, from one step's token counts."""
    groups, k = 6, 8
    completion_tokens = round(metrics["tokens_per_second"] * metrics["time/step"])
    prompt_tokens = groups * PROMPT_TOKENS[setting]
    steps = max(1, round(completion_tokens / (groups * k)))  # mean decode steps of a row
    weights = sum(a * b for a, b in shapes)
    rollout = phase_seconds(prompt_tokens, shapes, 2, cache) + steps * phase_seconds(groups * k, shapes, 2, cache)
    update = phase_seconds(prompt_tokens + completion_tokens, shapes, 4, cache)
    tokens = prompt_tokens + completion_tokens
    return {"bound_rollout_s": rollout, "bound_update_s": update,
            "bound_rollout_1024_s": 2 * weights * tokens / rate_1024,
            "bound_update_1024_s": 4 * weights * tokens / rate_1024}


PROMPT_TOKENS: dict[str, int] = {}


def prompt_tokens(setting: str) -> int:
    """The mean prompt length of the setting's first 200 questions, as the model reads them."""
    from exgrpo.config import load_config
    from exgrpo.data import PromptEncoder, load_questions
    from exgrpo.models import load_policy

    config = load_config("demo", SETTINGS[setting] + ["logging.output_dir=unused"])
    encode = PromptEncoder.from_config(load_policy(config.model.name)[1], config.data)
    questions = list(load_questions(config.data.train, prompt_suffix=config.data.prompt_suffix))[:200]
    return round(statistics.mean(len(encode(q)) for q in questions))


def run(source: Path, setting: str, steps: int, extra: list[str]) -> list[dict]:
    """`exgrpo train` of the setting (plus `extra` overrides) with the code in `source`/src, as a whole process; its
    metrics lines."""
    run_dir = Path(tempfile.mkdtemp(prefix=f"exgrpo-bound-{setting}-"))
    try:
        env = {**os.environ, "PYTHONPATH": str(source / "src")}
        subprocess.run([sys.executable, "-m", "exgrpo", "train", "--config", "demo", *SETTINGS[setting], *extra,
                        f"train.steps={steps}", f"logging.output_dir={run_dir}", "--overwrite"],
                       cwd=source, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def measure(label: str, source: Path, setting: str, steps: int, shapes, rate_1024: float, cache: dict,
            extra: list[str]) -> dict:
    lines = run(source, setting, steps, extra)[1:]
    records = []
    for m in lines:
        records.append({"bench": "bound_step", "code": label, "setting": setting, "step": m["step"],
                        **{k: m[k] for k in ("time/step", "time/rollout", "time/update", "time/push",
                                             "rollout/logp_diff_mean") if k in m},
                        **bounds(m, setting, shapes, rate_1024, cache)})
        out(records[-1])
    summary = {k: statistics.median(r[k] for r in records) for k in records[0]
               if k.startswith(("time/", "bound", "rollout/"))}
    summary["bound_step_s"] = summary["bound_rollout_s"] + summary["bound_update_s"]
    summary["bound_step_1024_s"] = summary["bound_rollout_1024_s"] + summary["bound_update_1024_s"]
    out({"bench": "bound_summary", "code": label, "setting": setting, "steps": len(records), **summary})
    return summary


def table(label: str, setting: str, s: dict) -> str:
    rows = [("rollout", "time/rollout", "bound_rollout_s", "bound_rollout_1024_s"),
            ("update", "time/update", "bound_update_s", "bound_update_1024_s"),
            ("step", "time/step", "bound_step_s", "bound_step_1024_s")]
    lines = [f"{label}, {setting}: phase, seconds, bound on its shapes (ratio), bound at the 1024^3 rate (ratio)"]
    for name, t, b, b1024 in rows:
        lines.append(f"  {name:<8} {s[t]:7.2f} s  {s[b]:6.2f} s ({s[t] / s[b]:4.1f}x)  "
                     f"{s[b1024]:6.2f} s ({s[t] / s[b1024]:4.1f}x)")
    lines.append(f"  push {s.get('time/push', float('nan')):.2f} s; engine parity (rollout/logp_diff_mean) "
                 f"{s.get('rollout/logp_diff_mean', float('nan')):.4f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6, help="steps per run (the first is not counted)")
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--base", help="a commit to measure first, from a temporary worktree")
    parser.add_argument("--overrides", nargs="+", default=[], metavar="KEY=VALUE",
                        help="config overrides for the working tree's runs only (e.g. train.compile=true)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    rate_1024 = 2 * 1024**3 / seconds_per_matmul(1024, 1024, 1024, repeats=20)
    out({"bench": "matmul_gflops_bf16_1024", "gflops": rate_1024 / 1e9, "load": os.getloadavg()})
    shapes, cache = linear_shapes(), {}
    for setting in args.settings:
        PROMPT_TOKENS[setting] = prompt_tokens(setting)
    sources = [(" ".join(["working tree", *args.overrides]), ROOT, args.overrides)]
    base_dir = None
    if args.base:
        base_dir = Path(tempfile.mkdtemp(prefix="exgrpo-bound-base-"))
        subprocess.run(["git", "worktree", "add", "--detach", str(base_dir), args.base], cwd=ROOT, check=True,
                       capture_output=True)
        sources.insert(0, (args.base, base_dir, []))
    try:
        tables = [table(label, setting, measure(label, source, setting, args.steps, shapes, rate_1024, cache, extra))
                  for setting in args.settings for label, source, extra in sources]
    finally:
        if base_dir is not None:
            subprocess.run(["git", "worktree", "remove", "--force", str(base_dir)], cwd=ROOT, check=True)
    print("\n" + "\n\n".join(tables))


if __name__ == "__main__":
    main()
