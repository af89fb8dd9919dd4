"""TLS for every service, with a CA and certificates this test makes: the coordinator, the engine and a role's
status server (real processes) serve HTTPS, the controller and shards gRPC over TLS, with or without client
certificates; the clients verify the server by default (an unknown CA fails), trust SLUICE_TLS_CA_FILE, and
present a client certificate where the server requires one (mutual TLS)."""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import shutil
import ssl

import grpc
import httpx
import pytest
import torch
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pydantic import ValidationError

from services.dcs.client import DCSClient, DCSUnreachable
from services.dcs.config import DCSConfig
from services.model.init_model import init_model
from services.runtime.auth_token import token_env
from services.runtime.grpc_tls import channel_target
from services.runtime.processes import ChildProcess, free_port, sluice_argv, start_redis
from services.runtime.tls import CA_ENV, CLIENT_CERT_ENV, CLIENT_KEY_ENV, client_ssl_context
from services.sglang_protocol.client import SGLangClient
from services.transferqueue.client.queue import TransferQueue
from tests.node_package import cli

pytestmark = pytest.mark.one_worker  # its tests share a costly module fixture: ./dev test runs them on one worker

TOKEN = "tls-s3cret"


def _write(path, data: bytes) -> str:
    with open(path, "wb") as f:
        f.write(data)
    return str(path)


