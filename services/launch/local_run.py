"""A whole run on one machine: a private Redis, TransferQueue (controller + shard), the coordinator,
engines (built-in, or real SGLang servers: services/launch/sglang_engine.py) and every role the run needs, each its own
process (a built-in engine's and a role's forked from one fork server that has done their heavy imports:
services/runtime/fork_server.py), stopped with SIGTERM. A second run can share the first one's stack (`stack=`):
it starts only its own engines and roles, under its own run id."""

from __future__ import annotations

import os
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, Callable, TypeVar

import redis

from services.dcs.client import DCSClient
from services.dcs.local import LocalDCS
from services.run_contract.run_config import RunConfig
from services.run_state.trainer_progress import TrainerProgress, read_progress, trained_steps
from services.runtime.auth_token import token_env
from services.runtime.redis_clients import sync_redis
from services.runtime.redis_password import redis_password_env
from services.launch.sglang_engine import START_S as SGLANG_START_S, SGLangProcess
from services.launch.sglang_flags import engine_flags
from services.launch.role_commands import RoleProcess, role_commands, stack_flags
from services.launch.supervision import ProcessSupervisor
from services.runtime.forked_process import ForkServerClient
from services.runtime.fork_server_choice import fork_server_for
from services.runtime.processes import (
    ChildProcess,
    StopsOnExit,
    child_env,
    free_port,
    http_ok,
    sluice_argv,
    start_redis,
    stop_together,
)
from services.transferqueue.local_stack import LocalTransferQueue

STOP_S = 10.0  # the engines and roles, together: a clean exit, CUDA teardown and a final checkpoint included
STACK_STOP_S = 5.0  # then the stack's services, together: no role is left to serve
ENGINE_START_S = 120.0  # an engine loading its model (and, on a GPU, starting CUDA) until /health answers
ROLE_START_S = 90.0  # a role service until /healthz answers (all start at once, so they share the cores)
# every engine's and role's, beside the token; a fork server started with it (start_fork_server) forks them
SERVICE_ENV = {"HF_HUB_OFFLINE": "1"}


T = TypeVar("T")


def _started(service: T | None, name: str) -> T:
    """What restart(name) starts again; RuntimeError when this run never started it (processes() has no such name)."""
    if service is None:
        raise RuntimeError(f"cannot restart {name}: this run did not start it")
    return service


