"""Value parsers: a configuration value as text -> a typed value, raising ``ValueError(reason)`` on a bad one.

Design note: part of the kernel (imports nothing of the project), so the frontend (``serving.config.model_config``) and
the
handlers (``handlers.engine.planning.engine_config`` through ``rollcore.options``) parse a value the same way: one set
of boolean words, one wording of every reason. The reason says what is expected (``expected an integer >= 1``);
the caller prefixes where the value came from, the key and the value
(``model/serving.properties:3: batch_size = 'abc': expected an integer >= 1``). Values arrive stripped.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any
from urllib.parse import urlsplit

Parser = Callable[[str], Any]
AUTO = "auto"  # what ``integer(..., auto=True)`` returns for ``auto``

# The boolean words, case-insensitive, of every boolean key (files, environment, handler options).
TRUE_WORDS = ("true", "1", "yes", "on")
FALSE_WORDS = ("false", "0", "no", "off")
BOOL_WORDS: Mapping[str, bool] = MappingProxyType({**{w: True for w in TRUE_WORDS}, **{w: False for w in FALSE_WORDS}})
_BOOL_REASON = "expected true or false (or 1/0, yes/no, on/off)"
_NO_ALIASES: Mapping[str, str] = MappingProxyType({})
_MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def integer(minimum: int, maximum: int | None = None, *, auto: bool = False) -> Parser:
    """Decimal integers in ``[minimum, maximum]``; with ``auto``, also the word ``auto`` (returned as ``AUTO``)."""
    reason = (f"expected an integer >= {minimum}" + (f" and <= {maximum}" if maximum is not None else "")
              + (" or auto" if auto else ""))

    def parse(text: str) -> int | str:
        if auto and text.lower() == AUTO:
            return AUTO
        try:
            value = int(text, 10)
        except ValueError:
            raise ValueError(reason) from None
        if value < minimum or (maximum is not None and value > maximum):
            raise ValueError(reason)
        return value

    return parse


def number(minimum: float, maximum: float | None = None, *, exclusive: bool = False) -> Parser:
    """Finite numbers ``>= minimum`` (``> minimum`` when ``exclusive``) and ``<= maximum``."""
    reason = (f"expected a number {'>' if exclusive else '>='} {minimum:g}"
              + (f" and <= {maximum:g}" if maximum is not None else ""))

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise ValueError(reason) from None
        if not math.isfinite(value) or value < minimum or (exclusive and value == minimum) \
                or (maximum is not None and value > maximum):
            raise ValueError(reason)
        return value

    return parse


def boolean(text: str) -> bool:
    """One of ``BOOL_WORDS`` (``true``/``false``, ``1``/``0``, ``yes``/``no``, ``on``/``off``), any case."""
    value = BOOL_WORDS.get(text.lower())
    if value is None:
        raise ValueError(_BOOL_REASON)
    return value


def choice(choices: tuple[str, ...], aliases: Mapping[str, str] = _NO_ALIASES) -> Parser:
    """One of ``choices`` (matched case-insensitively, returned as spelled there) or an alias of one."""
    canonical = {c.lower(): c for c in choices}
    canonical.update({alias.lower(): target for alias, target in aliases.items()})

    def parse(text: str) -> str:
        value = canonical.get(text.lower())
        if value is None:
            raise ValueError(f"expected one of {', '.join(choices)}")
        return value

    return parse


def text(value: str) -> str:
    """Any non-empty text."""
    if not value:
        raise ValueError("expected a non-empty value")
    return value


def any_text(value: str) -> str:
    """Any text, the empty one included."""
    return value


def alternative(word: str, resolve: Callable[[], Any], parser: Parser) -> Parser:
    """``parser``, or ``word`` (any case) resolved by ``resolve()``; the reason names both."""

    def parse(text: str) -> Any:
        if text.lower() == word:
            return resolve()
        try:
            return parser(text)
        except ValueError as exc:
            raise ValueError(f"{exc} or {word!r}") from None

    return parse


def devices(value: str) -> str:
    if value != "*" and not re.fullmatch(r"\d+(;\d+)*", value):
        raise ValueError("expected '*' or device ids separated by ';' (e.g. 0;1)")
    return value


def split_host_port(value: str) -> tuple[str, int]:
    """``(host, port)`` of ``host:port`` (``[::1]:80`` for IPv6). Raises ``ValueError``."""
    parts = urlsplit("//" + value)
    try:
        port = parts.port
    except ValueError:
        port = None
    if not parts.hostname or port is None or parts.path or parts.query or parts.username:
        raise ValueError("expected host:port")
    return parts.hostname, port


def http_address(value: str) -> str:
    scheme, sep, rest = value.partition("://")
    if not sep or scheme.lower() != "http":
        raise ValueError("expected http://host:port")
    try:
        split_host_port(rest.rstrip("/"))
    except ValueError:
        raise ValueError("expected http://host:port") from None
    return value


def grpc_address(value: str) -> str:
    """``host:port``, or ``""`` for ``off`` or an empty value (gRPC disabled)."""
    if value.lower() in ("", "off"):
        return ""
    split_host_port(value)
    return value


def names(value: str) -> tuple[str, ...]:
    """A comma-separated list (entries stripped, empty ones dropped)."""
    return tuple(entry.strip() for entry in value.split(",") if entry.strip())


def model_name(name: str) -> str:
    """``name`` if it matches ``^[A-Za-z0-9][A-Za-z0-9._-]*$``; else ``ValueError``."""
    if not _MODEL_NAME.match(name):
        raise ValueError(f"invalid model name {name!r}: use letters, digits, '.', '_' and '-', "
                         "starting with a letter or digit")
    return name


def load_models(value: str) -> tuple[str, ...]:
    """``load_models``: ``ALL``, ``NAME``, ``NAME=PATH`` entries, comma-separated."""
    entries = names(value)
    for entry in entries:
        name, sep, path = entry.partition("=")
        if sep and not path.strip():
            raise ValueError(f"entry {entry!r} has no path")
        if entry != "ALL" and not _MODEL_NAME.match(name.strip()):
            raise ValueError(f"invalid model name {name.strip()!r}")
    return entries


def render(value: Any) -> str:
    """A parsed value as a properties string again (what handlers and ``serving config`` see): booleans as
    ``true``/``false``, whole floats without a fraction."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else repr(value)
    return str(value)
