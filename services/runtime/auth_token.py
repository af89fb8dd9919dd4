"""The one bearer token of a Sluice stack: where every service reads it from, and how a launcher hands it on.

Every service (coordinator, TransferQueue controller and shard, engine, rollout, forward, advantage, trainer)
takes the token from the file named by `--auth-token-file` (env SLUICE_AUTH_TOKEN_FILE), else from env
SLUICE_AUTH_TOKEN; empty = no authentication. Never from a flag holding the token itself: argv is readable by
every user of the machine (/proc/<pid>/cmdline, `ps`). A launcher passes it to its children through their
environment (`token_env`)."""

from __future__ import annotations

import os
from typing import Mapping

from pydantic import Field, PrivateAttr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

TOKEN_ENV = "SLUICE_AUTH_TOKEN"
TOKEN_FILE_ENV = "SLUICE_AUTH_TOKEN_FILE"


class AuthTokenError(ValueError):
    """The token file is missing, unreadable or empty, or a retired token setting is still set."""


def read_token_file(path: str) -> str:
    """The file's content without surrounding whitespace (a trailing newline is usual); an error naming the
    file when it cannot be read or holds nothing, since silently running without auth would be worse."""
    try:
        with open(path, encoding="utf-8") as f:
            token = f.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise AuthTokenError(
            f"--auth-token-file {path}: cannot read it: {getattr(exc, 'strerror', None) or exc}"
        ) from exc
    if not token:
        raise AuthTokenError(f"--auth-token-file {path}: the file is empty")
    return token


def resolve_token(token_file: str = "", environ: Mapping[str, str] | None = None) -> str:
    """The token: from `token_file` when one is named (it wins over the env), else env SLUICE_AUTH_TOKEN."""
    if token_file:
        return read_token_file(token_file)
    return (os.environ if environ is None else environ).get(TOKEN_ENV, "").strip()


def token_env(token: str) -> dict[str, str]:
    """The environment entries that give a child process exactly this token (empty = none), whatever this
    process's own environment says."""
    return {TOKEN_ENV: token, TOKEN_FILE_ENV: ""}


class AuthTokenSettings(BaseSettings):
    """A service's settings with the stack's token: `auth_token` is resolved once, when the settings are made,
    and is not a field (so it is in no flag, no repr and no log of the settings)."""

    model_config = SettingsConfigDict(populate_by_name=True)

    auth_token_file: str = Field(
        "",
        validation_alias=TOKEN_FILE_ENV,
        description=(
            f"file holding the bearer token every caller must send (wins over env {TOKEN_ENV}; empty = read "
            f"{TOKEN_ENV}; both empty = no auth). Never pass the token itself on the command line"
        ),
    )
    _auth_token: str = PrivateAttr("")

    @model_validator(mode="after")
    def _resolve_auth_token(self) -> "AuthTokenSettings":
        prefix = self.model_config.get("env_prefix", "")
        retired = f"{prefix}AUTH_TOKEN".upper()
        if prefix and retired != TOKEN_ENV and os.environ.get(retired):  # it would be ignored: fail instead
            raise AuthTokenError(f"env {retired} is no longer read: set {TOKEN_ENV} (or --auth-token-file) instead")
        self._auth_token = resolve_token(self.auth_token_file)
        return self

    @property
    def auth_token(self) -> str:
        """The resolved bearer token; empty = no auth."""
        return self._auth_token
