"""The stack's one token: read from --auth-token-file (which wins) or env SLUICE_AUTH_TOKEN, never from argv;
a file that cannot give a token is an error naming it; and the shared HTTP check in front of every route."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import ValidationError

from services.dcs.config import DCSConfig
from services.engine.config import EngineConfig
from services.rollout.config import RolloutConfig
from services.runtime.auth_token import TOKEN_ENV, TOKEN_FILE_ENV, resolve_token, token_env
from services.runtime.http_auth import require_bearer_token
from services.role.role_service import RoleStatus, build_status_app
from services.runtime.settings_cli import parse_settings
from services.transferqueue.controller.config import ControllerConfig
from services.transferqueue.shard.config import ShardConfig

CONFIGS = [DCSConfig, ControllerConfig, ShardConfig, RolloutConfig]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in (TOKEN_ENV, TOKEN_FILE_ENV, "SLUICE_DCS_AUTH_TOKEN"):
        monkeypatch.delenv(name, raising=False)


def token_file(tmp_path, text: str) -> str:
    path = tmp_path / "token"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("config", CONFIGS)
def test_every_service_reads_the_token_from_the_env_or_the_file_which_wins(config, tmp_path, monkeypatch):
    assert config().auth_token == ""  # neither: no auth
    monkeypatch.setenv(TOKEN_ENV, "from-env")
    assert config().auth_token == "from-env"
    assert config(auth_token_file=token_file(tmp_path, "from-file\n")).auth_token == "from-file"
    monkeypatch.setenv(TOKEN_FILE_ENV, token_file(tmp_path, "via-file-env"))
    assert config().auth_token == "via-file-env"
    assert "via-file-env" not in repr(config())  # settings get logged; the token is not a field


@pytest.mark.parametrize("config", CONFIGS)
def test_the_token_itself_is_no_flag(config, capsys):
    with pytest.raises(SystemExit):
        parse_settings(config, ["--auth-token", "s3cret"], "sluice x", "")
    assert "unrecognized arguments: --auth-token" in capsys.readouterr().err
    with pytest.raises(ValidationError):
        config(auth_token="s3cret")


def test_a_file_that_gives_no_token_is_a_startup_error_naming_it(tmp_path, capsys):
    for path, why in (
        (str(tmp_path / "missing"), "cannot read it"),
        (token_file(tmp_path, " \n"), "is empty"),
        (str(tmp_path), "cannot read it"),
    ):
        with pytest.raises(SystemExit) as exit_:
            parse_settings(EngineConfig, ["--model", "m", "--auth-token-file", path], "sluice engine", "")
        assert exit_.value.code == 2
        assert f"--auth-token-file {path}: " in (err := capsys.readouterr().err) and why in err


def test_a_retired_per_service_token_variable_fails_instead_of_being_ignored(monkeypatch):
    monkeypatch.setenv("SLUICE_DCS_AUTH_TOKEN", "old")
    with pytest.raises(ValidationError, match=f"SLUICE_DCS_AUTH_TOKEN is no longer read: set {TOKEN_ENV}"):
        DCSConfig()


def test_children_get_exactly_the_launchers_token_whatever_its_own_environment(tmp_path):
    assert resolve_token("", token_env("t")) == "t"
    assert resolve_token("", token_env("")) == ""
    assert token_env("")[TOKEN_FILE_ENV] == ""  # an inherited token file cannot win over the launcher's choice


def app_with_routes(token: str) -> TestClient:
    app = FastAPI()
    calls = []

    @app.post("/change")
    async def change():
        calls.append(1)
        return {"changed": len(calls)}

    @app.get("/healthz")
    async def healthz():
        return {"ok": True}

    require_bearer_token(app, token, {"/healthz"})
    client = TestClient(app)
    client.calls = calls
    return client


def test_routes_refuse_a_missing_or_wrong_token_and_change_nothing():
    client = app_with_routes("s3cret")
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "s3cret"}):
        r = client.post("/change", headers=headers)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert "s3cret" not in r.text
    assert client.calls == []
    assert client.get("/openapi.json").status_code == 401 and client.get("/docs").status_code == 401
    assert client.post("/change", headers={"authorization": "Bearer s3cret"}).json() == {"changed": 1}
    assert client.get("/healthz").status_code == 200  # liveness stays open


def test_without_a_token_routes_are_open():
    client = app_with_routes("")
    assert client.post("/change").json() == {"changed": 1}


def test_a_roles_status_server_keeps_only_liveness_and_readiness_open():
    status = RoleStatus("advantage")
    status.running()
    client = TestClient(build_status_app(status, "s3cret"))
    for path in ("/status", "/metrics", "/spans", "/openapi.json"):
        assert client.get(path).status_code == 401, path
        assert client.get(path, headers={"authorization": "Bearer wrong"}).status_code == 401, path
        assert client.get(path, headers={"authorization": "Bearer s3cret"}).status_code == 200, path
    assert client.get("/healthz").status_code == 200
    assert client.get("/readyz").json() == {"ready": True}
