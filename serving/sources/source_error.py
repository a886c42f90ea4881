"""The one error a model source raises: what failed and why, in words a user can act on."""

from __future__ import annotations

from rollcore.errors import ConfigError


class SourceError(ConfigError):
    """A model's ``option.model_id`` could not be turned into a local folder (bad bucket, missing key, no such
    repository, offline, truncated download, unreadable GGUF). The model is FAILED with this message."""


class SourceUnreachable(SourceError):
    """The source could not be reached at all (no network, endpoint down): a cached copy may serve instead."""
