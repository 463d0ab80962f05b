"""Atomic checkpoints that restore everything a run needs to continue exactly.

A checkpoint is a directory `checkpoints/step-NNNNNN/` holding:
* `model/`: `save_pretrained` output (full weights, or the adapter for LoRA) with the tokenizer and its chat
  template, loadable by `exgrpo eval --model`, plain transformers and (full weights) vLLM;
* `optimizer.pt`: the trainer state's `optimizer` part (optimizer, scheduler) and the torch RNG state;
* `buffer.safetensors`: the experience buffer (arrays + JSON metadata), written and read by the functions the
  caller hands in (as it hands in the model writer), so this module knows nothing of the buffer;
* `trainer.json`: the trainer state's `trainer` part (step, phase, question-pool cursor, counters, resolved
  config) and the Python and NumPy RNG states;
* `manifest.json`: the size and SHA-256 of every other file. Written last: its presence marks a whole checkpoint,
  and loading verifies every file against it, so a truncated or altered file is reported by name.
It is written into a temporary directory and renamed into place, so it is either whole or absent; an old checkpoint
is renamed away before it is deleted, so a kill during pruning never leaves a half-deleted one that looks whole.
Nothing is unpickled on load: tensors come from safetensors or `torch.load(weights_only=True)`, the rest is JSON.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import warnings
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from exgrpo.runtime.atomic import fsync_tree
from exgrpo.errors import CheckpointError, ExgrpoWarning, RunDirectoryError, os_cause
from exgrpo.runtime.rundir import CHECKPOINT_SCRATCH, remove_checkpoint_scratch
from exgrpo.runtime.sharding import is_sharded, load_full_model_state

_PREFIX = "step-"
_MANIFEST = "manifest.json"
_CONTENTS = ("model", "optimizer.pt", "buffer.safetensors", "trainer.json")  # besides the manifest


def step_dirs(run_dir: str | Path) -> list[Path]:
    """Every checkpoint directory of a run (step-NNNNNN, with or without a manifest), oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(_PREFIX) and p.name[len(_PREFIX):].isdigit()]
    return sorted(found, key=checkpoint_step)


def checkpoint_dirs(run_dir: str | Path) -> list[Path]:
    """Checkpoints of a run that were completely written (they have a manifest), oldest first."""
    return [p for p in step_dirs(run_dir) if (p / _MANIFEST).is_file()]


def checkpoint_step(checkpoint: Path) -> int:
    """The training step a checkpoint directory (step-NNNNNN) holds."""
    return int(checkpoint.name[len(_PREFIX):])


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest completely written checkpoint (not verified: see `latest_intact_checkpoint`)."""
    dirs = checkpoint_dirs(run_dir)
    return dirs[-1] if dirs else None


def verify_checkpoint(directory: str | Path) -> str | None:
    """None if every file of the checkpoint matches its manifest, else what is wrong (naming the file)."""
    directory = Path(directory)
    try:
        manifest = json.loads((directory / _MANIFEST).read_text())
    except (OSError, ValueError) as e:
        return f"{directory / _MANIFEST}: unreadable ({e})"
    for name, expected in manifest["files"].items():
        path = directory / name
        try:
            if not path.is_file():
                return f"{path} is missing"
            if path.stat().st_size != expected["size"]:
                return f"{path} has {path.stat().st_size} bytes, the manifest says {expected['size']}"
            if _sha256(path) != expected["sha256"]:
                return f"{path} does not match its checksum (corrupted)"
        except OSError as e:  # e.g. removed while it was read (a live run pruning it)
            return f"{path}: {e.strerror or e}"
    return None


def latest_intact_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest checkpoint that passes `verify_checkpoint`, or that has no manifest but every file a checkpoint
    holds (unverified: written before manifests existed; resumed from with a warning). Each newer checkpoint
    passed over is reported as a warning naming it and why."""
    for checkpoint in reversed(step_dirs(run_dir)):
        if not (checkpoint / _MANIFEST).is_file():
            missing = [name for name in _CONTENTS if not (checkpoint / name).exists()]
            if not missing:
                warnings.warn(ExgrpoWarning(f"checkpoint {checkpoint.name} has no {_MANIFEST}: resuming from it "
                                            "unverified"), stacklevel=2)
                return checkpoint
            problem = f"no {_MANIFEST} and no {', '.join(missing)}"
        else:
            problem = verify_checkpoint(checkpoint)
            if problem is None:
                return checkpoint
        if not checkpoint.exists():  # pruned meanwhile by the run that owns it: not a fault of the checkpoint
            continue
        warnings.warn(ExgrpoWarning(f"skipping checkpoint {checkpoint.name}: {problem}"), stacklevel=2)
    return None


