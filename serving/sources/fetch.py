"""What a remote source's fetcher is given: an empty folder to fill, the environment, a progress callback.

Design note: fetchers only download. ``serving.sources.cache`` gives them a private temporary folder and
publishes it under its final name only when the fetcher returned, so a failed or interrupted fetch never
leaves a half-filled folder where a later start would find it.
"""

from __future__ import annotations

from collections.abc import Callable

# One line of progress ("model x: 12/40 files, 310 of 540 MiB"), logged by the caller.
Progress = Callable[[str], None]
