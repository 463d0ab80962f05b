"""What a resumed run may change: the fields whose change leaves the algorithm as it was, and the comparison of a
checkpoint's stored config with the one a resume asks for."""

from __future__ import annotations

import copy
import dataclasses

from exgrpo.config.renamed import rename_fields
from exgrpo.config.schema import ExGRPOConfig

def _resumable_fields(section, prefix: str = "") -> tuple[str, ...]:
    """The dotted names of the fields marked resumable in the schema (`exgrpo.config.schema.resumable`); a marked
    section ends in "." (every field under it)."""
    names = []
    for f in dataclasses.fields(section):
        is_section = dataclasses.is_dataclass(f.default_factory)
        if f.metadata.get("resumable"):
            names.append(prefix + f.name + ("." if is_section else ""))
        elif is_section:
            names += _resumable_fields(f.default_factory, f"{f.name}.")
    return tuple(names)


#: Changing these on resume leaves the algorithm as it was: length, bookkeeping, memory, speed and sharding.
RESUMABLE_CHANGES = _resumable_fields(ExGRPOConfig)


# What a config written before a field existed meant by its absence, where that differs from the field's default
# (a field missing from a stored config otherwise reads as its default).
BEFORE_THE_FIELD = {"experience.retirement": "immediate"}


def config_changes(old: dict, new: dict) -> tuple[list[str], list[str]]:
    """The fields where two resolved configs (`to_dict()`) differ, as "field: old -> new", split into (changes
    that alter the algorithm, harmless ones listed in RESUMABLE_CHANGES). A field missing from `old` (a config
    stored before the field existed) is read as BEFORE_THE_FIELD gives it, else as its default."""
    def flat(tree: dict, prefix: str = "") -> dict:
        out = {}
        for key, value in tree.items():
            if isinstance(value, dict) and not (prefix + key == "model.lora"):
                out.update(flat(value, f"{prefix}{key}."))
            else:
                out[prefix + key] = value
        return out

    defaults = {**flat(ExGRPOConfig().to_dict()), **BEFORE_THE_FIELD}
    a, b = {**defaults, **flat(rename_fields(copy.deepcopy(old)))}, flat(new)
    bf16 = "bf16" in (a.get("train.dtype"), b.get("train.dtype"))
    algorithmic, harmless = [], []
    for key in sorted(set(a) | set(b)):
        if a.get(key) != b.get(key):
            line = f"{key}: {a.get(key)!r} -> {b.get(key)!r}"
            is_harmless = any(key == h or (h.endswith(".") and key.startswith(h)) for h in RESUMABLE_CHANGES)
            if key == "train.sharding" and bf16:  # FSDP casts parameters itself, DDP autocasts: other numbers
                is_harmless, line = False, line + " (in bf16, FSDP and DDP compute differently)"
            (harmless if is_harmless else algorithmic).append(line)
    return algorithmic, harmless
