"""Layered settings: each effective value remembers where it came from (a file and line, an environment
variable, an override, the default), and an invalid one fails naming that place, the key and the value.
Shared by the model configuration (``serving.config.model_config``) and the server's
(``serving.config.server_config``)."""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from rollcore.errors import ConfigError
from rollcore.values import Parser
from serving.config.properties import parse_properties

EMPTY: Mapping[str, str] = MappingProxyType({})


def empty_mapping() -> Mapping[str, str]:
    return EMPTY


@dataclass(frozen=True, slots=True)
class Setting:
    value: str
    source: str  # short, for sources/describe: "serving.properties:3", "env OPTION_X", "default", "override"
    where: str   # error prefix: the file path with line, or the same as source


def norm(key: str) -> str:
    return re.sub(r"[._]", "", key.lower())


def fail(key: str, setting: Setting, reason: str) -> ConfigError:
    return ConfigError(f"{setting.where}: {key} = {setting.value!r}: {reason}")


def read_file(path: Path) -> list[tuple[str, Setting]]:
    try:
        content = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read: {exc}") from None
    return [(p.key, Setting(p.value.strip(), f"{path.name}:{p.line}", f"{path}:{p.line}"))
            for p in parse_properties(content, str(path))]


def canonical_keys(raw: list[tuple[str, Setting]], known: Mapping[str, str], *,
                    allow_options: bool) -> dict[str, Setting]:
    """Map raw keys onto known keys (later entries win); unknown non-option keys are errors."""
    settings: dict[str, Setting] = {}
    for key, setting in raw:
        canonical = known.get(norm(key))
        if canonical is None and allow_options and key.lower().startswith("option."):
            canonical = "option." + key[len("option."):]
        if canonical is None:
            raise unknown_key(key, setting, known, allow_options=allow_options)
        settings[canonical] = setting
    return settings


def unknown_key(key: str, setting: Setting, known: Mapping[str, str], *, allow_options: bool) -> ConfigError:
    """One line for a key the file kind does not have: the closest known key of that kind (matched as keys are,
    ignoring case, ``_`` and ``.``), never the whole list."""
    by_norm = {norm(name): name for name in sorted(set(known.values()))}
    close = difflib.get_close_matches(norm(key), list(by_norm), n=1)
    hint = f"did you mean '{by_norm[close[0]]}'?" if close else "no known key is close (docs/reference.md lists them)"
    # serving.properties: a custom handler reads its own keys under option.
    what = "unknown key (a handler's own keys take the option. prefix)" if allow_options else "unknown key"
    return ConfigError(f"{setting.where}: {key} = {setting.value!r}: {what}; {hint}")


def env_setting(var: str, value: str) -> Setting:
    return Setting(value.strip(), f"env {var}", f"env {var}")


def override_settings(overrides: Mapping[str, str]) -> list[tuple[str, Setting]]:
    return [(key, Setting(value.strip(), "override", "override")) for key, value in overrides.items()]


def resolve(key: str, setting: Setting, parser: Parser) -> Any:
    try:
        return parser(setting.value)
    except ValueError as exc:
        raise fail(key, setting, str(exc)) from None
