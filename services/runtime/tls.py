"""TLS for the stack's HTTP services (coordinator, engine, role status servers) and their clients.

A server with `--tls-cert-file` and `--tls-key-file` (env SLUICE_TLS_CERT_FILE, SLUICE_TLS_KEY_FILE) serves
HTTPS only; with `--tls-client-ca-file` (SLUICE_TLS_CLIENT_CA_FILE) it also requires a client certificate
signed by that CA (mutual TLS). Clients verify the server by default: against the system's CAs, or only
against SLUICE_TLS_CA_FILE when that is set; they present SLUICE_TLS_CLIENT_CERT_FILE / _KEY_FILE when set.
The same variables serve every process of a stack, like the token (services/runtime/auth_token.py)."""

from __future__ import annotations

import os
import ssl
from typing import Mapping

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

CERT_ENV = "SLUICE_TLS_CERT_FILE"
KEY_ENV = "SLUICE_TLS_KEY_FILE"
CLIENT_CA_ENV = "SLUICE_TLS_CLIENT_CA_FILE"
CA_ENV = "SLUICE_TLS_CA_FILE"
CLIENT_CERT_ENV = "SLUICE_TLS_CLIENT_CERT_FILE"
CLIENT_KEY_ENV = "SLUICE_TLS_CLIENT_KEY_FILE"


class TLSError(ValueError):
    """A TLS setting names a file that cannot be read, or a certificate without its key."""


def _readable(flag: str, path: str) -> None:
    try:
        with open(path, "rb") as f:
            f.read(1)
    except OSError as exc:
        raise TLSError(f"{flag} {path}: cannot read it: {exc.strerror or exc}") from exc


class TLSSettings(BaseSettings):
    """An HTTP service's TLS: a server certificate and key (both or neither), optionally a CA its clients'
    certificates must be signed by."""

    model_config = SettingsConfigDict(populate_by_name=True)

    tls_cert_file: str = Field(
        "",
        validation_alias=CERT_ENV,
        description=(
            "PEM server certificate (chain): serve HTTPS instead of HTTP; needs --tls-key-file; empty = plain HTTP"
        ),
    )
    tls_key_file: str = Field("", validation_alias=KEY_ENV, description="PEM private key of --tls-cert-file")
    tls_client_ca_file: str = Field(
        "",
        validation_alias=CLIENT_CA_ENV,
        description=(
            "PEM CA: require a client certificate signed by it (mutual TLS; with --tls-cert-file); empty = none"
        ),
    )

    @model_validator(mode="after")
    def _check_tls_files(self) -> "TLSSettings":
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise TLSError("--tls-cert-file and --tls-key-file go together: give both or neither")
        if self.tls_client_ca_file and not self.tls_cert_file:
            raise TLSError("--tls-client-ca-file needs --tls-cert-file and --tls-key-file")
        for flag, path in (
            ("--tls-cert-file", self.tls_cert_file),
            ("--tls-key-file", self.tls_key_file),
            ("--tls-client-ca-file", self.tls_client_ca_file),
        ):
            if path:
                _readable(flag, path)
        return self

    def uvicorn_options(self) -> dict:
        """uvicorn.Config keyword arguments: HTTPS with this certificate (and client verification), or none."""
        if not self.tls_cert_file:
            return {}
        options: dict[str, object] = {"ssl_certfile": self.tls_cert_file, "ssl_keyfile": self.tls_key_file}
        if self.tls_client_ca_file:
            options.update(ssl_ca_certs=self.tls_client_ca_file, ssl_cert_reqs=ssl.CERT_REQUIRED)
        return options


def client_ssl_context(environ: Mapping[str, str] | None = None) -> ssl.SSLContext:
    """What an HTTPS client of the stack trusts and presents: the server is verified (certificate and host
    name) against SLUICE_TLS_CA_FILE when set, else the system's CAs; a client certificate is presented when
    SLUICE_TLS_CLIENT_CERT_FILE is set."""
    env = os.environ if environ is None else environ
    context = ssl.create_default_context(cafile=env.get(CA_ENV) or None)
    if env.get(CLIENT_CERT_ENV):
        context.load_cert_chain(env[CLIENT_CERT_ENV], env.get(CLIENT_KEY_ENV) or None)
    return context
