"""A coordinator on one machine as its own process (demo, tests, benchmarks)."""

from __future__ import annotations

import os
import tempfile

from services.runtime.auth_token import token_env
from services.runtime.redis_password import redis_password_env
from services.runtime.forked_process import ForkServerClient
from services.runtime.fork_server_choice import stack_forker
from services.runtime.processes import ChildProcess, StopsOnExit, free_port, http_ok, sluice_argv, start_redis


class LocalDCS(StopsOnExit):
    def __init__(
        self,
        redis_url: str | None = None,
        token: str = "",
        log_dir: str | None = None,
        args: tuple[str, ...] = (),
        port: int = 0,
        redis_password: str = "",
        forker: ForkServerClient | None = None,
        env: dict[str, str] | None = None,
    ):
        """`port`: the HTTP port on 127.0.0.1; 0 = a free one. `redis_password`: what `redis_url` requires.
        `forker`: a fork server to fork it from (fork_server_choice.stack_forker); `env`: added to its environment."""
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="sluice-dcs-")
        os.makedirs(self.log_dir, exist_ok=True)
        self.redis = None
        if redis_url is None:
            self.redis, redis_url = start_redis(log_dir=self.log_dir)
        self.redis_url = redis_url
        self.token = token
        self.redis_password = redis_password
        self.forker = stack_forker(forker)
        self.extra_env = dict(env or {})
        self.args = args
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: ChildProcess | None = None
        try:
            self.start()
        except BaseException:
            self.stop()
            raise

    def start(self) -> ChildProcess:
        # the token and the Redis password go in the environment, not argv: argv is in every user's process list
        self.proc = ChildProcess(
            "dcs",
            sluice_argv(
                "dcs", "--host", "127.0.0.1", "--port", str(self.port), "--redis-url", self.redis_url, *self.args
            ),
            os.path.join(self.log_dir, "dcs.log"),
            env={**self.extra_env, **token_env(self.token), **redis_password_env(self.redis_password)},
            forker=self.forker,
        )
        self.proc.wait_until(lambda: http_ok(self.url + "/readyz"), 30)
        return self.proc

    def stop(self) -> None:
        if self.proc:
            self.proc.stop()
        if self.redis:
            self.redis.stop()
