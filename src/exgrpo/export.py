"""`exgrpo export`: a standalone model directory from a run (its newest intact checkpoint) or a checkpoint.

The export is written beside OUT and renamed into place, so OUT holds exactly one export. It never writes inside a
run's checkpoints, and it reads a checkpoint of a live run safely: one pruned while it is read (the run keeps only
its newest `train.save_total_limit`) is replaced by the newest intact checkpoint then, so what is exported is always
one whole checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable, TypeVar

from exgrpo.errors import ExgrpoError

T = TypeVar("T")
_ATTEMPTS = 10  # checkpoints of a live run tried before giving up (each one pruned while it was read)


def checkpoint_of(run_or_checkpoint: str | os.PathLike, needed: str) -> Path:
    """The newest intact checkpoint of a run directory, or the checkpoint directory itself (verified against its
    manifest when it has one); it must hold `needed`."""
    from exgrpo.runtime.checkpoint import latest_intact_checkpoint, verify_checkpoint

    source = Path(run_or_checkpoint)
    if not source.exists():
        raise ExgrpoError(f"{source}: no such run or checkpoint directory")
    if (source / "checkpoints").is_dir():
        checkpoint = latest_intact_checkpoint(source)
        if checkpoint is None:
            raise ExgrpoError(f"{source}: no intact checkpoint in {source / 'checkpoints'}")
        source = checkpoint
    elif (source / "manifest.json").is_file() and (problem := verify_checkpoint(source)) is not None:
        raise ExgrpoError(f"{source} is not intact: {problem}")
    if not (source / needed).exists():
        raise ExgrpoError(f"{source}: neither a run directory with checkpoints nor a checkpoint (no {needed} in it)")
    return source


def export(source: str | os.PathLike, out: str | os.PathLike, *, merge: bool = False, overwrite: bool = False,
           log: Callable[[str], None] = print) -> Path:
    """Write the model of `source` (a run or a checkpoint) to `out`; `merge` merges a LoRA adapter into its base.
    Returns the checkpoint exported. Every refusal and failure is an ExgrpoError naming the path."""
    out = Path(out)
    check_export_target(out, overwrite, Path(source))
    staging = _staging(out)
    try:
        checkpoint, (model, tokenizer) = read_checkpoint(source, "model", _load_model, log)
        merged = merge and hasattr(model, "merge_and_unload")
        _write(model.merge_and_unload() if merged else model, tokenizer, staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    if merge and not merged:
        log(f"exported {checkpoint} to {out}; --merge had nothing to merge: the checkpoint holds full weights (a "
            "full fine-tuning run, no LoRA adapter), exported as they are")
    else:
        log(f"exported {checkpoint} to {out}" + (" (LoRA merged)" if merged else ""))
    _note_preset_adapter(out, log)
    return checkpoint


def check_export_target(out: Path, overwrite: bool, source: Path | None = None) -> None:
    """OUT must be a directory that is absent, empty, or (with --overwrite) an earlier export, which is replaced;
    never inside a run's checkpoints, never a run directory, never the source or a directory holding it."""
    _refuse_inside_checkpoints(out)
    _refuse_over_a_run(out, source)
    if out.exists() and not out.is_dir():
        raise ExgrpoError(f"{out} is a file; OUT must be a directory")
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if not held:
        return
    if not overwrite:
        raise ExgrpoError(f"{out} is not empty; pick another directory, or pass --overwrite to replace an earlier "
                          "export there")
    if not {"config.json", "adapter_config.json"} & set(held):
        raise ExgrpoError(f"{out} holds files that are not a model export ({', '.join(held[:3])}); --overwrite only "
                          "replaces an earlier export: pick another directory")


def _refuse_inside_checkpoints(out: Path) -> None:
    """An export into a run's checkpoints would overwrite (or sit among) files its manifests vouch for."""
    real = Path(os.path.realpath(out))
    places = (real, *real.parents)
    runs = [p.parent for p in places if p.name == "checkpoints" and _is_run(p.parent)]
    checkpoints = [p for p in places if (p / "manifest.json").is_file() and (p / "trainer.json").is_file()]
    if runs or checkpoints:
        where = f"the checkpoints of the run {runs[0]}" if runs else f"the checkpoint {checkpoints[0]}"
        raise ExgrpoError(f"{out} is inside {where}: an export never writes there (it would change what a "
                          "checkpoint's manifest vouches for, and --resume would find no intact checkpoint); pick a "
                          "directory outside it")


