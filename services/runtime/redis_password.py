"""The Redis password of a Sluice stack: where every service reads it from, and how a launcher hands it on.

Every process that talks to Redis (coordinator, TransferQueue controller, the roles, `sluice run` itself)
takes the password from the file named by env SLUICE_REDIS_PASSWORD_FILE, else from env SLUICE_REDIS_PASSWORD;
both empty = Redis asks for none. Never from a flag or from a URL given as a flag: argv is readable by every
user of the machine (/proc/<pid>/cmdline, `ps`). A launcher passes it to its children through their
environment (`redis_password_env`), as it passes the stack's token (services/runtime/auth_token.py)."""

from __future__ import annotations

import os
import secrets
from typing import Mapping

PASSWORD_ENV = "SLUICE_REDIS_PASSWORD"
PASSWORD_FILE_ENV = "SLUICE_REDIS_PASSWORD_FILE"


class RedisPasswordError(ValueError):
    """The password file is missing, unreadable or empty, or the password cannot be written to redis.conf."""


def read_password_file(path: str) -> str:
    """The file's content without surrounding whitespace; an error naming the file (never its content) when it
    cannot be read or holds nothing: silently talking to Redis without the password would only fail later."""
    try:
        with open(path, encoding="utf-8") as f:
            password = f.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise RedisPasswordError(
            f"env {PASSWORD_FILE_ENV} {path}: cannot read it: {getattr(exc, 'strerror', None) or exc}"
        ) from exc
    if not password:
        raise RedisPasswordError(f"env {PASSWORD_FILE_ENV} {path}: the file is empty")
    return password


def resolve_redis_password(environ: Mapping[str, str] | None = None) -> str:
    """The password: from the file env SLUICE_REDIS_PASSWORD_FILE names (it wins), else env
    SLUICE_REDIS_PASSWORD; empty = none."""
    env = os.environ if environ is None else environ
    path = env.get(PASSWORD_FILE_ENV, "").strip()
    return read_password_file(path) if path else env.get(PASSWORD_ENV, "").strip()


def redis_password_env(password: str) -> dict[str, str]:
    """The environment entries that give a child exactly this password (empty = none), whatever this
    process's own environment says."""
    return {PASSWORD_ENV: password, PASSWORD_FILE_ENV: ""}


def new_redis_password() -> str:
    """A fresh random password: 64 hex digits (nothing a redis.conf line or a URL would need to quote)."""
    return secrets.token_hex(32)


def write_private_file(path: str, text: str) -> str:
    """Write `text` to `path`, readable by this user only (mode 0600, also when the file existed: O_TRUNC
    keeps an old file's mode); returns the path."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.chmod(path, 0o600)
    return path


def redis_conf_line(password: str) -> str:
    """The redis.conf line that makes Redis require `password`; refused when a config line could not hold it
    (whitespace, quotes or control characters would be parsed as more arguments or cut it short)."""
    if not password or any(c.isspace() or c in "\"'\\" or not c.isprintable() for c in password):
        raise RedisPasswordError(
            "the Redis password must be non-empty printable text without whitespace, quotes or backslashes"
        )
    return f"requirepass {password}\n"
