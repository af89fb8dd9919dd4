"""`sluice logs ROLE`: print (and with -f, follow) a service's log file of a run started by `sluice run` on
this machine. The run is found by its directory (`--run-dir`, env SLUICE_RUN_DIR, else the newest
runs/*/stack.json under the current directory); its stack.json names the log directory."""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time

from services.runtime.settings_cli import HelpWithDefaults


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sluice logs", description=__doc__, formatter_class=HelpWithDefaults)
    parser.add_argument("role", help="a service: trainer, rollout, advantage, engine-0, dcs, ...")
    parser.add_argument(
        "--run-dir",
        default=os.environ.get("SLUICE_RUN_DIR", ""),
        help="the run's directory (<stack.output_dir>/<name>); empty = the newest runs/*/ here [env SLUICE_RUN_DIR]",
    )
    parser.add_argument("-n", "--lines", type=int, default=50, help="print the last N lines first")
    parser.add_argument("-f", "--follow", action="store_true", help="keep printing what is appended (Ctrl-C ends)")
    return parser


def log_dir(run_dir: str) -> str:
    """The log directory of a run directory (its stack.json), or of the newest run under ./runs."""
    if not run_dir:
        found = sorted(glob.glob(os.path.join("runs", "*", "stack.json")), key=os.path.getmtime)
        if not found:
            raise SystemExit("sluice logs: no run found under ./runs; give --run-dir")
        run_dir = os.path.dirname(found[-1])
    try:
        with open(os.path.join(run_dir, "stack.json"), encoding="utf-8") as f:
            return json.load(f)["log_dir"]
    except (OSError, ValueError, KeyError) as exc:
        raise SystemExit(
            f"sluice logs: {run_dir} is not a run directory of `sluice run` (no readable stack.json: {exc})"
        ) from exc


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    directory = log_dir(args.run_dir)
    path = os.path.join(directory, f"{args.role}.log")
    if not os.path.isfile(path):
        known = sorted(name[:-4] for name in os.listdir(directory) if name.endswith(".log"))
        print(f"sluice logs: no log of {args.role!r} in {directory}; there are: {', '.join(known)}", file=sys.stderr)
        return 2
    with open(path, "rb") as f:
        lines = f.read().splitlines(keepends=True)
        sys.stdout.buffer.write(b"".join(lines[-args.lines :]) if args.lines > 0 else b"")
        sys.stdout.flush()
        try:
            while args.follow:
                chunk = f.read()
                if chunk:
                    sys.stdout.buffer.write(chunk)
                    sys.stdout.flush()
                else:
                    time.sleep(0.3)
        except KeyboardInterrupt:
            pass
    return 0
