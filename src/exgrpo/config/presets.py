"""Presets: the configs shipped inside the package, named on the command line as `--config demo`."""

from __future__ import annotations

import warnings
from pathlib import Path

from exgrpo.errors import ConfigError, ExgrpoWarning

PRESET_DIR = Path(__file__).resolve().parents[1] / "presets"


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def config_file(value: str | Path, relative_to: Path | None = None) -> Path:
    """The YAML file a --config value (or a study's `base`) names: an existing file as it is (relative to
    `relative_to` when given), otherwise a preset's name, with or without `.yaml`. A bare name that is both a file
    and a preset is the file, said in a warning (./NAME says it is the file)."""
    path = Path(relative_to or ".") / value
    name = str(value).removesuffix(".yaml")
    preset = "/" not in str(value) and name in preset_names()
    if path.is_file():
        if preset:
            shown = path if relative_to else f"./{value}"
            warnings.warn(ExgrpoWarning(f"using the file {shown}, not the preset {name} (write {shown} to name the "
                                        "file; rename the file to use the preset)"), stacklevel=2)
        return path
    if preset:
        return PRESET_DIR / f"{name}.yaml"
    if path.is_dir():
        raise ConfigError(f"config file {path} is a directory; expected a YAML file or a preset "
                          f"({', '.join(preset_names())})")
    raise ConfigError(f"config file {path} does not exist, and {str(value)!r} is not a preset "
                      f"(presets: {', '.join(preset_names())})")
