"""Scrub server file-system paths out of texts that reach clients (handler, engine and load errors).

Design note: clients see a model by its name, never by where its files or the server's packages live.
Known prefixes (a model folder -> the model's name, the model store -> ``<model_store>``) are replaced
first, then any other absolute path keeps only its last component (``/opt/venv/lib/x/modeling.py`` ->
``<path>/modeling.py``), which is enough to recognise a file without revealing the layout. The full text
stays in the server's log. Pure functions, used by the worker (before a text leaves it) and the frontend.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

# An absolute POSIX path: starts with "/" not preceded by a word character, ":", "/" or "." (so URLs
# like http://host/a and relative paths like a/b are left alone), at least two components.
_ABSOLUTE_PATH = re.compile(r"(?<![\w:/.~-])/(?:[\w.@+~-]+/)+([\w.@+~-]*)")


def scrub_paths(text: str, replacements: Mapping[str, str] | None = None) -> str:
    """``text`` with ``replacements`` (path prefix -> label) applied, longest first, then every other
    absolute path reduced to ``<path>/<last component>``."""
    for prefix in sorted((p for p in (replacements or {}) if p and p != "/"), key=len, reverse=True):
        text = text.replace(prefix.rstrip("/"), (replacements or {})[prefix])
    return _ABSOLUTE_PATH.sub(lambda m: f"<path>/{m.group(1)}" if m.group(1) else "<path>/", text)
