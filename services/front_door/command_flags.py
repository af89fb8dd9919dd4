"""The flags the front door's commands share. --help shows every default (HelpWithDefaults). A coordinator
is reached by its URL (`--coordinator`, env SLUICE_COORDINATOR_URL)
and the bearer token (env SLUICE_AUTH_TOKEN or `--auth-token-file`; never on the command line, where
every user of the machine could read it in the process list)."""

from __future__ import annotations

import argparse
import os

from services.dcs.client import DCSClient
from services.runtime.auth_token import AuthTokenError, resolve_token

DEFAULT_COORDINATOR = "http://127.0.0.1:7300"


def add_coordinator_flags(parser: argparse.ArgumentParser, url: bool = True) -> None:
    if url:
        parser.add_argument(
            "--coordinator",
            default=os.environ.get("SLUICE_COORDINATOR_URL", DEFAULT_COORDINATOR),
            help="the coordinator's URL [env SLUICE_COORDINATOR_URL]",
        )
    parser.add_argument(
        "--auth-token-file",
        default=os.environ.get("SLUICE_AUTH_TOKEN_FILE", ""),
        help="a file holding the bearer token; without it the token comes from env "
        "SLUICE_AUTH_TOKEN (empty = no auth) [env SLUICE_AUTH_TOKEN_FILE]",
    )


def auth_token(args: argparse.Namespace) -> str:
    """The token from --auth-token-file, else env SLUICE_AUTH_TOKEN, as every service reads it
    (services/runtime/auth_token.py); a file that cannot be read or is empty is an error."""
    try:
        return resolve_token(args.auth_token_file)
    except AuthTokenError as exc:
        raise SystemExit(f"sluice: {exc}") from exc


def coordinator_client(args: argparse.Namespace, url: str | None = None) -> DCSClient:
    return DCSClient(url or args.coordinator, token=auth_token(args) or None)
