"""``smartckpt config show``: every effective setting, its value and where it came from.

The precedence is ``config.load_settings``'s (defaults < YAML file < ``SMARTCKPT_*`` < flags);
this module only lays its answer out. ``--set KEY=VALUE`` stands for a command-line flag: the
value is read as YAML (``5`` is a number, ``true`` a boolean, ``[...]`` a list).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from smartckpt_cli.config import CONFIG_FILE, Settings, load_settings, public_settings
from smartckpt_cli.errors import ConfigError

__all__ = ["SettingRow", "effective_settings", "parse_assignments"]


@dataclass(frozen=True)
class SettingRow:
    key: str
    value: Any  # JSON-ready
    source: str  # default | <file path> | env SMARTCKPT_X | flag


def parse_assignments(items: list[str]) -> dict[str, Any]:
    """``["keep_last=5", "precision=bf16"]`` -> {"keep_last": 5, "precision": "bf16"}: each value
    is read from text exactly as its ``SMARTCKPT_*`` variable would be."""
    from smartckpt_cli.config import _coerce

    names = {f.name for f in dataclasses.fields(Settings)}
    out: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise ConfigError(f"--set expects KEY=VALUE, got {item!r}")
        if key not in names:
            raise ConfigError(f"unknown setting '{key}' in --set {item}")
        if key == "tiers":
            try:
                out[key] = yaml.safe_load(text)
            except yaml.YAMLError as err:
                raise ConfigError(f"tiers: not valid YAML ({err})") from None
        else:
            out[key] = _coerce(key, text, from_text=True)
    return out


def effective_settings(
    config_file: str | os.PathLike[str] | None,
    overrides: dict[str, Any] | None = None,
    *,
    env: dict[str, str] | None = None,
) -> tuple[list[SettingRow], str | None]:
    """(one row per setting in declaration order, the YAML file that was read or None)."""
    settings, sources = load_settings(config_file, overrides, env=env)
    path = Path(config_file) if config_file else Path(CONFIG_FILE)
    rows = []
    for key, value in public_settings(settings).items():
        source = sources.get(key, "default")
        rows.append(SettingRow(key, value, "flag" if source == "argument" else source))
    return rows, str(path) if path.is_file() else None
