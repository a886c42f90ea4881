"""Token authorization (TorchServe-style): a management token and an inference token, and the key file.

Design note: the composition root builds one ``TokenAuthority`` from the server config at start. Tokens
come from ``SERVING_MANAGEMENT_TOKEN`` / ``SERVING_INFERENCE_TOKEN`` (read by ``serving.config.model_config``), else
from an existing ``key_file`` named in config.properties, else they are generated (32 URL-safe characters). They
are written to the key file with mode 0600 (owner only); the default key file, ``key_file.json`` in the
working directory, is removed at shutdown, a configured one is kept. The file has TorchServe's shape
``{"management": {"key": ...}, "inference": {"key": ...}}``. Checks compare in constant time; a token is
never logged or put in an error message. Frontends translate a failed check into 401 / UNAUTHENTICATED.
"""

from __future__ import annotations

import enum
import hmac
import json
import logging
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

from rollcore.errors import ConfigError
from serving.config.server_config import ServerConfig

log = logging.getLogger("serving.auth")

DEFAULT_KEY_FILE = "key_file.json"


class Scope(str, enum.Enum):
    """Which token an API needs."""

    MANAGEMENT = "management"
    INFERENCE = "inference"


def new_key() -> str:
    """A random token (24 bytes, URL-safe base64) that does not start with ``-``: a key given on a command line
    (``serving bench --token KEY``, curl's ``-H``) must not read as an option (CI met one that did)."""
    while True:
        key = secrets.token_urlsafe(24)
        if not key.startswith("-"):
            return key


def bearer_token(header: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header value (scheme case-insensitive), else None."""
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


@dataclass(frozen=True, slots=True)
class TokenAuthority:
    """Decides whether a presented token opens an API. ``enabled=False`` opens everything."""

    management_token: str
    inference_token: str
    enabled: bool = True
    inference_required: bool = False
    key_file: Path | None = None
    remove_key_file: bool = False

    def __repr__(self) -> str:  # never print the tokens
        return (f"TokenAuthority(enabled={self.enabled}, inference_required={self.inference_required}, "
                f"key_file={self.key_file})")

    def required(self, scope: Scope) -> bool:
        """True when ``scope`` needs a token under this configuration."""
        if not self.enabled:
            return False
        return scope is Scope.MANAGEMENT or self.inference_required

    def allows(self, scope: Scope, authorization: str | None) -> bool:
        """True when the ``Authorization`` header value carries ``scope``'s token (or none is required)."""
        if not self.required(scope):
            return True
        token = bearer_token(authorization)
        if token is None:
            return False
        expected = self.management_token if scope is Scope.MANAGEMENT else self.inference_token
        return hmac.compare_digest(token.encode("utf-8", "replace"), expected.encode())

    def close(self) -> None:
        """Remove the default key file at shutdown (a configured key file is kept)."""
        if self.remove_key_file and self.key_file is not None:
            try:
                self.key_file.unlink()
            except FileNotFoundError:
                pass


def build_authority(config: ServerConfig, cwd: Path) -> TokenAuthority:
    """Resolve the tokens and write the key file (see the module note). Raises ``ConfigError`` for a key
    file that others can read or that is not a key file."""
    inference_required = config.inference_auth_required()
    if config.disable_token_authorization:
        log.warning("token authorization is DISABLED (disable_token_authorization=true): anyone who can reach "
                    "the management address can register, scale and unregister models")
        return TokenAuthority("", "", enabled=False)
    configured = config.key_file is not None
    path = config.key_file if config.key_file is not None else cwd / DEFAULT_KEY_FILE
    if not path.is_absolute():
        path = cwd / path
    stored = read_key_file(path) if configured and path.exists() else {}
    management = config.management_token or stored.get("management") or new_key()
    inference = config.inference_token or stored.get("inference") or new_key()
    if stored != {"management": management, "inference": inference}:
        write_key_file(path, management, inference)
    log.info("token authorization: management%s API needs 'Authorization: Bearer <token>'; tokens are in %s "
             "(readable by the owner only)", " and inference" if inference_required else "", path)
    return TokenAuthority(management, inference, enabled=True, inference_required=inference_required,
                          key_file=path, remove_key_file=not configured)


def read_key_file(path: Path) -> dict[str, str]:
    """``{"management": token, "inference": token}`` from a key file. Raises ``ConfigError``."""
    try:
        mode = path.stat().st_mode
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"key_file {path}: cannot read: {type(exc).__name__}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"key_file {path}: readable by others (mode {stat.S_IMODE(mode):o}); chmod 600 it")
    out: dict[str, str] = {}
    for scope in ("management", "inference"):
        entry = data.get(scope) if isinstance(data, dict) else None
        key = entry.get("key") if isinstance(entry, dict) else None
        if not isinstance(key, str) or len(key) < 8:
            raise ConfigError(f"key_file {path}: expected {{\"{scope}\": {{\"key\": <at least 8 characters>}}}}")
        out[scope] = key
    return out


def write_key_file(path: Path, management: str, inference: str) -> None:
    """Write the key file atomically with mode 0600 (created so, never widened)."""
    body = json.dumps({"management": {"key": management}, "inference": {"key": inference}}, indent=2) + "\n"
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.unlink()
    except FileNotFoundError:
        pass
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(body)
    os.replace(tmp, path)