def _issue(directory, name: str, issuer=None, ca: bool = False, server: bool = True) -> tuple[str, str, tuple]:
    """(certificate file, key file, (certificate, key)) signed by `issuer` (self-signed when None)."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    signer_cert, signer_key = issuer or (None, key)
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(signer_cert.subject if signer_cert else subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if server and not ca:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
    cert = builder.sign(signer_key, hashes.SHA256())
    cert_file = _write(os.path.join(directory, f"{name}.crt"), cert.public_bytes(serialization.Encoding.PEM))
    key_file = _write(
        os.path.join(directory, f"{name}.key"),
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
    )
    return cert_file, key_file, (cert, key)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("pki"))
    ca_file, _, ca = _issue(d, "sluice-ca", ca=True)
    server_cert, server_key, _ = _issue(d, "server", issuer=ca)
    client_cert, client_key, _ = _issue(d, "client", issuer=ca, server=False)
    other_ca_file, _, _ = _issue(d, "other-ca", ca=True)
    return {
        "ca": ca_file,
        "cert": server_cert,
        "key": server_key,
        "client_cert": client_cert,
        "client_key": client_key,
        "other_ca": other_ca_file,
        "dir": d,
    }


def trusting(ca: str, client_cert: tuple[str, str] | None = None) -> ssl.SSLContext:
    env = {CA_ENV: ca}
    if client_cert:
        env.update({CLIENT_CERT_ENV: client_cert[0], CLIENT_KEY_ENV: client_cert[1]})
    return client_ssl_context(env)


def start(
    name: str, argv: list[str], env: dict, log_dir: str, ready_url: str, verify: ssl.SSLContext, timeout_s: float = 90
):
    proc = ChildProcess(name, argv, os.path.join(log_dir, f"{name}.log"), env={**token_env(TOKEN), **env})

    def ready() -> bool:
        try:
            return httpx.get(ready_url, verify=verify, timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    proc.wait_until(ready, timeout_s)
    return proc


@pytest.fixture(scope="module")
def mutual_tls_dcs(pki):
    redis, redis_url = start_redis(log_dir=pki["dir"])
    port = free_port()
    env = {
        "SLUICE_TLS_CERT_FILE": pki["cert"],
        "SLUICE_TLS_KEY_FILE": pki["key"],
        "SLUICE_TLS_CLIENT_CA_FILE": pki["ca"],
        "HF_HUB_OFFLINE": "1",
    }
    proc = start(
        "dcs",
        sluice_argv("dcs", "--host", "127.0.0.1", "--port", str(port), "--redis-url", redis_url),
        env,
        pki["dir"],
        f"https://127.0.0.1:{port}/readyz",
        trusting(pki["ca"], (pki["client_cert"], pki["client_key"])),
    )
    yield port
    proc.stop()
    redis.stop()


def test_the_coordinator_serves_https_to_clients_that_verify_it_and_present_a_certificate(
    pki, mutual_tls_dcs, monkeypatch
):
    url = f"https://127.0.0.1:{mutual_tls_dcs}"
    monkeypatch.setenv(CA_ENV, pki["ca"])
    monkeypatch.setenv(CLIENT_CERT_ENV, pki["client_cert"])
    monkeypatch.setenv(CLIENT_KEY_ENV, pki["client_key"])
    with DCSClient(url, token=TOKEN) as dcs:
        assert dcs.topology().roles == {}
    monkeypatch.delenv(CLIENT_CERT_ENV)
    with DCSClient(url, token=TOKEN) as dcs, pytest.raises(DCSUnreachable):
        dcs.topology()  # no client certificate: the handshake fails
    monkeypatch.setenv(CLIENT_CERT_ENV, pki["client_cert"])
    monkeypatch.setenv(CA_ENV, pki["other_ca"])
    with DCSClient(url, token=TOKEN) as dcs, pytest.raises(DCSUnreachable, match="CERTIFICATE_VERIFY_FAILED"):
        dcs.topology()  # a server its CA did not sign is refused
    monkeypatch.delenv(CA_ENV)
    with DCSClient(url, token=TOKEN) as dcs, pytest.raises(DCSUnreachable, match="CERTIFICATE_VERIFY_FAILED"):
        dcs.topology()  # verification is on by default: the system's CAs do not know this one
    with DCSClient(f"http://127.0.0.1:{mutual_tls_dcs}", token=TOKEN) as dcs, pytest.raises(DCSUnreachable):
        dcs.topology()  # no plain HTTP on a TLS port


def test_the_engine_serves_https_with_the_token(pki, tmp_path, monkeypatch):
    model_dir = init_model(str(tmp_path / "tiny"), preset="tiny", arch="qwen2", seed=7)
    port = free_port()
    env = {"SLUICE_TLS_CERT_FILE": pki["cert"], "SLUICE_TLS_KEY_FILE": pki["key"], "HF_HUB_OFFLINE": "1"}
    proc = start(
        "engine",
        sluice_argv("engine", "--model", model_dir, "--host", "127.0.0.1", "--port", str(port)),
        env,
        pki["dir"],
        f"https://127.0.0.1:{port}/health",
        trusting(pki["ca"]),
    )
    try:
        monkeypatch.setenv(CA_ENV, pki["ca"])
        engine = SGLangClient(f"https://127.0.0.1:{port}", timeout_s=30, api_key=TOKEN)
        assert engine.weight_version() == "default"
        engine.close()
        assert httpx.get(f"https://127.0.0.1:{port}/model_info", verify=trusting(pki["ca"])).status_code == 401
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            httpx.get(f"https://127.0.0.1:{port}/health", verify=trusting(pki["other_ca"]))
    finally:
        proc.stop()


def test_tls_settings_that_cannot_work_are_startup_errors(pki, tmp_path):
    with pytest.raises(ValidationError, match="go together"):
        DCSConfig(tls_cert_file=pki["cert"])
    with pytest.raises(ValidationError, match="needs --tls-cert-file"):
        DCSConfig(tls_client_ca_file=pki["ca"])
    missing = str(tmp_path / "missing.key")
    with pytest.raises(ValidationError, match=f"--tls-key-file {missing}: cannot read it"):
        DCSConfig(tls_cert_file=pki["cert"], tls_key_file=missing)


def grpc_health(address: str, credentials) -> grpc.StatusCode:
    """The health check's status code over a TLS (credentials) or plain (None) channel: OK only when the
    server answers SERVING (a shard answers NOT_SERVING until the controller has its registration)."""
    channel = grpc.secure_channel(address, credentials) if credentials else grpc.insecure_channel(address)
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3)
        except grpc.RpcError as err:
            return err.code()
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        return grpc.StatusCode.UNAVAILABLE
    return grpc.StatusCode.OK


@pytest.fixture(scope="module")
def tls_transferqueue(pki):
    """A controller and a shard serving TLS and requiring client certificates; the shard dials the
    controller, and the controller the shard, over TLS."""
    redis, redis_url = start_redis(log_dir=pki["dir"])
    env = {
        **token_env(TOKEN),
        "SLUICE_TLS_CERT_FILE": pki["cert"],
        "SLUICE_TLS_KEY_FILE": pki["key"],
        "SLUICE_TLS_CLIENT_CA_FILE": pki["ca"],
        CA_ENV: pki["ca"],
        CLIENT_CERT_ENV: pki["client_cert"],
        CLIENT_KEY_ENV: pki["client_key"],
    }
    controller_port, shard_port = free_port(), free_port()
    controller = ChildProcess(
        "tq-controller",
        sluice_argv("tq-controller", "--host", "127.0.0.1", "--port", str(controller_port), "--redis-url", redis_url),
        os.path.join(pki["dir"], "controller.log"),
        env=env,
    )
    shard = ChildProcess(
        "tq-shard",
        sluice_argv(
            "tq-shard",
            "--host",
            "127.0.0.1",
            "--port",
            str(shard_port),
            "--advertise-host",
            "127.0.0.1",
            "--shard-id",
            "s0",
            "--controller",
            f"tls://127.0.0.1:{controller_port}",
        ),
        os.path.join(pki["dir"], "shard.log"),
        env=env,
    )
    _, credentials = channel_target(f"tls://127.0.0.1:{shard_port}", env)
    # the shard reports SERVING once it registered with the controller over TLS
    shard.wait_until(lambda: grpc_health(f"127.0.0.1:{shard_port}", credentials) == grpc.StatusCode.OK, 60)
    yield f"127.0.0.1:{controller_port}", env
    shard.stop()
    controller.stop()
    redis.stop()


def test_transferqueue_serves_tls_to_clients_that_verify_it_and_present_a_certificate(
    tls_transferqueue, pki, monkeypatch
):
    address, env = tls_transferqueue
    for name in (CA_ENV, CLIENT_CERT_ENV, CLIENT_KEY_ENV):
        monkeypatch.setenv(name, env[name])
    with TransferQueue(f"tls://{address}", token=TOKEN) as tq:  # the shard, too, is reached over TLS
        tq.create_partition("p")
        tq.register_task("t", ["x"])
        rows = tq.put("p", {"x": torch.arange(3)})
        assert tq.get("p", rows, ["x"])["x"].tolist() == [0, 1, 2]
    assert grpc_health(address, channel_target(f"tls://{address}")[1]) == grpc.StatusCode.OK
    assert grpc_health(address, None) == grpc.StatusCode.UNAVAILABLE  # no plain gRPC on a TLS port
    without_certificate = {CA_ENV: pki["ca"]}
    assert (
        grpc_health(address, channel_target(f"tls://{address}", without_certificate)[1]) == grpc.StatusCode.UNAVAILABLE
    )
    other_ca = {**env, CA_ENV: pki["other_ca"]}
    assert grpc_health(address, channel_target(f"tls://{address}", other_ca)[1]) == grpc.StatusCode.UNAVAILABLE


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not on PATH: the Node.js client cannot run")
def test_the_node_client_speaks_tls_to_the_controller_and_the_shard(tls_transferqueue, node_client):
    """The second-language client, too: it verifies the servers against the CA, presents its certificate
    (the servers require one), and dials the shard over TLS because it reached the controller that way."""
    address, env = tls_transferqueue
    client_env = {**{name: env[name] for name in (CA_ENV, CLIENT_CERT_ENV, CLIENT_KEY_ENV)}, **token_env(TOKEN)}
    columns = json.dumps({"x": {"dtype": "int64", "values": [4, 5, 6]}})
    put = cli(
        node_client,
        "put",
        f"tls://{address}",
        "--partition",
        "node-tls",
        "--create",
        "--columns",
        columns,
        env=client_env,
    )
    assert put["rows"] == [0, 1, 2]
    got = cli(
        node_client,
        "get",
        f"tls://{address}",
        "--partition",
        "node-tls",
        "--rows",
        "[0, 1, 2]",
        "--fields",
        '["x"]',
        env=client_env,
    )
    assert got["columns"] == {"x": [4, 5, 6]}


def test_a_role_serves_its_status_over_https_and_reaches_the_coordinator_over_mutual_tls(pki, mutual_tls_dcs):
    """A role process (the advantage role, waiting for its run) with a certificate: /healthz over HTTPS to a
    client that trusts the CA, its other routes with the token only, no plain HTTP; it polls the coordinator,
    which requires client certificates, with its own."""
    redis, redis_url = start_redis(log_dir=pki["dir"])
    port = free_port()
    env = {
        "SLUICE_TLS_CERT_FILE": pki["cert"],
        "SLUICE_TLS_KEY_FILE": pki["key"],
        CA_ENV: pki["ca"],
        CLIENT_CERT_ENV: pki["client_cert"],
        CLIENT_KEY_ENV: pki["client_key"],
        "HF_HUB_OFFLINE": "1",
    }
    argv = sluice_argv(
        "advantage",
        "--run-id",
        "tls-run",
        "--dcs-url",
        f"https://127.0.0.1:{mutual_tls_dcs}",
        "--tq-controller",
        "127.0.0.1:1",
        "--redis-url",
        redis_url,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    )
    verify = trusting(pki["ca"])
    proc = start("advantage", argv, env, pki["dir"], f"https://127.0.0.1:{port}/healthz", verify)
    try:
        base = f"https://127.0.0.1:{port}"
        assert httpx.get(f"{base}/status", verify=verify).status_code == 401
        status = httpx.get(f"{base}/status", verify=verify, headers={"authorization": f"Bearer {TOKEN}"})
        assert status.status_code == 200 and status.json()["role"] == "advantage"
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            httpx.get(f"{base}/healthz", verify=trusting(pki["other_ca"]))
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=3)
        # waiting for its run, it asks the mutual-TLS coordinator, which answers (no such run yet), rather than
        # finding it unreachable
        log_file = os.path.join(pki["dir"], "advantage.log")
        proc.wait_until(lambda: "waiting for the run to be created" in open(log_file).read(), 30)
        assert "coordinator unreachable" not in open(log_file).read() and proc.proc.poll() is None
    finally:
        proc.stop()
        redis.stop()


def test_transferqueue_over_tls_with_server_certificates_only(pki, tmp_path, monkeypatch):
    """TLS without client certificates: a controller and a shard with a certificate each; a client that
    trusts the CA puts and reads; one that trusts another CA, or speaks plain gRPC, is refused."""
    redis, redis_url = start_redis(log_dir=str(tmp_path))
    env = {
        **token_env(TOKEN),
        "SLUICE_TLS_CERT_FILE": pki["cert"],
        "SLUICE_TLS_KEY_FILE": pki["key"],
        CA_ENV: pki["ca"],
    }
    controller_port, shard_port = free_port(), free_port()
    controller = ChildProcess(
        "tq-controller",
        sluice_argv("tq-controller", "--host", "127.0.0.1", "--port", str(controller_port), "--redis-url", redis_url),
        str(tmp_path / "controller.log"),
        env=env,
    )
    shard = ChildProcess(
        "tq-shard",
        sluice_argv(
            "tq-shard",
            "--host",
            "127.0.0.1",
            "--port",
            str(shard_port),
            "--advertise-host",
            "127.0.0.1",
            "--shard-id",
            "s0",
            "--controller",
            f"tls://127.0.0.1:{controller_port}",
        ),
        str(tmp_path / "shard.log"),
        env=env,
    )
    try:
        only_ca = {CA_ENV: pki["ca"]}
        shard.wait_until(
            lambda: (
                grpc_health(f"127.0.0.1:{shard_port}", channel_target(f"tls://127.0.0.1:{shard_port}", only_ca)[1])
                == grpc.StatusCode.OK
            ),
            60,
        )
        monkeypatch.setenv(CA_ENV, pki["ca"])
        monkeypatch.delenv(CLIENT_CERT_ENV, raising=False)
        monkeypatch.delenv(CLIENT_KEY_ENV, raising=False)
        address = f"127.0.0.1:{controller_port}"
        with TransferQueue(f"tls://{address}", token=TOKEN) as tq:
            tq.create_partition("p")
            tq.register_task("t", ["x"])
            rows = tq.put("p", {"x": torch.arange(4)})
            assert tq.get("p", rows, ["x"])["x"].tolist() == [0, 1, 2, 3]
        assert grpc_health(address, None) == grpc.StatusCode.UNAVAILABLE
        assert (
            grpc_health(address, channel_target(f"tls://{address}", {CA_ENV: pki["other_ca"]})[1])
            == grpc.StatusCode.UNAVAILABLE
        )
    finally:
        shard.stop()
        controller.stop()
        redis.stop()