def _refuse_over_a_run(out: Path, source: Path | None) -> None:
    """Replacing OUT whole (--overwrite) must never delete a run, or what the export reads."""
    real = Path(os.path.realpath(out))
    if source is not None and source.exists():
        read = Path(os.path.realpath(source))
        if read == real or real in read.parents:
            raise ExgrpoError(f"{out} holds {source}, which the export reads; OUT must be another directory")
    if real.is_dir() and any((real / name).exists() for name in ("metrics.jsonl", ".lock", "checkpoints")):
        raise ExgrpoError(f"{out} is a run directory; an export never replaces a run: pick another directory")


def _is_run(directory: Path) -> bool:
    return any((directory / name).exists() for name in ("config.json", "metrics.jsonl", ".lock"))


def _staging(out: Path) -> Path:
    """The directory the export is written to before it is renamed to OUT (same file system); making it proves
    OUT's place writable before any model is read."""
    from exgrpo.runtime.scratch import owned_temp_dir

    existing = next(p for p in out.absolute().parents if p.exists())
    if not existing.is_dir():
        raise ExgrpoError(f"cannot write the export to {out}: {existing} is a file, not a directory")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        # a killed export's staging directory goes at the next export
        return Path(owned_temp_dir(f".{out.name}.tmp-", str(out.parent)))
    except OSError as e:
        raise ExgrpoError(f"cannot write the export to {out}: {e.strerror or e}") from None


def read_checkpoint(source: str | os.PathLike, needed: str, read: Callable[[Path], T],
                    log: Callable[[str], None]) -> tuple[Path, T]:
    """The checkpoint of `source` (see `checkpoint_of`) and `read(checkpoint)`, read whole: a checkpoint of a run
    that disappears while it is read (pruned by the live run) gives way to the run's newest intact checkpoint then.
    An error reading a checkpoint that is still there is raised (an OSError as an ExgrpoError naming it)."""
    source = Path(source)
    for _ in range(_ATTEMPTS):
        checkpoint = checkpoint_of(source, needed)
        try:
            return checkpoint, read(checkpoint)
        except Exception as e:
            if checkpoint.exists():
                if isinstance(e, OSError):
                    raise ExgrpoError(f"cannot read {checkpoint / needed}: {e.strerror or e}") from None
                raise
            if checkpoint == source:
                raise ExgrpoError(f"{checkpoint} was removed while it was read") from None
        log(f"{checkpoint.name} was pruned by its run while it was read; taking the run's newest intact checkpoint")
    raise ExgrpoError(f"{source}: {_ATTEMPTS} checkpoints in a row were pruned while they were read; read a "
                      "checkpoint of the run once it has stopped, or one it keeps (train.save_total_limit)")


def _load_model(checkpoint: Path) -> tuple[Any, Any]:
    from exgrpo.models import load_policy

    return load_policy(str(checkpoint / "model"))


def _write(model: Any, tokenizer: Any, staging: Path, out: Path) -> None:
    from exgrpo.models import save_policy

    try:
        save_policy(model, tokenizer, staging)
        if out.exists():
            shutil.rmtree(out)
        os.replace(staging, out)
    except OSError as e:
        raise ExgrpoError(f"cannot write the export to {out}: {e.strerror or e}") from None


def _note_preset_adapter(out: Path, log: Callable[[str], None]) -> None:
    from exgrpo.models import is_preset

    adapter = out / "adapter_config.json"
    base = json.loads(adapter.read_text()).get("base_model_name_or_path", "") if adapter.is_file() else ""
    if is_preset(base):
        log(f"{out} is a LoRA adapter on exgrpo's preset {base!r}, which plain transformers/peft cannot resolve: "
            f"load it with exgrpo (`exgrpo eval --model {out}`, `exgrpo.models.load_policy`), or export with "
            "--merge for a plain transformers model")
