"""What a run leaves is usable elsewhere and its inputs are read whole or refused (through the CLI, in-process):
checkpoints load with plain transformers, `exgrpo export`, unverified checkpoints, duplicate YAML keys, non-UTF-8
configs, eval's sampling values."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import run_cli
from transformers import AutoModelForCausalLM, AutoTokenizer

from exgrpo.models import load_policy
from transformers.utils import logging as transformers_logging

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--config", str(ROOT / "configs" / "tiny.yaml"), "logging.progress=false", "train.threads=1"]


def _train(run_dir, *extra):
    transformers_logging.enable_progress_bar()  # as a fresh process starts
    result = run_cli(["train", *TINY, "train.steps=1", f"logging.output_dir={run_dir}", *extra])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Writing model shards" not in result.stderr  # logging.progress=false: transformers' bars off too
    return run_dir / "checkpoints" / "step-000001"


def _logits(model, ids=((3, 4, 5, 6),)):
    with torch.no_grad():
        return model(torch.tensor(ids)).logits


def test_a_full_fine_tuning_checkpoint_loads_with_plain_transformers_and_exports(tmp_path):
    checkpoint = _train(tmp_path / "run")
    model = AutoModelForCausalLM.from_pretrained(checkpoint / "model")
    tokenizer = AutoTokenizer.from_pretrained(checkpoint / "model")
    assert "assistant" in tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                                        add_generation_prompt=True)
    out = tmp_path / "export"
    killed = tmp_path / ".export.tmp-999999999-abc"  # what an export killed mid-write leaves (no such pid)
    killed.mkdir()
    done = run_cli(["export", str(tmp_path / "run"), str(out)])
    assert done.returncode == 0 and "exported" in done.stderr, done.stderr
    assert not killed.exists() and not list(tmp_path.glob(".export.tmp-*"))
    assert torch.equal(_logits(AutoModelForCausalLM.from_pretrained(out)), _logits(model))
    assert AutoTokenizer.from_pretrained(out).chat_template == tokenizer.chat_template
    again = run_cli(["export", str(tmp_path / "run"), str(out)])
    assert again.returncode == 2 and f"{out} is not empty" in again.stderr


def test_a_lora_run_exports_merged_into_a_plain_model(tmp_path):
    checkpoint = _train(tmp_path / "run", "model.lora.r=4", "model.lora.alpha=8")
    adapter, _ = load_policy(str(checkpoint / "model"))
    out = tmp_path / "merged"
    unmerged = run_cli(["export", str(checkpoint), str(out)])
    assert unmerged.returncode == 0 and (out / "adapter_config.json").is_file()
    assert "a LoRA adapter on exgrpo's preset 'tiny" in unmerged.stderr  # plain peft cannot resolve the base
    # --overwrite replaces the adapter export whole: no adapter left to be applied on top of the merged weights
    assert run_cli(["export", str(checkpoint), str(out), "--merge", "--overwrite"]).returncode == 0
    assert not (out / "adapter_config.json").exists() and not (out / "adapter_model.safetensors").exists()
    torch.testing.assert_close(_logits(AutoModelForCausalLM.from_pretrained(out)), _logits(adapter))


@pytest.mark.parametrize("make_out, flags, message", [
    (lambda out: out.write_text("x"), [], "is a file; OUT must be a directory"),
    (lambda out: (out.mkdir(), (out / "notes.txt").write_text("x")), ["--overwrite"],
     "holds files that are not a model export (notes.txt)"),
    (lambda out: None, [], "no such run or checkpoint directory"),
])
def test_export_refuses_bad_targets_in_one_line(tmp_path, make_out, flags, message):
    out = tmp_path / "out"
    make_out(out)
    source = tmp_path / "nowhere" if "no such" in message else _train(tmp_path / "run")
    result = run_cli(["export", str(source), str(out), *flags])
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert not out.is_dir() or not list(out.glob("*.safetensors"))  # nothing written there


@pytest.mark.parametrize("out, message", [
    ("a-file/out", "cannot write the export to {out}: {tmp}/a-file is a file, not a directory"),
    ("/sys/exgrpo-export", "cannot write the export to {out}: "),  # a read-only place
    ("run/checkpoints/step-000001/model", "{out} is inside the checkpoints of the run {run}: an export never writes"),
    ("run/checkpoints/export", "{out} is inside the checkpoints of the run {run}"),
    ("run/checkpoints/step-000001/export", "{out} is inside the checkpoints of the run {run}"),
])
def test_export_never_writes_into_a_checkpoint_and_names_an_unwritable_place(tmp_path, out, message):
    checkpoint = _train(tmp_path / "run")
    (tmp_path / "a-file").write_text("x")
    before = sorted((p.relative_to(checkpoint), p.stat().st_mtime_ns) for p in checkpoint.rglob("*"))
    out = tmp_path / out
    result = run_cli(["export", str(tmp_path / "run"), str(out), "--overwrite"])
    assert result.returncode == 2, result.stderr
    assert message.format(out=out, run=tmp_path / "run", tmp=tmp_path) in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert sorted((p.relative_to(checkpoint), p.stat().st_mtime_ns) for p in checkpoint.rglob("*")) == before
    assert run_cli(["train", "--resume", str(tmp_path / "run"), "train.steps=1"]).returncode == 0  # still intact


@pytest.mark.parametrize("out, message", [
    ("run", "{out} holds {run}, which the export reads; OUT must be another directory"),
    (".", "{out} holds {run}, which the export reads"),
    ("other-run", "{out} is a run directory; an export never replaces a run"),
])
def test_export_never_replaces_a_run_or_its_own_source(tmp_path, out, message):
    _train(tmp_path / "run")
    _train(tmp_path / "other-run")
    (tmp_path / "config.json").write_text("{}")  # tmp_path looks like an earlier export to --overwrite
    out = tmp_path / out
    result = run_cli(["export", str(tmp_path / "run"), str(out), "--overwrite"])
    assert result.returncode == 2 and message.format(out=out, run=tmp_path / "run") in result.stderr, result.stderr
    assert (tmp_path / "run" / "metrics.jsonl").is_file() and (tmp_path / "other-run" / "checkpoints").is_dir()


def test_export_merge_of_a_full_fine_tuning_run_says_there_is_no_adapter(tmp_path):
    _train(tmp_path / "run")
    result = run_cli(["export", str(tmp_path / "run"), str(tmp_path / "out"), "--merge"])
    assert result.returncode == 0 and (tmp_path / "out" / "model.safetensors").is_file(), result.stderr
    assert "LoRA merged" not in result.stderr
    assert "--merge had nothing to merge: the checkpoint holds full weights (a full fine-tuning run, no LoRA " \
           "adapter)" in result.stderr


@pytest.mark.parametrize("command", ["export", "buffer"])
def test_a_live_run_read_from_outside_takes_the_next_intact_checkpoint_when_its_pick_is_pruned(tmp_path, monkeypatch,
                                                                                                command):
    """The run prunes the checkpoint `exgrpo export` (or `buffer`) picked while it reads it (done here, at the exact
    point, as the run's pruning does it: renamed away, then deleted): it reads the newest intact one instead."""
    import transformers

    run = tmp_path / "run"
    _train(run)
    assert run_cli(["train", "--resume", str(run), "train.steps=2"]).returncode == 0
    newest = run / "checkpoints" / "step-000002"
    original = transformers.AutoTokenizer.from_pretrained

    def pruned_while_read(path, *args, **kwargs):
        if Path(path).parent == newest:
            doomed = newest.rename(newest.parent / ".deleting-step-000002")
            shutil.rmtree(doomed)
        return original(path, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", pruned_while_read)
    result = run_cli(["export", str(run), str(tmp_path / "out")] if command == "export" else
                     ["buffer", str(run), "--json"])
    assert result.returncode == 0, result.stderr
    assert "step-000002 was pruned by its run while it was read; taking the run's newest intact checkpoint" \
        in result.stderr and "Traceback" not in result.stderr
    read = run / "checkpoints" / "step-000001"
    if command == "export":
        assert f"exported {read} to" in result.stderr
    else:
        assert json.loads(result.stdout)["checkpoint"] == str(read)
    assert not list(tmp_path.glob(".out.tmp-*"))


def test_a_checkpoint_without_a_manifest_is_resumed_unverified_not_deleted(tmp_path):
    run = tmp_path / "run"
    checkpoint = _train(run)
    (checkpoint / "manifest.json").unlink()  # as checkpoints written before manifests
    resumed = run_cli(["train", "--resume", str(run), "train.steps=2"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "has no manifest.json: resuming from it unverified" in resumed.stderr
    assert "resumed from" in resumed.stderr and (run / "checkpoints" / "step-000002").is_dir()
    shutil.rmtree(run / "checkpoints" / "step-000002")
    (checkpoint / "optimizer.pt").unlink()
    broken = run_cli(["train", "--resume", str(run), "train.steps=2"])
    assert broken.returncode == 2 and "no intact checkpoint to resume from" in broken.stderr
    assert "no manifest.json and no optimizer.pt" in broken.stderr and checkpoint.is_dir()  # nothing deleted


@pytest.mark.parametrize("text, message", [
    ("train:\n  steps: 3\nrollout:\n  num_generations: 4\ntrain:\n  steps: 5\n",
     "key 'train' appears twice in one mapping (lines 1 and 5)"),
    ("train:\n  steps: 3\n  steps: 4\n", "key 'steps' appears twice in one mapping (lines 2 and 3)"),
])
def test_a_key_given_twice_in_a_config_is_an_error_naming_both_lines(tmp_path, text, message):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    result = run_cli(["train", "--config", str(path)])
    assert result.returncode == 2 and message in result.stderr, result.stderr


def test_a_config_that_is_not_utf8_names_the_file_and_line(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_bytes(b"train:\n  steps: 3\n# caf\xe9\n")
    result = run_cli(["train", "--config", str(path)])
    assert result.returncode == 2 and f"{path} line 3: not UTF-8 text" in result.stderr, result.stderr


@pytest.mark.parametrize("flags, message", [
    (["--temperature", "0"], "--temperature must be a finite number > 0 (evaluation samples; there is no greedy"),
    (["--temperature", "-1"], "--temperature must be a finite number > 0"),
    (["--temperature", "nan"], "--temperature must be a finite number > 0"),
    (["--top-p", "-1"], "--top-p must be in (0, 1] (got -1.0)"),
    (["--top-p", "2"], "--top-p must be in (0, 1] (got 2.0)"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1 (got 0)"),
    (["--workers", "-1"], "--workers must be >= 0 (grading processes; 0 grades in-process) (got -1)"),
    (["--batch-size", "0"], "--batch-size must be >= 1 (sequences generated together) (got 0)"),
    (["--seed", "-1"], "--seed must be >= 0 (got -1)"),
    (["--samples", "0", "--limit", "-2"], "--samples must be >= 1 (got 0); --limit must be >= 1 (got -2)"),
    (["--output", "{tmp}/a-file"], "--output {tmp}/a-file: {tmp}/a-file is a file; --output must be a directory"),
    (["--output", "{tmp}/a-file/out"], "--output {tmp}/a-file/out: {tmp}/a-file is a file"),
    (["--output", "/sys/exgrpo-eval"], "--output /sys/exgrpo-eval: cannot write there ("),  # a read-only place
])
def test_eval_refuses_its_own_bad_flags_by_their_names_before_loading(tmp_path, flags, message):
    (tmp_path / "a-file").write_text("x")
    flags = [f.format(tmp=tmp_path) for f in flags]
    result = run_cli(["eval", "--model", str(tmp_path / "no-model"), "--data", str(tmp_path / "no-data"), *flags])
    assert result.returncode == 2 and message.format(tmp=tmp_path) in result.stderr, result.stderr
    assert "rollout." not in result.stderr and "no-model" not in result.stderr and "no-data" not in result.stderr


def _rows(path, n, start=0):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"prompt": [f"What is {i} + 1?" for i in range(start, start + n)],
                      "answer": [str(i + 1) for i in range(start, start + n)]})
    if path.suffix.lower() == ".jsonl":
        path.write_text("".join(f'{{"prompt": "What is {i} + 1?", "answer": "{i + 1}"}}\n'
                                for i in range(start, start + n)))
    else:
        pq.write_table(table, path)


def test_a_data_directory_is_read_whole_or_refused_naming_each_file(tmp_path):
    from exgrpo.data import load_questions

    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    for name, n in (("a.parquet", 10), ("sub/b.parquet", 20), ("C.PARQUET", 5), ("f.JSONL", 15)):
        _rows(data / name, n, start=100 * n)
    (data / "d.json").write_text("[]")
    (data / "e.csv").write_text("prompt,answer\n")
    refused = run_cli(["train", *TINY, f"data.train={data}", f"logging.output_dir={tmp_path / 'run'}"])
    assert refused.returncode == 2 and "2 of 6 files are neither .parquet nor .jsonl (d.json, e.csv)" in refused.stderr
    (data / "d.json").unlink()
    (data / "e.csv").unlink()
    questions = load_questions(str(data))
    assert len(questions) == 50 and questions.files == 4  # every row of every file, subdirectories included
    done = run_cli(["train", *TINY, f"data.train={data}", "data.holdout=0", "train.steps=1",
                    f"logging.output_dir={tmp_path / 'run'}"])
    assert done.returncode == 0 and f"data.train {data}: 50 questions from 4 files" in done.stderr, done.stderr


def test_a_jsonl_file_that_is_not_utf8_names_the_file_and_line(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_bytes(b'{"prompt": "What is 1 + 1?", "answer": "2"}\n{"prompt": "caf\xe9", "answer": "1"}\n')
    result = run_cli(["train", *TINY, f"data.train={path}", f"logging.output_dir={tmp_path / 'run'}"])
    assert result.returncode == 2 and f"{path} line 2: not UTF-8 text" in result.stderr, result.stderr


def test_the_demo_reports_a_run_whose_buffer_stays_empty(tmp_path):
    out = tmp_path / "demo"
    result = run_cli(["demo", *TINY, "experience.ratio=0", "train.steps=1", f"logging.output_dir={out}"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert (out / "buckets.png").stat().st_size > 1000 and "| steps | 1 |" in (out / "report.md").read_text()


@pytest.mark.parametrize("extra, note", [
    (["experience.start_threshold=0.99"],
     "the mixed phase never started: batch Pass@1 (batch/pass_at_1) reached at most"),
    (["experience.ratio=0"], None),  # GRPO asked for: nothing to say
])
def test_a_replay_phase_that_never_starts_is_said_at_the_end(tmp_path, extra, note):
    result = run_cli(["train", *TINY, "train.steps=2", f"logging.output_dir={tmp_path / 'run'}", *extra])
    assert result.returncode == 0, result.stderr[-3000:]
    said = [line for line in result.stderr.splitlines() if "mixed phase" in line]
    assert said == ([] if note is None else [said[0]]) and (note is None or note in said[0])
