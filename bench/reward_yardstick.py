"""The training reward against a labelled set of real completions: how many correct answers it refuses (false
negatives) and how many wrong or absent ones it pays (false positives), beside the released reward (math-verify with
no question, as the released code grades).

bench/reward_labels.jsonl holds the set: real completions of SmolLM2-135M-Instruct (round five's logged samples, the
premise check's correct completions, the demo model's completions before and after `make demo`'s training) and
hand-written ones from hostile reads, each labelled by hand with the number it states as its answer (`stated`, null
for none). A completion is correct when what it states equals its gold. bench/harvest_completions.py says how the
set was built.

    PYTHONPATH=src HF_HUB_OFFLINE=1 .venv/bin/python bench/reward_yardstick.py [--grades out.json] [--compare old.json]

Prints a table per source, then every completion the training reward misgrades. `--grades` writes each row's grades;
`--compare` prints the rows whose training-reward grade differs from an earlier `--grades` file (a change to the
reward reports these flips in its commit).
"""

import argparse
import json
from collections import Counter
from pathlib import Path

from exgrpo.rewards import MathReward, grade_math

LABELS = Path(__file__).with_name("reward_labels.jsonl")


def is_correct(row: dict) -> bool:
    """Whether the number the completion states is its gold (1,071 and 1071, 5 and 5.0 alike)."""
    return row["stated"] is not None and float(row["stated"]) == float(row["gold"])


def grade(rows: list[dict]) -> list[dict]:
    """Each row's training-reward grade (MathReward: the question given) and released grade (no question)."""
    training = MathReward()(prompts=[r["question"] for r in rows], completions=[r["completion"] for r in rows],
                            completion_ids=None, answer=[r["gold"] for r in rows])
    return [{"id": r["id"], "training": t, "released": grade_math(r["completion"], r["gold"])}
            for r, t in zip(rows, training)]


def table(rows: list[dict], grades: list[dict]) -> str:
    """Per source and in all: rows, correct, and each reward's false negatives and false positives."""
    counts: dict[str, Counter] = {}
    for row, g in zip(rows, grades):
        c = counts.setdefault(row["source"], Counter())
        correct = is_correct(row)
        c["rows"] += 1
        c["correct"] += correct
        for reward in ("training", "released"):
            c[f"{reward} FN"] += correct and g[reward] == 0.0
            c[f"{reward} FP"] += not correct and g[reward] == 1.0
    counts["all"] = sum(counts.values(), Counter())
    columns = ["rows", "correct", "training FN", "training FP", "released FN", "released FP"]
    lines = [f"{'source':<20}" + "".join(f"{c:>13}" for c in columns)]
    lines += [f"{source:<20}" + "".join(f"{c[name]:>13}" for name in columns) for source, c in counts.items()]
    return "\n".join(lines)


def misgrades(rows: list[dict], grades: list[dict]) -> list[str]:
    """The training reward's misgrades, one line each."""
    out = []
    for row, g in zip(rows, grades):
        if is_correct(row) != (g["training"] == 1.0):
            kind = "FN" if is_correct(row) else "FP"
            out.append(f"{kind} {row['id']} (gold {row['gold']}, states {row['stated']}): "
                       + json.dumps(row["completion"][:160], ensure_ascii=False))
    return out


def earlier_grades(path: str, parser: argparse.ArgumentParser) -> dict[str, float]:
    """Each row's training grade in an earlier `--grades` file, by id; a file that is not one is a one-line error."""
    try:
        return {g["id"]: g["training"] for g in json.loads(Path(path).read_text())}
    except OSError as e:
        parser.error(f"--compare {path}: cannot read it ({e.strerror or e})")
    except (ValueError, TypeError, KeyError):
        parser.error(f"--compare {path}: expected an earlier --grades file (a JSON list of {{id, training, "
                     "released}), got something else")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--grades", help="write each row's grades to this JSON file")
    parser.add_argument("--compare", help="print the rows whose training grade differs from this --grades file")
    args = parser.parse_args(argv)
    before = earlier_grades(args.compare, parser) if args.compare else None  # read before the minutes of grading
    rows = [json.loads(line) for line in LABELS.read_text().splitlines() if line.strip()]
    grades = grade(rows)
    print(f"The training reward and the released reward on {len(rows)} labelled completions ({LABELS.name})\n")
    print(table(rows, grades))
    wrong = misgrades(rows, grades)
    print(f"\nThe training reward's misgrades ({len(wrong)}):", *wrong, sep="\n  ")
    if args.grades:
        Path(args.grades).write_text(json.dumps(grades, indent=0))
    if before is not None:
        by_id = {r["id"]: r for r in rows}
        flips = [g for g in grades if g["id"] in before and before[g["id"]] != g["training"]]
        print(f"\nFlips against {args.compare} ({len(flips)}):")
        for g in flips:
            row = by_id[g["id"]]
            print(f"  {g['id']}: {before[g['id']]} -> {g['training']} (gold {row['gold']}, states {row['stated']}): "
                  + json.dumps(row["completion"][:160], ensure_ascii=False))


if __name__ == "__main__":
    main()
