"""Every logged metric has a definition, and docs/metrics.md is the registry's current rendering."""

from pathlib import Path

from exgrpo.training.metrics import METRICS, definition, markdown

ROOT = Path(__file__).resolve().parents[2]


def test_docs_metrics_md_is_generated_from_the_registry():
    assert (ROOT / "docs" / "metrics.md").read_text() == markdown(), \
        "regenerate it: python -m exgrpo.training.metrics > docs/metrics.md"


def test_registry_patterns():
    assert definition("experience/bucket_3").name == "experience/bucket_{k}"
    assert definition("experience/bucket_3/x") is None and definition("no_such_metric") is None
    assert len({m.name for m in METRICS}) == len(METRICS)


def test_a_metrics_file_written_before_a_rename_reads_under_the_new_names(tmp_path):
    from exgrpo.runtime.tracking import RENAMED_METRICS, read_metrics

    assert all(definition(new) and not definition(old) for old, new in RENAMED_METRICS.items())
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "batch/solved": 0.5, "coverage/solved": 3.0}\n{"step": 2, "batch/pass_at_1": 0.25}\n')
    assert read_metrics(path) == [{"step": 1, "batch/pass_at_1": 0.5, "coverage/ever_correct": 3.0},
                                  {"step": 2, "batch/pass_at_1": 0.25}]


def test_every_key_a_mixed_phase_run_logs_is_defined(tiny_policy, questions, tmp_path):
    """A tiny run through warm-up, the switch and replays, with held-out evaluation and replica checks."""
    from exgrpo.config import config_from_dict
    from exgrpo.runtime.tracking import read_metrics
    from exgrpo.training.trainer import ExGRPOTrainer

    config = config_from_dict({
        "rollout": {"num_generations": 4, "max_completion_length": 4},
        "train": {"steps": 4, "prompts_per_step": 4, "mini_batches": 2, "micro_batch_size": 8, "learning_rate": 1e-3,
                  "check_replicas": True, "save_every": 0},
        "experience": {"start_threshold": 0.0},
        "eval": {"every": 2, "samples": 1},
        "logging": {"output_dir": str(tmp_path / "run"), "progress": False, "tensorboard": False, "sample_every": 2},
    })
    model, tokenizer = tiny_policy

    def lowercase_first(prompts, completions, completion_ids, answer, **_):
        return [float(c[:1].islower()) for c in completions]

    trainer = ExGRPOTrainer(model, tokenizer, [lowercase_first], config, questions(12), eval_dataset=questions(2, "h"))
    history = trainer.train()
    keys = {k for m in history for k in m} | {"step", "time"}
    assert "replay/ratio_mean" in keys and "eval/accuracy" in keys  # the run reached replays and evaluation
    assert not [k for k in keys if definition(k) is None]
    samples = read_metrics(tmp_path / "run" / "samples.jsonl")
    assert {s["step"] for s in samples} == {2, 4} and all(isinstance(s["truncated"], bool) for s in samples)
    held_out = read_metrics(tmp_path / "run" / "eval_samples.jsonl")  # each evaluation's graded completions
    assert [(s["step"], s["question_id"]) for s in held_out] == [(2, "h0"), (2, "h1"), (4, "h0"), (4, "h1")]
    assert all(s["reward"] == float(s["completion"][:1].islower()) for s in held_out)
    # with every advantage 0 an optimizer step is counted; with a spread in every group none is
    flat = [m for m in history if m["frac_reward_zero_std"] == 1.0]
    spread = [m for m in history if m["frac_reward_zero_std"] == 0.0]
    assert all(m["zero_advantage_steps"] == 2.0 for m in flat) and all(m["zero_advantage_steps"] == 0 for m in spread)


def test_the_progress_line_fits_80_columns_with_every_figure(tmp_path):
    import io

    from rich.console import Console

    from exgrpo.runtime.tracking import Tracker

    tracker = Tracker(tmp_path, 1000, tensorboard=False, progress=True, start_step=998)
    try:
        tracker.log(999, {"reward": 0.25, "phase": "mixed", "experience/questions": 1234,
                          "experience/trajectories": 5678})
        screen = Console(width=80, file=io.StringIO(), record=True)
        screen.print(tracker._progress.make_tasks_table(tracker._progress.tasks))
    finally:
        tracker.close()
    line = screen.export_text().rstrip("\n")
    assert "\n" not in line and "…" not in line, line
    for figure in ("step  999/1000", "reward 0.25", "mixed", "buffer 1234q/5678t", "ETA"):
        assert figure in line, line
