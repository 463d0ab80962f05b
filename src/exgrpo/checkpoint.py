"""Atomic checkpoints that restore everything a run needs to continue exactly.

A checkpoint is a directory `checkpoints/step-NNNNNN/` holding the model (`save_pretrained`: full weights, or the
adapter for LoRA), the optimizer and scheduler, the experience buffer (safetensors + JSON), RNG states, the
question pool's cursor and retired set, the phase and step, and the resolved config. It is written into a
temporary directory and renamed into place, so it is either whole or absent. Nothing is unpickled on load:
tensors come from safetensors or `torch.load(weights_only=True)`, the rest is JSON.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch

from exgrpo.experience import ExperienceBuffer

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


def save_checkpoint(trainer, run_dir: str | Path, keep: int = 2) -> Path:
    """Write the trainer's state at its current step; keep the newest `keep` checkpoints."""
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{_PREFIX}{trainer.step:06d}"
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    trainer.model.save_pretrained(str(tmp / "model"))
    torch.save({"optimizer": trainer.optimizer.state_dict(), "scheduler": trainer.scheduler.state_dict(),
                "torch_rng": torch.get_rng_state()}, tmp / "optimizer.pt")
    trainer.buffer.save(tmp / "buffer.safetensors")
    np_state = np.random.get_state()
    state = {
        "step": trainer.step, "phase": trainer.phase, "optimizer_steps": trainer.optimizer_steps,
        "skipped_updates": trainer.skipped_updates, "pool": trainer.pool.state_dict(),
        "python_rng": _jsonable(random.getstate()),
        "numpy_rng": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        "config": trainer.config.to_dict(),
    }
    (tmp / "trainer.json").write_text(json.dumps(state))  # written last: its presence marks a whole checkpoint
    _fsync_tree(tmp)
    if final.exists():  # a re-run of the same step (after a resume) replaces it
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in checkpoint_dirs(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(trainer, directory: str | Path) -> None:
    """Restore a trainer (built from the same config) to the state saved in `directory`."""
    directory = Path(directory)
    state = json.loads((directory / "trainer.json").read_text())
    _load_weights(trainer.model, directory / "model")
    blobs = torch.load(directory / "optimizer.pt", weights_only=True)
    trainer.optimizer.load_state_dict(blobs["optimizer"])
    trainer.scheduler.load_state_dict(blobs["scheduler"])
    torch.set_rng_state(blobs["torch_rng"])
    buffer = ExperienceBuffer.load(directory / "buffer.safetensors")
    if buffer.num_generations != trainer.K:
        raise ValueError(f"{directory}: the buffer was saved with K={buffer.num_generations}, "
                         f"the config has K={trainer.K}")
    trainer.buffer = buffer
    trainer.step, trainer.phase = state["step"], state["phase"]
    trainer.optimizer_steps, trainer.skipped_updates = state["optimizer_steps"], state["skipped_updates"]
    trainer.pool.load_state_dict(state["pool"])
    random.setstate(_tupled(state["python_rng"]))
    kind, keys, *rest = state["numpy_rng"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), *rest))


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


def _fsync_tree(directory: Path) -> None:
    for path in directory.rglob("*"):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())


def _jsonable(value):
    return [_jsonable(v) for v in value] if isinstance(value, tuple) else value


def _tupled(value):
    return tuple(_tupled(v) for v in value) if isinstance(value, list) else value
