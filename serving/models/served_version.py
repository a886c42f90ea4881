"""The version label of a model that names none.

Design note: a client names ``NAME`` (the default version) or ``NAME:VERSION``; the route that resolved the
endpoint tells the metrics which version answered (``serving.frontends.http.httpio.note_model`` writes it into the
request's state, which ``serving.telemetry.metrics``' request wrapper reads), so nothing here is per request.
``DEFAULT_VERSION`` is the version of a model folder that names none.
"""

from __future__ import annotations

DEFAULT_VERSION = "1"
