from __future__ import annotations

import os

import pytest

from services.model.init_model import init_model
from services.runtime.auth_token import token_env
from services.runtime.processes import ChildProcess, free_port, http_ok, sluice_argv


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return init_model(str(tmp_path_factory.mktemp("tiny-qwen2")), preset="tiny", arch="qwen2", seed=7)


def start_engine(model_dir: str, log_dir, *args: str, token: str = "",
                 open_weight_updates: bool = True) -> tuple[ChildProcess, str]:
    """An engine process with `token` (in its environment); without one, its weight updates are open unless
    `open_weight_updates` is False (tests of weight sync run without a token)."""
    port = free_port()
    if not token and open_weight_updates:
        args = ("--allow-unauthenticated-weight-updates", *args)
    proc = ChildProcess("engine", sluice_argv("engine", "--model", model_dir, "--host", "127.0.0.1",
                                              "--port", str(port), *args),
                        os.path.join(str(log_dir), f"engine-{port}.log"),
                        env={"HF_HUB_OFFLINE": "1", **token_env(token)})
    url = f"http://127.0.0.1:{port}"
    proc.wait_until(lambda: http_ok(url + "/health"), 90)
    return proc, url


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory):
    proc, url = start_engine(tiny_model_dir, tmp_path_factory.mktemp("engine"))
    yield url
    proc.stop()
