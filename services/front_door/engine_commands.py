"""`sluice engines list|add|remove RUN [URL]`: a run's engine set over the coordinator's REST API
(/v1/runs/{run}/engines). An added engine (an SGLang server, or a built-in engine started without --dcs-url) is
registered by the rollout, sent the run's current weights and given requests once it serves them; a removed one
is drained (its requests go to the other engines) and cannot register for the run again until added again.
Prints JSON; exit 0 done, 1 the coordinator refused or could not be reached, 2 bad arguments."""

from __future__ import annotations

import argparse
import json
import sys

from services.dcs.client import DCSError
from services.front_door.command_flags import add_coordinator_flags, coordinator_client
from services.runtime.settings_cli import HelpWithDefaults


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sluice engines", description=__doc__.split("\n\n")[0], formatter_class=HelpWithDefaults
    )
    actions = parser.add_subparsers(dest="action", required=True)
    listing = actions.add_parser("list", help="the run's engines and the URLs removed from it")
    listing.add_argument("run_id", help="the run's name")
    for name, why in (("add", "add an engine to the run"), ("remove", "take an engine out of the run")):
        action = actions.add_parser(name, help=why)
        action.add_argument("run_id", help="the run's name")
        action.add_argument("url", help="the engine's base URL, http(s)://host:port")
    for action in actions.choices.values():
        add_coordinator_flags(action)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        with coordinator_client(args) as dcs:
            if args.action == "list":
                out = dcs.engines(args.run_id).model_dump()
            elif args.action == "add":
                out = {"event": "added", **dcs.add_engine(args.run_id, args.url).model_dump()}
            else:
                out = {"event": "removed", "url": args.url, "message": dcs.remove_engine(args.run_id, args.url)}
    except (DCSError, OSError) as exc:
        why = "cannot be reached" if isinstance(exc, OSError) else "refused"
        print(f"sluice engines {args.action}: the coordinator {why}: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:  # a URL that is no engine's (checked before anything is sent)
        print(f"sluice engines {args.action}: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(out, indent=1))
    return 0
