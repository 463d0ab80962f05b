"""Config fields that were renamed: read under their new names wherever a config comes from (a file, an override,
a stored run config), saying so once per use."""

from __future__ import annotations

import dataclasses
import sys

from exgrpo.config.schema import ExGRPOConfig
from exgrpo.errors import ConfigError
from exgrpo.runtime import launched_rank

#: renamed fields, old dotted name -> new, from the schema (a field's `formerly`): a file, an override or a stored
#: run config (`--resume`) that still uses the old name is read with the new one, saying so once
RENAMED = {f"{section.name}.{f.metadata['formerly']}": f"{section.name}.{f.name}"
           for section in dataclasses.fields(ExGRPOConfig) for f in dataclasses.fields(section.default_factory)
           if f.metadata.get("formerly")}


def renamed_key(dotted: str) -> str:
    if dotted in RENAMED:
        if launched_rank() == 0:  # under torchrun rank 0 says it for every rank, as the CLI's other notes
            print(f"exgrpo: {dotted} is now called {RENAMED[dotted]}: read as that", file=sys.stderr)
        return RENAMED[dotted]
    return dotted


def rename_overrides(pairs: list[tuple[str, object]]) -> list[tuple[str, object]]:
    """Overrides (dotted key, value) under the new names; the old and the new name of one field both given is an
    error (which one was meant?), as in a file."""
    keys = {key for key, _ in pairs}
    for old, new in RENAMED.items():
        if old in keys and new in keys:
            raise ConfigError(f"overrides {old} and {new} are both given: {old} is the old name of {new}; keep {new}")
    return [(renamed_key(key), value) for key, value in pairs]


def rename_fields(tree: dict) -> dict:
    """`tree` (nested sections) with renamed fields under their new names; both names set is an error."""
    for old, new in RENAMED.items():
        (old_section, old_key), (new_section, new_key) = old.split("."), new.split(".")
        section = tree.get(old_section)
        if isinstance(section, dict) and old_key in section:
            if new_key in tree.get(new_section, {}):
                raise ConfigError(f"{old} and {new} are both set: {old} is the old name of {new}; keep {new}")
            tree[new_section] = {**tree.get(new_section, {}), new_key: section[old_key]}
            tree[old_section] = {k: v for k, v in tree[old_section].items() if k != old_key}
            renamed_key(old)
    return tree