def save_checkpoint(run_dir: str | Path, step: int, write_model: Callable[[Path], None],
                    write_buffer: Callable[[Path], None], state: dict, keep: int = 2) -> Path:
    """Write the model (`write_model(directory)`, e.g. `save_pretrained`), the experience buffer
    (`write_buffer(path)`) and the "trainer" and "optimizer" parts of a trainer `state` (`ExGRPOTrainer.state_dict()`)
    as the checkpoint of `step`; keep the newest `keep` checkpoints. A failed
    write (full disk, no permission) is a RunDirectoryError naming the path; the previous checkpoints are
    untouched by it."""
    root = Path(run_dir) / "checkpoints"
    final = root / f"{_PREFIX}{step:06d}"
    tmp = root / f"{CHECKPOINT_SCRATCH[0]}{final.name}-{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        remove_checkpoint_scratch(run_dir)  # a library caller may save without the CLI's lock sweep
        tmp.mkdir()
        write_model(tmp / "model")
        with open(tmp / "optimizer.pt", "wb") as f:  # a Python file: a full disk surfaces as its OSError
            torch.save({**state["optimizer"], "torch_rng": torch.get_rng_state()}, f)
        write_buffer(tmp / "buffer.safetensors")
        np_state = np.random.get_state()
        rng = {"python_rng": _jsonable(random.getstate()),
               "numpy_rng": [np_state[0], np_state[1].tolist(), *np_state[2:]]}
        (tmp / "trainer.json").write_text(json.dumps({**state["trainer"], **rng}))
        files = {str(p.relative_to(tmp)): {"size": p.stat().st_size, "sha256": _sha256(p)}
                 for p in sorted(tmp.rglob("*")) if p.is_file()}
        (tmp / _MANIFEST).write_text(json.dumps({"step": step, "files": files}, indent=1))
        fsync_tree(tmp)
        if final.exists():  # a re-run of the same step (after a resume) replaces it
            _delete(final)
        os.replace(tmp, final)
        _prune(run_dir, keep)
    except Exception as e:  # OSError, or a writer's own wrapper of one (safetensors, torch.save)
        shutil.rmtree(tmp, ignore_errors=True)
        raise RunDirectoryError(f"cannot write checkpoint {final}: {os_cause(e)}") from None
    return final


def _delete(checkpoint: Path) -> None:
    """Rename out of the checkpoint namespace first, so an interrupted delete leaves only scratch behind."""
    doomed = checkpoint.with_name(f"{CHECKPOINT_SCRATCH[1]}{checkpoint.name}-{os.getpid()}")
    os.replace(checkpoint, doomed)
    shutil.rmtree(doomed)


def _prune(run_dir: str | Path, keep: int) -> None:
    """Delete every checkpoint directory older than the newest `keep` complete ones, those without a manifest
    (unverified, from before manifests existed) included."""
    complete = checkpoint_dirs(run_dir)
    if len(complete) > keep:
        oldest_kept = checkpoint_step(complete[-keep])
        for old in step_dirs(run_dir):
            if checkpoint_step(old) < oldest_kept:
                _delete(old)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


#: trainer.json keys renamed, old -> new: a checkpoint written before a rename is read under the new names
RENAMED_STATE = {"solved": "ever_correct", "skipped_updates": "skipped_optimizer_steps"}


def read_trainer_json(directory: str | Path) -> dict:
    """The `trainer` part of a checkpoint (its resolved config under "config")."""
    path = Path(directory) / "trainer.json"
    trainer = json.loads(path.read_text())
    both = [f"{old} and {new}" for old, new in RENAMED_STATE.items() if old in trainer and new in trainer]
    if both:
        raise CheckpointError(f"{path}: {'; '.join(both)} are both set, an old name and its new one: which was "
                              "meant is unknown")
    return {RENAMED_STATE.get(key, key): value for key, value in trainer.items()}


def load_checkpoint(directory: str | Path, model, read_buffer: Callable[[Path], dict], verified: bool = False) -> dict:
    """Verify checkpoint `directory` (unless `verified`: the caller just did, with `latest_intact_checkpoint`),
    load its weights into `model`, restore the global RNGs, and return the trainer state to pass to
    `ExGRPOTrainer.load_state_dict` (its "buffer" part read by `read_buffer(path)`)."""
    directory = Path(directory)
    unverifiable = verified or not (directory / _MANIFEST).is_file()  # no manifest: resumed unverified
    problem = None if unverifiable else verify_checkpoint(directory)
    if problem is not None:
        raise CheckpointError(f"checkpoint {directory} is not intact: {problem}")
    trainer = read_trainer_json(directory)
    _load_weights(model, directory / "model")
    optimizer = torch.load(directory / "optimizer.pt", weights_only=True)
    torch.set_rng_state(optimizer.pop("torch_rng"))
    random.setstate(_tupled(trainer.pop("python_rng")))
    kind, keys, *rest = trainer.pop("numpy_rng")
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), *rest))
    return {"trainer": trainer, "optimizer": optimizer, "buffer": read_buffer(directory / "buffer.safetensors")}


def _load_weights(model, directory: Path) -> None:
    from safetensors.torch import load_file

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory}: no safetensors weights in the checkpoint")
    if is_sharded(model):
        load_full_model_state(model, _named_like(model, {k: v for f in files for k, v in load_file(str(f)).items()}))
        return
    if (directory / "adapter_config.json").is_file():  # a peft adapter
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(model, load_file(str(directory / "adapter_model.safetensors")))
        return
    state = {}
    for f in files:
        state.update(load_file(str(f)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    if unexpected or set(missing) - tied:
        raise ValueError(f"{directory}: checkpoint weights do not fit the model (missing {sorted(missing)[:5]}, "
                         f"unexpected {sorted(unexpected)[:5]})")


def _named_like(model, saved: dict) -> dict:
    """Saved tensors keyed as `model.state_dict()`: a peft adapter file drops the adapter name (".default")."""
    names = {}
    for name in model.state_dict():
        names[name] = name
        names.setdefault(name.replace(".default.", "."), name)
    unknown = sorted(set(saved) - set(names))
    if unknown:
        raise CheckpointError(f"checkpoint weights do not fit the model (unexpected {unknown[:5]})")
    return {names[k]: v for k, v in saved.items()}


def _jsonable(value):
    return [_jsonable(v) for v in value] if isinstance(value, tuple) else value


def _tupled(value):
    return tuple(_tupled(v) for v in value) if isinstance(value, list) else value
