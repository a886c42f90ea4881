"""Java ``.properties`` text -> ordered key/value entries with line numbers.

Design note: parsing is delegated to the maintained ``javaproperties`` library (comments ``#``/``!``,
``=``/``:``/whitespace separators, continuation lines, ``\\`` escapes, ``\\uXXXX`` escapes). We walk its
low-level element stream only to recover the 1-based line on which each entry starts, so that
configuration errors can point at ``file:line``. This module knows nothing about which keys exist;
``serving.config.model_config`` interprets them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import javaproperties

from rollcore.errors import ConfigError

_LINE_BREAK = re.compile(r"\r\n|\r|\n")


@dataclass(frozen=True, slots=True)
class Property:
    """One ``key = value`` entry: unescaped key and value, and the line where the entry starts."""

    key: str
    value: str
    line: int


def parse_properties(text: str, filename: str) -> list[Property]:
    """Parse ``.properties`` text into entries, one per distinct key, ordered by line.

    A key given more than once keeps its last value and line (Java semantics). ``filename`` only
    appears in error messages. Values are returned exactly as Java would read them (trailing
    whitespace kept). Raises ``ConfigError`` for an invalid ``\\uXXXX`` escape.
    """
    entries: dict[str, Property] = {}
    line = 1
    elements = javaproperties.parse(text)
    while True:
        try:
            element = next(elements)
        except StopIteration:
            break
        except javaproperties.InvalidUEscapeError as exc:
            raise ConfigError(f"{filename}:{line}: invalid unicode escape {exc.escape!r}") from None
        if isinstance(element, javaproperties.KeyValue):
            entries.pop(element.key, None)  # re-insert so the order follows the winning line
            entries[element.key] = Property(element.key, element.value, line)
        line += len(_LINE_BREAK.findall(element.source))
    return list(entries.values())