class LocalRun(StopsOnExit):
    # set by _start: where the services are (a shared stack's, or the ones it starts)
    engine_urls: list[str]
    redis_url: str
    dcs_url: str
    tq_controller: str

    def __init__(
        self,
        run: RunConfig,
        log_dir: str | None = None,
        engines: int = 1,
        token: str = "",
        checkpoint_dir: str | None = None,
        engine_args: tuple[str, ...] = (),
        role_args: dict[str, list[str]] | None = None,
        trainer_ranks: int = 1,
        stack: "LocalRun | None" = None,
        submit: bool = True,
        redis_url: str | None = None,
        dcs_port: int = 0,
        python_path: tuple[str, ...] = (),
        redis_data_dir: str | None = None,
        engine: str = "builtin",
        redis_password: str = "",
        on_stack_up: "Callable[[LocalRun], None] | None" = None,
        judge: tuple[str, tuple[str, ...]] | None = None,
        forker: ForkServerClient | None = None,
    ):
        """`stack`: run on that run's Redis, TransferQueue and coordinator (which it keeps owning) instead of
        starting new ones. `submit=False`: the roles start and wait until `submit()` creates the run.
        `redis_url`: keep state in that Redis instead of a private one; `dcs_port`: the coordinator's port
        (0 = a free one); `python_path`: directories first on the engines' and roles' PYTHONPATH (where an
        `import:` reward's module is); `redis_data_dir`: the private Redis keeps an append-only file there
        (fsynced every second), so a Redis restart loses nothing; `redis_password`: the private Redis requires
        it, or the one `redis_url` names does (every service gets it in its environment, never argv).
        Shards journal under <log_dir>/tq-data.
        `engine`: builtin (`sluice engine`) or sglang (SGLang servers; `engine_args` are then SGLang's flags);
        SGLang missing from this Python, or a token it cannot take, is refused before anything starts; a LoRA
        run's SGLang servers get --enable-lora, --max-lora-rank and --lora-target-modules (sglang_flags.lora_argv).
        `on_stack_up`: called with this LocalRun once TransferQueue and the coordinator serve, while the
        engines and roles may still be starting (`sluice run` submits its run there); what it raises stops
        everything and is raised here. `judge`: (model directory, engine flags) of a built-in engine started as
        the service `judge`, the rollout's judge engine for reward model:judge: never one of the run's engines
        (the rollout does not register it, so the trainer never updates its weights), and without a token its
        weight-update routes stay closed. `forker`: a fork server (its owner's to close; tests share one) to fork
        the engines and roles from, when it can fork them."""
        engine_args = engine_flags(run, engine, engine_args, token)
        self.engine = engine
        self.run = run
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="sluice-run-")
        os.makedirs(self.log_dir, exist_ok=True)
        self.token = token
        self.python_path = python_path
        self.checkpoint_dir = checkpoint_dir
        self.procs: dict[str, ChildProcess] = {}
        self.role_argv: dict[str, list[str]] = {}
        self.role_args = role_args or {}
        self.trainer_ranks = trainer_ranks
        self.role_ports: dict[str, int] = {}  # a restarted role keeps its port, as under compose or k8s
        self.redis_proc: ChildProcess | None = None
        self.tq: LocalTransferQueue | None = None
        self.dcs: LocalDCS | None = None
        self.redis_data_dir = redis_data_dir
        self.redis_password: str = stack.redis_password if stack is not None else redis_password
        self.supervisor: ProcessSupervisor | None = None
        self.owns_stack = stack is None
        self.engine_args = engine_args
        self.judge = judge
        self.judge_url: str | None = None
        # the engines and roles are forked from it, their heavy imports done once (services/runtime/fork_server.py)
        shared: ForkServerClient | None = stack.forker if stack is not None else forker
        self.owns_forker = shared is None or not shared.can_fork(child_env(self._env()))
        self.forker: ForkServerClient | None = fork_server_for(self._env()) if self.owns_forker else shared
        try:
            self._start(engines, stack, redis_url, dcs_port)
            if submit:
                self.submit()
            if on_stack_up is not None:
                on_stack_up(self)
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _start(self, engines: int, stack: "LocalRun | None", redis_url: str | None, dcs_port: int) -> None:
        """Every process started, in the order that gets the run going soonest (measured by
        benchmarks/stack_start.py): the engines first (they need nothing else, and loading a model is the
        longest start), Redis, the roles (seconds of imports, then they wait for the run to be created), and
        TransferQueue with the coordinator, waited for: the engines and roles get ready side by side meanwhile."""
        self.engine_urls = [self._start_engine(i, self.engine_args, wait=False) for i in range(engines)]
        if self.judge is not None:
            self.judge_url = self._start_judge()
        if stack is not None:
            self.redis_url, self.tq, self.dcs = stack.redis_url, stack.tq, stack.dcs
            self.dcs_url, self.tq_controller = stack.dcs_url, stack.tq_controller
            self._start_roles()
            return
        if redis_url is None:
            self.redis_proc, redis_url = start_redis(
                log_dir=self.log_dir, data_dir=self.redis_data_dir, password=self.redis_password
            )
        self.redis_url = redis_url
        dcs_port, controller_port = dcs_port or free_port(), free_port()  # the roles are told them now
        self.dcs_url, self.tq_controller = f"http://127.0.0.1:{dcs_port}", f"127.0.0.1:{controller_port}"
        self._start_roles()
        self._start_data_and_control_planes(dcs_port, controller_port)

    def _start_data_and_control_planes(self, dcs_port: int, controller_port: int) -> None:
        """TransferQueue and the coordinator, at once (both need only Redis); either failing stops both."""
        common: dict[str, Any] = dict(
            redis_url=self.redis_url,
            token=self.token,
            log_dir=self.log_dir,
            redis_password=self.redis_password,
            forker=self.forker,
            env=self._env(),  # the fork server's environment: forked, not exec'd
        )
        with ThreadPoolExecutor(max_workers=2, thread_name_prefix="stack-start") as pool:
            data_dir = os.path.join(self.log_dir, "tq-data")
            tq = pool.submit(LocalTransferQueue, data_dir=data_dir, controller_port=controller_port, **common)
            dcs = pool.submit(LocalDCS, port=dcs_port, **common)
            both: list[Future[Any]] = [tq, dcs]
            wait(both)
        self.tq = tq.result() if tq.exception() is None else None
        self.dcs = dcs.result() if dcs.exception() is None else None
        for started in both:
            error = started.exception()
            if error is not None:
                raise error

    def _wait_ready(self) -> None:
        """Every engine answers /health and every role /healthz (one exiting fails the start at once)."""
        for i, url in enumerate(self.engine_urls):
            self._wait_engine(self.procs[f"engine-{i}"], url)
        if self.judge_url is not None:
            self._wait_engine(self.procs["judge"], self.judge_url)
        for proc in list(self.procs.values()):
            if isinstance(proc, RoleProcess):
                proc.wait_until(proc.healthy, ROLE_START_S)

    def submit(self) -> None:
        """Create the run with the coordinator (its roles wait for it)."""
        with self.dcs_client() as dcs:
            dcs.create_run(self.run)

    def dcs_client(self) -> DCSClient:
        return DCSClient(self.dcs_url, token=self.token or None)

    def redis_client(self) -> redis.Redis:
        return sync_redis(self.redis_url, password=self.redis_password)

    def _start_engine(self, i: int, args, port: int | None = None, wait: bool = True) -> str:
        port = port or free_port()
        url = f"http://127.0.0.1:{port}"
        proc: ChildProcess
        if self.engine == "sglang":
            self.procs[f"engine-{i}"] = proc = SGLangProcess(
                f"engine-{i}",
                self.run.model,
                port,
                args,
                i,
                self.token,
                os.path.join(self.log_dir, f"engine-{i}.log"),
                env=self._env(),
            )
            if wait:
                self._wait_engine(proc, url)
            return url
        # without a token, a stack bound to 127.0.0.1 still updates its engines' weights (docs/security.md)
        unauthenticated = [] if self.token else ["--allow-unauthenticated-weight-updates"]
        proc = self._builtin_engine(f"engine-{i}", self.run.model, port, (*unauthenticated, *args))
        if wait:
            self._wait_engine(proc, url)
        return url

    def _start_judge(self, port: int | None = None) -> str:
        """The judge engine, not waited for: its weights are never updated, so its update routes stay closed."""
        port = port or free_port()
        if self.judge is None:
            raise RuntimeError("this run has no judge engine (LocalRun's judge=)")
        model, args = self.judge
        self._builtin_engine("judge", model, port, args)
        return f"http://127.0.0.1:{port}"

    def _builtin_engine(self, name: str, model: str, port: int, args) -> ChildProcess:
        proc = ChildProcess(
            name,
            sluice_argv("engine", "--model", model, "--host", "127.0.0.1", "--port", str(port), *args),
            os.path.join(self.log_dir, f"{name}.log"),
            env=self._env(),
            forker=self.forker,
        )
        self.procs[name] = proc
        return proc

    def _wait_engine(self, proc: ChildProcess, url: str) -> None:
        """A built-in engine answers /health; an SGLang server generates and takes the token."""
        if isinstance(proc, SGLangProcess):
            proc.wait_until(proc.ready, SGLANG_START_S)
        else:
            proc.wait_until(lambda: http_ok(url + "/health"), ENGINE_START_S)

    def restart(self, name: str) -> None:
        """Start the named process of processes() again (same port, same data), killing it first if it runs."""
        procs = self.processes()
        procs[name].kill()
        if name == "redis":
            port = int(self.redis_url.rsplit(":", 1)[1].split("/")[0])
            self.redis_proc, _ = start_redis(
                port, log_dir=self.log_dir, data_dir=self.redis_data_dir, password=self.redis_password
            )
        elif name == "tq-controller":
            _started(self.tq, name).start_controller()
        elif name.startswith("tq-shard"):
            tq = _started(self.tq, name)
            tq.restart_shard([p.name for p in tq.shards].index(name))
        elif name == "dcs":
            _started(self.dcs, name).start()
        elif name == "judge":
            url = _started(self.judge_url, name)
            self._start_judge(int(url.rsplit(":", 1)[1]))
            self._wait_engine(self.procs[name], url)
        elif name.startswith("engine-"):
            i = int(name.split("-")[1])
            self._start_engine(i, self.engine_args, int(self.engine_urls[i].rsplit(":", 1)[1]))
        else:
            self.start_role(name)

    def supervise(self, **kwargs) -> ProcessSupervisor:
        """Restart every process of this run that fails, from now until stop() (services/launch/supervision.py)."""
        self.supervisor = ProcessSupervisor(self.processes, self.restart, **kwargs).start()
        return self.supervisor

    def _env(self) -> dict[str, str]:
        """A service's environment: the token travels here, never in argv (every user's process list)."""
        env = {**SERVICE_ENV, **token_env(self.token)}
        if self.python_path:
            env["PYTHONPATH"] = os.pathsep.join([*self.python_path, *filter(None, [os.environ.get("PYTHONPATH")])])
        return env

    def _start_roles(self) -> None:
        roles = role_commands(
            self.run, self.engine_urls, self.judge_url, self.checkpoint_dir, self.log_dir, self.trainer_ranks
        )
        for name, argv in roles.items():
            self.role_argv[name] = argv + list(self.role_args.get(name, []))
            self.start_role(name, wait=False)

    def start_role(self, name: str, wait: bool = True) -> RoleProcess:
        port = self.role_ports.setdefault(name, free_port())
        flags = stack_flags(self.run.name, self.dcs_url, self.tq_controller, self.redis_url)
        # the roles read Redis: its password in their environment too (an engine never gets it)
        proc = RoleProcess(
            name,
            sluice_argv(*self.role_argv[name], *flags, "--port", str(port)),
            os.path.join(self.log_dir, f"{name}.log"),
            env={**self._env(), **redis_password_env(self.redis_password)},
            status_url=f"http://127.0.0.1:{port}",
            forker=self.forker,
        )
        self.procs[name] = proc
        if wait:
            proc.wait_until(proc.healthy, ROLE_START_S)
        return proc

    def processes(self) -> dict[str, ChildProcess]:
        """Every process this run started: its stack's (when it owns the stack), engines and roles."""
        return {**(self._stack_processes() if self.owns_stack else {}), **self.procs}

    def _stack_processes(self) -> dict[str, ChildProcess]:
        """The stack's processes started so far (a stack whose start failed has only some)."""
        tq: list[tuple[str, ChildProcess | None]] = (
            [("tq-controller", self.tq.controller)] + [(p.name, p) for p in self.tq.shards] if self.tq else []
        )
        dcs: list[tuple[str, ChildProcess | None]] = [("dcs", self.dcs.proc)] if self.dcs else []
        return {name: proc for name, proc in [("redis", self.redis_proc), *tq, *dcs] if proc is not None}

    def service_urls(self) -> dict[str, str]:
        """HTTP base URL of every role service and engine (each serves /spans, /metrics)."""
        urls = {name: proc.status_url for name, proc in self.procs.items() if isinstance(proc, RoleProcess)}
        urls.update({f"engine-{i}": url for i, url in enumerate(self.engine_urls)})
        if self.judge_url is not None:
            urls["judge"] = self.judge_url
        return urls

    def progress(self) -> TrainerProgress:
        with self.redis_client() as r:
            return read_progress(r, self.run.name)

    def trained_steps(self) -> dict[int, dict]:
        with self.redis_client() as r:
            return trained_steps(r, self.run.name)

    def check_alive(self) -> None:
        """A dead role or engine fails the caller; under supervise(), only one the supervisor gave up on."""
        for name, proc in self.procs.items():
            if self.supervisor is not None and name not in self.supervisor.given_up:
                continue
            if not proc.alive():
                raise RuntimeError(f"{name} exited with {proc.proc.returncode}; log: {proc.log_tail()}")

    def wait_for_step(self, next_step: int, timeout_s: float) -> TrainerProgress:
        """Until the trainer has finished steps < next_step; a role that dies fails it at once."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            progress = self.progress()
            if progress.next_step >= next_step:
                return progress
            self.check_alive()
            time.sleep(0.2)
        raise TimeoutError(f"trainer at {self.progress()} after {timeout_s}s; logs in {self.log_dir}")

    def stop(self, timeout_s: float = STOP_S) -> None:
        """Stop every process of this run, in two waves, each all at once with one deadline
        (processes.stop_together): first the engines and roles, then the stack they talk to (coordinator,
        TransferQueue, Redis; a stack shared from another run is its owner's to stop), so that a role on its
        way out (the trainer's final checkpoint and records, a node leaving the coordinator) never waits on a
        service already gone, and the TransferQueue's gRPC servers have no role's long-poll claim left to
        give their grace period to. The second wave also takes any process a restart started meanwhile."""
        supervisor = self.supervisor
        if supervisor is not None:
            supervisor.stop(timeout_s=0)  # its restarts under way end as their processes are stopped
        stop_together(lambda: list(self.procs.values()), timeout_s)
        stop_together(
            lambda: list(self.processes().values()),
            STACK_STOP_S,
            supervisor.restarting if supervisor is not None else lambda: False,
        )
        if self.owns_forker and self.forker is not None:
            self.forker.close()
