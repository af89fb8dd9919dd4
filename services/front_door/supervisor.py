"""`sluice run run.yaml`: a whole run on this machine with one command.

Validates the run file, runs the preflight checks (model, prompts, reward), starts every service the run
needs as supervised processes (Redis unless stack.redis_url / --redis-url names one, TransferQueue, the
coordinator, built-in engines and the roles), submits the run and follows it to the end: a live panel on
a terminal, JSON lines otherwise. Exit status: 0 finished, 1 failed (the failing service and its message
on stderr), 2 a bad run file, 3 stopped by an operator, 130 interrupted.

The private Redis keeps an append-only file under <run dir>/redis (fsynced every second; emptied when
`sluice run` starts) and requires a password made for this run (<run dir>/redis-password, mode 0600; the
services get it in their environment), so a killed service, Redis included, is restarted and loses nothing.

Ctrl-C (or SIGTERM) pauses the run through the coordinator, writes its report, then stops every service
cleanly (the trainer checkpoints on the way out); `sluice run run.yaml --resume` continues from the last
checkpoint.
`sluice run --attach URL RUN_ID` follows a run on a stack started elsewhere (Ctrl-C only detaches).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import gc
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable

import redis

from services.dcs.client import DCSClient, DCSError
from services.front_door.command_flags import add_coordinator_flags, auth_token
from services.front_door.config_reference import defaults_yaml
from services.front_door.follower import RunFollower, RunProgress, exit_code
from services.front_door.live_view import choose_view
from services.front_door.run_file import RunFile, RunFileError
from services.front_door.run_preparation import prepare
from services.front_door.stack_start import redis_password_file, stack_token, start_stack, write_stack_file
from services.launch.local_run import LocalRun
from services.run_contract.checkpoint import latest_checkpoint
from services.run_state.evaluations import read_latest_evaluation
from services.run_state.prompt_ledger import resume_ledger_at
from services.runtime.redis_password import RedisPasswordError
from services.runtime.settings_cli import HelpWithDefaults


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sluice run", description=__doc__, formatter_class=HelpWithDefaults)
    parser.add_argument("run_file", nargs="?", help="the run's YAML file (docs/configuration.md)")
    parser.add_argument(
        "--print-defaults", action="store_true", help="write a complete, commented starting run file to stdout and exit"
    )
    parser.add_argument(
        "--resume", action="store_true", help="continue the run from the last checkpoint in its checkpoint directory"
    )
    parser.add_argument(
        "--redis-url",
        default=None,
        help="use this Redis instead of starting a private one "
        "(overrides stack.redis_url; its password, if any, from "
        "env SLUICE_REDIS_PASSWORD_FILE or SLUICE_REDIS_PASSWORD)",
    )
    parser.add_argument(
        "--attach",
        nargs=2,
        metavar=("URL", "RUN_ID"),
        help="follow a run on a coordinator elsewhere; nothing is started",
    )
    parser.add_argument(
        "--view",
        choices=["auto", "live", "json"],
        default="auto",
        help="live panel, JSON lines, or auto: the panel when stdout is a terminal",
    )
    add_coordinator_flags(parser, url=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.print_defaults:
        sys.stdout.write(defaults_yaml())
        return 0
    if args.attach:
        return attach(args)
    if not args.run_file:
        parser.error("a run file is required (or --print-defaults, or --attach URL RUN_ID)")
    try:
        run_file = prepare(args)
    except RunFileError as exc:
        for problem in exc.problems:
            print(f"sluice run: {problem}", file=sys.stderr)
        return 2
    options = RunOptions(view=args.view, resume=args.resume, token=auth_token(args), path=args.run_file)
    try:
        return start_and_follow(run_file, options)
    except KeyboardInterrupt:  # a second Ctrl-C while pausing: every service has been stopped on the way out
        print("sluice run: interrupted; services stopped", file=sys.stderr)
        return 130


@dataclass
class RunOptions:
    """How `start_and_follow` runs a run file (the flags of `sluice run`; the demo sets its own)."""

    view: str = "auto"  # auto | live | json
    resume: bool = False
    token: str = ""
    path: str = ""  # the run file (how to resume it is shown on Ctrl-C)
    check: Callable[[LocalRun, RunProgress], None] | None = None  # looks at a run that ended, services still up


def start_and_follow(run_file: RunFile, options: RunOptions) -> int:
    """Start the run's services, submit it, follow it to its end and stop them; the exit status."""
    config, dirs = run_file.run_config(), run_file.directories()
    view = choose_view(options.view)
    token, token_file = stack_token(options.token, dirs["run"])
    view.note(
        "starting",
        run=config.name,
        run_dir=dirs["run"],
        logs=dirs["logs"],
        **({"auth_token_file": token_file} if token_file else {}),
    )
    try:  # the run is created once the coordinator serves: each role takes it up the moment it is ready itself
        local = start_stack(
            run_file, token, options.path, on_stack_up=lambda started: submit(started, config.name, options.resume)
        )
    except DCSError as exc:
        print(f"sluice run: the coordinator refused the run: {exc}", file=sys.stderr)
        return 1
    except (RuntimeError, TimeoutError, OSError, RedisPasswordError) as exc:
        print(f"sluice run: a service did not start: {exc}\nsluice run: logs in {dirs['logs']}", file=sys.stderr)
        return 1
    with local:
        local.supervise()  # a service that fails is started again (services/launch/supervision.py)
        write_stack_file(dirs, local, config.name, token_file, redis_password_file(run_file))
        view.note("running", coordinator=local.dcs_url, services=sorted(local.procs))
        with local.dcs_client() as dcs:

            def on_interrupt(progress: RunProgress) -> None:
                pause(dcs, config.name, view)
                view.note("stopping", **({"resume": f"sluice run {options.path} --resume"} if options.path else {}))

            def before_summary(progress: RunProgress) -> None:
                if progress.state in ("finished", "interrupted", "stopped") and options.check:
                    options.check(local, progress)  # what was trained so far, however it ended
                # every ending writes it, an interrupted or stopped run too: its services still answer here
                progress.extra["report"] = write_run_report(dirs["run"], local, token)

            progress = follow(
                dcs,
                config,
                view,
                liveness=lambda: dead_service(local),
                eval_reward=lambda: latest_eval_reward(local),
                on_interrupt=on_interrupt,
                before_summary=before_summary,
            )
    leave_the_heap_at_exit()
    return _finish(progress, dirs["logs"])


