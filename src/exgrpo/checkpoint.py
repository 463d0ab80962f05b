"""Atomic checkpoints that restore everything a run needs to continue exactly.

A checkpoint is a directory `checkpoints/step-NNNNNN/` holding:
* `model/`: `save_pretrained` output (full weights, or the adapter for LoRA), loadable by `exgrpo eval --model`;
* `optimizer.pt`: the trainer state's `optimizer` part (optimizer, scheduler) and the torch RNG state;
* `buffer.safetensors`: the experience buffer (arrays + JSON metadata);
* `trainer.json`: the trainer state's `trainer` part (step, phase, question-pool cursor, counters, resolved
  config) and the Python and NumPy RNG states. Written last: its presence marks a whole checkpoint.
It is written into a temporary directory and renamed into place, so it is either whole or absent. Nothing is
unpickled on load: tensors come from safetensors or `torch.load(weights_only=True)`, the rest is JSON.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch

from exgrpo.atomic import fsync_tree
from exgrpo.experience.buffer import read_state, write_state

_PREFIX = "step-"


def checkpoint_dirs(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(_PREFIX) and (p / "trainer.json").is_file()]
    return sorted(found, key=checkpoint_step)


def checkpoint_step(checkpoint: Path) -> int:
    """The training step a checkpoint directory (step-NNNNNN) holds."""
    return int(checkpoint.name[len(_PREFIX):])


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    dirs = checkpoint_dirs(run_dir)
    return dirs[-1] if dirs else None


def save_checkpoint(run_dir: str | Path, step: int, model, state: dict, keep: int = 2) -> Path:
    """Write `model` and a trainer `state` (`ExGRPOTrainer.state_dict()`) as the checkpoint of `step`; keep the
    newest `keep` checkpoints."""
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{_PREFIX}{step:06d}"
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    model.save_pretrained(str(tmp / "model"))
    torch.save({**state["optimizer"], "torch_rng": torch.get_rng_state()}, tmp / "optimizer.pt")
    write_state(state["buffer"], tmp / "buffer.safetensors")
    np_state = np.random.get_state()
    rng = {"python_rng": _jsonable(random.getstate()), "numpy_rng": [np_state[0], np_state[1].tolist(), *np_state[2:]]}
    (tmp / "trainer.json").write_text(json.dumps({**state["trainer"], **rng}))
    fsync_tree(tmp)
    if final.exists():  # a re-run of the same step (after a resume) replaces it
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in checkpoint_dirs(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def read_trainer_json(directory: str | Path) -> dict:
    """The `trainer` part of a checkpoint (its resolved config under "config")."""
    return json.loads((Path(directory) / "trainer.json").read_text())


def load_checkpoint(directory: str | Path, model) -> dict:
    """Load the weights of checkpoint `directory` into `model`, restore the global RNGs, and return the trainer
    state to pass to `ExGRPOTrainer.load_state_dict`."""
    directory = Path(directory)
    trainer = read_trainer_json(directory)
    _load_weights(model, directory / "model")
    optimizer = torch.load(directory / "optimizer.pt", weights_only=True)
    torch.set_rng_state(optimizer.pop("torch_rng"))
    random.setstate(_tupled(trainer.pop("python_rng")))
    kind, keys, *rest = trainer.pop("numpy_rng")
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), *rest))
    return {"trainer": trainer, "optimizer": optimizer, "buffer": read_state(directory / "buffer.safetensors")}


def _load_weights(model, directory: Path) -> None:
    from safetensors.torch import load_file

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory}: no safetensors weights in the checkpoint")
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


def _jsonable(value):
    return [_jsonable(v) for v in value] if isinstance(value, tuple) else value


def _tupled(value):
    return tuple(_tupled(v) for v in value) if isinstance(value, list) else value
