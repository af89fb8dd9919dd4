"""`sluice submit|status|pause|resume|stop|logs`: thin clients of a coordinator's REST API (through its
client class, services/dcs/client.py) and of a local run's log files. Each prints JSON (or, for `status`
on a terminal, a table). Exit status: 0 done, 1 the coordinator refused or could not be reached (its
message on stderr), 2 bad arguments or a bad run file."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Callable

from services.dcs.client import DCSError
from services.front_door.command_flags import add_coordinator_flags, coordinator_client
from services.front_door.run_file import RunFileError, load_run_file, position_of
from services.runtime.settings_cli import HelpWithDefaults


def _parser(prog: str, description: str) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(prog=f"sluice {prog}", description=description, formatter_class=HelpWithDefaults)


def _print(obj) -> None:
    print(json.dumps(obj, indent=1))


def _refused(prog: str, exc: Exception) -> int:
    why = "the coordinator cannot be reached: " if isinstance(exc, OSError) else "the coordinator refused: "
    print(f"sluice {prog}: {why}{exc}", file=sys.stderr)
    return 1


def submit_main(argv: list[str] | None = None) -> int:
    parser = _parser(
        "submit",
        "Submit the run of a run file to a coordinator (its `stack:` section is ignored); "
        "the run's services, started with its name as --run-id, then run it.",
    )
    parser.add_argument("run_file", help="the run's YAML file (docs/configuration.md)")
    parser.add_argument(
        "--no-preflight",
        action="store_true",
        help="skip the checks of model, prompts and reward on this machine (when they exist only "
        "where the services run)",
    )
    parser.add_argument(
        "--exist-ok",
        action="store_true",
        help="a run of that name on the coordinator already is not an error (a re-started submitter)",
    )
    add_coordinator_flags(parser)
    args = parser.parse_args(argv)
    try:
        run_file = load_run_file(args.run_file)
        if not args.no_preflight:
            from services.run_contract.preflight import check_run

            problems = check_run(run_file.run_config())
            if problems:
                raise RunFileError([f"{position_of(args.run_file, p.key)}: {p.key}: {p.message}" for p in problems])
    except RunFileError as exc:
        for problem in exc.problems:
            print(f"sluice submit: {problem}", file=sys.stderr)
        return 2
    event = "submitted"
    try:
        with coordinator_client(args) as dcs:
            try:
                run = dcs.create_run(run_file.run_config())
            except DCSError as exc:
                if not (args.exist_ok and exc.status == 409):
                    raise
                event, run = "exists", dcs.run(run_file.name)
    except (DCSError, OSError) as exc:
        return _refused("submit", exc)
    _print({"event": event, "run": run.run_id, "status": run.status, "coordinator": args.coordinator})
    return 0


def status_main(argv: list[str] | None = None) -> int:
    parser = _parser(
        "status",
        "A run's status: its lifecycle state and failure, the trainer's progress and "
        "last step's metrics, and every service's state.",
    )
    parser.add_argument("run_id", help="the run's name")
    parser.add_argument("--json", action="store_true", help="JSON even on a terminal")
    add_coordinator_flags(parser)
    args = parser.parse_args(argv)
    try:
        with coordinator_client(args) as dcs:
            status = dcs.status(args.run_id)
            progress = dcs.steps(args.run_id, limit=1)
            page = dcs.steps(args.run_id, first=max(0, progress.next_step - 1), limit=1)
    except (DCSError, OSError) as exc:
        return _refused("status", exc)
    last = page.steps[-1] if page.steps else None
    report = {
        "run": args.run_id,
        "status": status.status,
        "failure": status.failure and status.failure.model_dump(),
        "step": page.next_step,
        "num_steps": status.run.config.num_steps,
        "weight_version": status.latest_weight_version,
        "last_step": last and last.model_dump(),
        "services": [s.model_dump() for s in status.services],
    }
    if args.json or not sys.stdout.isatty():
        _print(report)
    else:
        _print_status_table(report)
    return 0


def _print_status_table(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(
        f"[bold]{report['run']}[/bold] {report['status']}  step {report['step']}/{report['num_steps']}"
        f"  weight version {report['weight_version']}"
    )
    if report["failure"]:
        console.print(f"[bold red]failure[/bold red] {report['failure']['role']}: {report['failure']['message']}")
    if report["last_step"]:
        console.print({k: v for k, v in report["last_step"]["metrics"].items() if not isinstance(v, dict)})
    table = Table("role", "rank", "state", "step", "version", "paused", "address")
    for s in report["services"]:
        table.add_row(
            s["role"],
            str(s["rank"]),
            s["state"],
            str(s["step"]),
            str(s["weight_version"]),
            "yes" if s["pause_acknowledged"] else "",
            s.get("url") or "",
        )
    console.print(table)


def _lifecycle_main(prog: str, description: str, call) -> Callable[[list[str] | None], int]:
    def main(argv: list[str] | None = None) -> int:
        parser = _parser(prog, description)
        parser.add_argument("run_id", help="the run's name")
        add_coordinator_flags(parser)
        args = parser.parse_args(argv)
        try:
            with coordinator_client(args) as dcs:
                run = call(dcs, args.run_id)
        except (DCSError, OSError) as exc:
            return _refused(prog, exc)
        _print({"run": run.run_id, "status": run.status, "desired_state": run.desired_state})
        return 0

    return main


pause_main = _lifecycle_main(
    "pause", "Ask every service of the run to pause at its next safe point.", lambda dcs, run: dcs.pause(run)
)
resume_main = _lifecycle_main("resume", "Resume a paused run.", lambda dcs, run: dcs.resume(run))
stop_main = _lifecycle_main(
    "stop",
    "Stop the run: every service exits at its next safe point (the trainer "
    "checkpoints first); the run's status becomes stopped.",
    lambda dcs, run: dcs.stop_run(run),
)
