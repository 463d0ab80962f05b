"""Presets: the configs shipped inside the package, named on the command line as `--config demo`."""

from __future__ import annotations

from pathlib import Path

from exgrpo.errors import ConfigError

PRESET_DIR = Path(__file__).resolve().parents[1] / "presets"


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def config_file(value: str | Path, relative_to: Path | None = None) -> Path:
    """The YAML file a --config value (or a study's `base`) names: an existing file as it is (relative to
    `relative_to` when given), otherwise a preset's name, with or without `.yaml`."""
    path = Path(relative_to or ".") / value
    if path.is_file():
        return path
    name = str(value).removesuffix(".yaml")
    if "/" not in name and name in preset_names():
        return PRESET_DIR / f"{name}.yaml"
    raise ConfigError(f"config file {path} does not exist, and {str(value)!r} is not a preset "
                      f"(presets: {', '.join(preset_names())})")