def leave_the_heap_at_exit() -> None:
    """When this process exits, leave its objects to the OS instead of walking them: CPython's last garbage
    collection at exit goes over every object torch, transformers, gRPC and matplotlib made here, 1-2 s of a
    2-core machine between the stack's last service stopping and `sluice run` exiting; frozen (gc.freeze,
    services/runtime/heap.py) it is skipped. At exit only, so a caller that goes on (a test) keeps its
    collector as it was."""
    atexit.unregister(gc.freeze)
    atexit.register(gc.freeze)


def follow(dcs: DCSClient, config, view, **kwargs) -> RunProgress:
    follower = RunFollower(dcs, config.name, config.num_steps, config.rows_per_step, **kwargs)
    with interrupts_set(follower.interrupt):
        return follower.follow(view)


def _finish(progress: RunProgress, log_dir: str | None) -> int:
    if progress.state not in ("finished", "interrupted"):
        where = f" (logs in {log_dir})" if log_dir else ""
        print(f"sluice run: run {progress.run_id} {progress.state}: {progress.failure or ''}{where}", file=sys.stderr)
    return exit_code(progress)


def submit(local: LocalRun, run_id: str, resume: bool) -> None:
    """Create the run; on --resume with a Redis that still holds it, resume it instead. A resumed run on a
    new Redis starts its rollout at the checkpoint's step (the prompts before it were trained)."""
    if resume and local.redis_proc is not None:
        ckpt = latest_checkpoint(local.checkpoint_dir, "actor") if local.checkpoint_dir else None
        if ckpt is None:  # `sluice run --resume` checked that there is one before anything started
            raise RuntimeError(f"--resume: no actor checkpoint in {local.checkpoint_dir} to resume from")
        with local.redis_client() as r:
            resume_ledger_at(r, run_id, ckpt.next_step * local.run.rollout_batch_size)
    try:
        local.submit()
    except DCSError as exc:
        if not (resume and exc.status == 409):
            raise
        with local.dcs_client() as dcs:
            dcs.resume(run_id)


def write_run_report(run_dir: str, local: LocalRun, token: str) -> dict | None:
    """The run's report (services/tracking/report.py: report.png, summary.json, the services' spans) while
    the services still answer; None when nothing was trained. A report that fails is named, not fatal."""
    from services.tracking.report import report_at_end  # matplotlib: only when a run ends

    try:
        return report_at_end(run_dir, local.service_urls(), token)
    except Exception as exc:  # the run's outcome stands whatever the report does
        return {"error": f"{type(exc).__name__}: {exc}"}


def dead_service(local: LocalRun) -> str | None:
    """A service process that exited with an error and is not started again, named with the end of its
    log (a role that finished its work and left exits 0; under supervision, only one the supervisor gave
    up on counts: it failed 5 times in 10 minutes)."""
    given_up = local.supervisor.given_up if local.supervisor is not None else None
    for name, proc in local.processes().items():
        if given_up is not None and name not in given_up:
            continue
        if not proc.alive() and proc.proc.returncode != 0:
            tail = proc.log_tail(1500).strip().splitlines()[-6:]
            return f"{name} exited with code {proc.proc.returncode}: " + " | ".join(tail)
    return None


def latest_eval_reward(local: LocalRun) -> float | None:
    """The newest held-out eval's mean reward (RunConfig.eval), None before the first or without Redis."""
    try:
        with local.redis_client() as r:
            latest = read_latest_evaluation(r, local.run.name)
    except redis.RedisError:
        return None
    return latest.mean_reward if latest is not None else None


def pause(dcs: DCSClient, run_id: str, view, wait_s: float = 30.0) -> None:
    """Ask every service to pause at a safe point and wait (bounded) until the live ones acknowledge."""
    try:
        dcs.pause(run_id)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            live = [s for s in dcs.status(run_id).services if s.state != "dead"]
            if all(s.pause_acknowledged for s in live):
                break
            time.sleep(0.2)
        view.note("paused", run=run_id)
    except (DCSError, OSError) as exc:  # an ended run cannot pause; stopping still goes on
        view.note("not_paused", run=run_id, reason=str(exc))


@contextlib.contextmanager
def interrupts_set(event: threading.Event):
    """While inside: SIGINT and SIGTERM set `event` (the follower then ends) instead of raising."""
    previous = {sig: signal.signal(sig, lambda *_: event.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def attach(args) -> int:
    url, run_id = args.attach
    view = choose_view(args.view)
    try:
        with DCSClient(url, token=auth_token(args) or None) as dcs:
            try:
                config = dcs.run(run_id).config
            except (DCSError, OSError) as exc:
                print(f"sluice run: --attach {url} {run_id}: {exc}", file=sys.stderr)
                return 1
            view.note("attached", run=run_id, coordinator=url)
            progress = follow(dcs, config, view)
    except KeyboardInterrupt:  # Ctrl-C before following began: this terminal detaches; the run is not its to stop
        view.note("interrupted", run=run_id)
        return 130
    return _finish(progress, None)
