"""A TransferQueue on one machine: private Redis, one controller and N shards, each its own process."""

from __future__ import annotations

import functools
import os
import tempfile

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.runtime.auth_token import token_env
from services.runtime.redis_password import redis_password_env
from services.runtime.forked_process import ForkServerClient
from services.runtime.fork_server_choice import stack_forker
from services.runtime.processes import ChildProcess, StopsOnExit, free_port, listening, sluice_argv, start_redis


def grpc_serving(address: str, service: str = "") -> bool:
    host, port = address.rsplit(":", 1)
    if not listening(host.strip("[]"), int(port)):  # a starting server: refused cheaply, without a channel
        return False
    try:
        with grpc.insecure_channel(address) as channel:
            res = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=0.5)
            return res.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


class LocalTransferQueue(StopsOnExit):
    def __init__(
        self,
        shards: int = 1,
        token: str = "",
        redis_url: str | None = None,
        log_dir: str | None = None,
        shard_args: tuple[str, ...] = (),
        controller_args: tuple[str, ...] = (),
        data_dir: str | None = None,
        redis_password: str = "",
        controller_port: int = 0,
        forker: ForkServerClient | None = None,
        env: dict[str, str] | None = None,
    ):
        """`data_dir`: each shard journals to data_dir/<shard id> (a killed shard restarts with its rows);
        `redis_password`: what `redis_url` requires; `controller_port`: the controller's (0 = a free one);
        `forker`: a fork server to fork the controller and shards from (fork_server_choice.stack_forker); `env`: added
        to their environment."""
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="sluice-tq-")
        os.makedirs(self.log_dir, exist_ok=True)
        self.token = token
        self.redis_password = redis_password
        self.forker = stack_forker(forker)
        self.extra_env = dict(env or {})
        self.redis = None
        if redis_url is None:
            self.redis, redis_url = start_redis(log_dir=self.log_dir)
        self.redis_url = redis_url
        self.shard_args = shard_args
        self.data_dir = data_dir
        self.controller_args = controller_args
        self.controller_port = controller_port or free_port()
        self.controller_address = f"127.0.0.1:{self.controller_port}"
        self.controller: ChildProcess | None = None
        self.shards: list[ChildProcess] = []
        self.shard_addresses: list[str] = []
        try:
            # all at once (a shard retries its registration until the controller answers), then waited for:
            # one after another, each start's imports (~1 CPU s) would add up on the way to the first step
            self.start_controller(wait=False)
            for i in range(shards):
                self.start_shard(f"shard-{i}", ready=False)
            self.controller_ready()
            for proc, address in zip(self.shards, self.shard_addresses):
                proc.wait_until(functools.partial(grpc_serving, address), 30)
        except BaseException:
            self.stop()
            raise

    def _env(self) -> dict[str, str]:
        # the environment, not argv: argv is in every user's process list
        return {**self.extra_env, **token_env(self.token), **redis_password_env(self.redis_password)}

    def start_controller(self, wait: bool = True) -> ChildProcess:
        self.controller = ChildProcess(
            "tq-controller",
            sluice_argv(
                "tq-controller",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.controller_port),
                "--redis-url",
                self.redis_url,
                *self.controller_args,
            ),
            os.path.join(self.log_dir, "controller.log"),
            env=self._env(),
            forker=self.forker,
        )
        if wait:
            self.controller_ready()
        return self.controller

    def controller_ready(self) -> None:
        assert self.controller is not None
        self.controller.wait_until(lambda: grpc_serving(self.controller_address), 30)

    def start_shard(self, shard_id: str, port: int | None = None, ready: bool = True) -> ChildProcess:
        """A new shard; ready=False returns as soon as its process is started, before it serves."""
        port = port or free_port()
        proc = self._spawn_shard(shard_id, port, ready)
        self.shards.append(proc)
        self.shard_addresses.append(f"127.0.0.1:{port}")
        return proc

    def restart_shard(self, i: int) -> ChildProcess:
        """Start shard i again (killing it first if it still runs) on its port and data directory, as a
        supervisor would: with a data_dir it comes back with every row it had acknowledged."""
        self.shards[i].kill()
        shard_id = self.shards[i].name.split(" ", 1)[1]
        self.shards[i] = self._spawn_shard(shard_id, int(self.shard_addresses[i].rsplit(":", 1)[1]))
        return self.shards[i]

    def _spawn_shard(self, shard_id: str, port: int, ready: bool = True) -> ChildProcess:
        address = f"127.0.0.1:{port}"
        proc = ChildProcess(
            f"tq-shard {shard_id}",
            sluice_argv(
                "tq-shard",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--advertise-host",
                "127.0.0.1",
                "--shard-id",
                shard_id,
                "--controller",
                self.controller_address,
                *(("--data-dir", os.path.join(self.data_dir, shard_id)) if self.data_dir else ()),
                *self.shard_args,
            ),
            os.path.join(self.log_dir, f"{shard_id}.log"),
            env=self._env(),
            forker=self.forker,
        )
        if ready:
            proc.wait_until(lambda: grpc_serving(address), 30)
        return proc

    def stop(self) -> None:
        for proc in self.shards:
            proc.stop()
        if self.controller:
            self.controller.stop()
        if self.redis:
            self.redis.stop()
