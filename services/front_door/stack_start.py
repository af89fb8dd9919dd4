"""The services of a run file's stack, started for `sluice run` (services/launch/local_run.py), with the
secrets they share: the run's auth token (the operator's, else a new one) and a private Redis' password, and
<run dir>/stack.json saying where they are for other terminals."""

from __future__ import annotations

import json
import os
import secrets
import shutil
from typing import Callable

from services.front_door.run_file import RunFile
from services.front_door.run_preparation import run_file_directory
from services.launch.local_run import LocalRun
from services.runtime.forked_process import ForkServerClient
from services.runtime.redis_password import new_redis_password, resolve_redis_password, write_private_file


def start_stack(
    run_file: RunFile,
    token: str,
    path: str = "",
    on_stack_up: Callable[[LocalRun], None] | None = None,
    forker: ForkServerClient | None = None,
) -> LocalRun:
    """Every service of the run file's stack, started (the run not yet submitted, unless `on_stack_up`,
    called as the coordinator serves, submits it: LocalRun): what `sluice run` runs, with its defaults. A
    private Redis (no stack.redis_url) keeps an append-only file under <run dir>/redis,
    emptied first (a run resumed with --resume continues from its checkpoint, as on a new Redis), and
    requires a new password, written to <run dir>/redis-password; a Redis of the operator's gets the
    password from this process's environment (env SLUICE_REDIS_PASSWORD_FILE or SLUICE_REDIS_PASSWORD).
    `forker`: LocalRun's (a fork server its caller owns)."""
    dirs, stack = run_file.directories(), run_file.stack
    password_file = redis_password_file(run_file)
    if password_file is not None:  # a private Redis (no stack.redis_url)
        data_dir = os.path.join(dirs["run"], "redis")
        shutil.rmtree(data_dir, ignore_errors=True)
        os.makedirs(dirs["run"], exist_ok=True)
        password = new_redis_password()
        write_private_file(password_file, password + "\n")
    else:
        data_dir, password = None, resolve_redis_password()
    return LocalRun(
        run_file.run_config(),
        log_dir=dirs["logs"],
        engines=stack.engines,
        token=token,
        checkpoint_dir=dirs["checkpoints"],
        engine_args=run_file.engine_argv(),
        role_args=run_file.role_argv(),
        trainer_ranks=stack.trainer_ranks,
        submit=False,
        redis_url=stack.redis_url,
        dcs_port=stack.coordinator_port,
        engine=stack.engine,
        python_path=(run_file_directory(path),) if path else (),
        redis_data_dir=data_dir,
        redis_password=password,
        on_stack_up=on_stack_up,
        judge=(stack.judge.model, run_file.judge_argv()) if stack.judge.model else None,
        forker=forker,
    )


def redis_password_file(run_file: RunFile) -> str | None:
    """Where `sluice run` writes its private Redis' password (None: the Redis is the operator's)."""
    return os.path.join(run_file.directories()["run"], "redis-password") if run_file.stack.redis_url is None else None


def stack_token(given: str, run_dir: str) -> tuple[str, str | None]:
    """The token every service of the run requires: the operator's (env SLUICE_AUTH_TOKEN or
    --auth-token-file), else a new random one, written to <run_dir>/auth-token (mode 0600) for other terminals
    (`--auth-token-file`). A stack never runs without one: whoever reaches an engine's port could otherwise
    join its weight-update group and replace the model. Returns (token, the file it was written to or None)."""
    if given:
        return given, None
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, "auth-token")
    token = secrets.token_hex(32)  # never a leading '-', which SGLang's argparse would take for a flag
    write_private_file(path, token + "\n")
    return token, path


def write_stack_file(
    dirs: dict[str, str], local: LocalRun, run_id: str, token_file: str | None, redis_password_path: str | None
) -> None:
    """<run_dir>/stack.json: where this run's coordinator, judge engine, logs, generated token and Redis password are
    (`sluice logs`, other terminals: env SLUICE_REDIS_PASSWORD_FILE=<that file> for Redis), and its services'
    process ids."""
    os.makedirs(dirs["run"], exist_ok=True)
    with open(os.path.join(dirs["run"], "stack.json"), "w", encoding="utf-8") as f:
        json.dump(
            {
                "run_id": run_id,
                "coordinator": local.dcs_url,
                "redis_url": local.redis_url,
                "log_dir": dirs["logs"],
                "checkpoint_dir": dirs["checkpoints"],
                "pid": os.getpid(),
                # each service's process: a child of `pid`, or of the fork server it forked from
                "service_pids": {name: proc.proc.pid for name, proc in local.processes().items()},
                **({"judge_url": local.judge_url} if local.judge_url else {}),
                **({"auth_token_file": token_file} if token_file else {}),
                **({"redis_password_file": redis_password_path} if redis_password_path else {}),
            },
            f,
            indent=1,
        )
