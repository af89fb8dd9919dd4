"""TLS for TransferQueue's gRPC: server credentials from a service's TLSSettings, and the client side of an
address. A client uses TLS for an address written `tls://host:port` (the scheme a user puts in
`--tq-controller` or `--controller`), verifying the server against SLUICE_TLS_CA_FILE when set, else the
system's CAs, and presenting SLUICE_TLS_CLIENT_CERT_FILE when set (services/runtime/tls.py)."""

from __future__ import annotations

import os
from typing import Mapping

import grpc

from services.runtime.tls import CA_ENV, CLIENT_CERT_ENV, CLIENT_KEY_ENV, TLSSettings

TLS_SCHEME = "tls://"


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def server_credentials(settings: TLSSettings) -> grpc.ServerCredentials | None:
    """The server's certificate and key (and the CA its clients' certificates must be signed by, when
    set: then a client without one is refused); None = plain gRPC."""
    if not settings.tls_cert_file:
        return None
    client_ca = _read(settings.tls_client_ca_file) if settings.tls_client_ca_file else None
    return grpc.ssl_server_credentials(
        [(_read(settings.tls_key_file), _read(settings.tls_cert_file))],
        root_certificates=client_ca,
        require_client_auth=client_ca is not None,
    )


def channel_target(
    address: str, environ: Mapping[str, str] | None = None
) -> tuple[str, grpc.ChannelCredentials | None]:
    """(host:port, credentials) for `tls://host:port`; (address, None) for a plain address."""
    if not address.startswith(TLS_SCHEME):
        return address, None
    env = os.environ if environ is None else environ
    key = env.get(CLIENT_KEY_ENV) or env.get(CLIENT_CERT_ENV)  # a PEM may hold both
    cert = env.get(CLIENT_CERT_ENV)
    credentials = grpc.ssl_channel_credentials(
        root_certificates=_read(env[CA_ENV]) if env.get(CA_ENV) else None,
        private_key=_read(key) if key and cert else None,
        certificate_chain=_read(cert) if cert else None,
    )
    return address[len(TLS_SCHEME) :], credentials


def with_tls(address: str, tls: bool) -> str:
    """`address` to dial with TLS when `tls` (a shard is dialled the way its controller is)."""
    return TLS_SCHEME + address if tls and not address.startswith(TLS_SCHEME) else address


def add_port(server: grpc.aio.Server, address: str, settings: TLSSettings) -> int:
    """Bind `address`: TLS when the settings name a certificate, else plain; the bound port."""
    credentials = server_credentials(settings)
    if credentials is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, credentials)
