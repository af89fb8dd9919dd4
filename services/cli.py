"""`sluice`: one command for every Sluice service and tool.

A whole run on this machine, from one YAML file (docs/configuration.md):

    sluice run run.yaml            start every service, submit the run, follow it (live view / JSON lines)
    sluice run --print-defaults    a complete, commented starting run file
    sluice submit run.yaml         submit a run to a running coordinator (--coordinator, SLUICE_COORDINATOR_URL)
    sluice status|pause|resume|stop RUN   a run's status / lifecycle, over the coordinator's REST API
    sluice engines list|add|remove RUN [URL]   the run's engines: add one to a running run, or take one out
    sluice logs ROLE [-f]          a service's log of a `sluice run` on this machine

The services and tools, one process each:

    sluice tq-controller [flags]   TransferQueue controller (gRPC, metadata in Redis)
    sluice tq-shard [flags]        TransferQueue storage shard (gRPC, Arrow in memory)
    sluice dcs [flags]             control plane: nodes, weight versions, sync groups, run control (HTTP)
    sluice engine --model DIR      built-in rollout engine speaking SGLang's HTTP protocol
    sluice rollout [flags]         rollout role: prompts -> engines -> rewards -> TQ train_<step>
    sluice forward --role R        forward role: actor_fwd or reference log-probs
    sluice advantage [flags]       advantage role: advantages and returns per prompt group
    sluice trainer [flags]         trainer role: actor (or --role critic) updates, weight publishing
    sluice init-model DIR [flags]  write a random HF causal LM + offline tokenizer (tests, demo)
    sluice export CKPT OUT_DIR     a trainer checkpoint as a plain Hugging Face model directory
    sluice demo [flags]            the main job on one machine (see `sluice demo --help`)
    sluice report RUN_DIR          a run's report.png and summary.json from its steps.jsonl (docs/tracking.md)

Every service command takes --help; flags also come from environment variables (listed there).
"""

from __future__ import annotations

import importlib
import sys


# command -> (module, function), imported only when that command runs: `sluice tq-shard --help` should not
# pay for importing everything
_COMMANDS = {
    "run": ("services.front_door.supervisor", "main"),
    "submit": ("services.front_door.rest_commands", "submit_main"),
    "status": ("services.front_door.rest_commands", "status_main"),
    "pause": ("services.front_door.rest_commands", "pause_main"),
    "resume": ("services.front_door.rest_commands", "resume_main"),
    "stop": ("services.front_door.rest_commands", "stop_main"),
    "engines": ("services.front_door.engine_commands", "main"),
    "logs": ("services.front_door.run_logs", "main"),
    "tq-controller": ("services.transferqueue.controller.main", "main"),
    "tq-shard": ("services.transferqueue.shard.main", "main"),
    "dcs": ("services.dcs.main", "main"),
    "engine": ("services.engine.main", "main"),
    "rollout": ("services.rollout.main", "main"),
    "forward": ("services.forward.main", "main"),
    "advantage": ("services.advantage.main", "main"),
    "trainer": ("services.trainer.main", "main"),
    "init-model": ("services.model.init_model", "main"),
    "demo": ("services.demo", "main"),
    "export": ("services.front_door.export_command", "main"),
    "report": ("services.tracking.report", "main"),
}


def _command(name: str):
    from services.runtime.startup import imports_uncollected  # its own imports: the standard library only

    module, function = _COMMANDS[name]
    with imports_uncollected():  # every command's start: a stack starts a dozen side by side
        return getattr(importlib.import_module(module), function)


def service_config(command: str):
    """The config model of a service command (flags and env vars come from it)."""
    if command == "tq-controller":
        from services.transferqueue.controller.config import ControllerConfig

        return ControllerConfig
    if command == "tq-shard":
        from services.transferqueue.shard.config import ShardConfig

        return ShardConfig
    if command == "dcs":
        from services.dcs.config import DCSConfig

        return DCSConfig
    if command == "engine":
        from services.engine.config import EngineConfig

        return EngineConfig
    if command == "rollout":
        from services.rollout.config import RolloutConfig

        return RolloutConfig
    if command == "forward":
        from services.forward.config import ForwardConfig

        return ForwardConfig
    if command == "advantage":
        from services.advantage.config import AdvantageConfig

        return AdvantageConfig
    if command == "trainer":
        from services.trainer.config import TrainerConfig

        return TrainerConfig
    raise KeyError(f"{command} is not a service command")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in _COMMANDS:
        print(f"sluice: unknown command {name!r}; one of: {', '.join(_COMMANDS)}", file=sys.stderr)
        return 2
    return _command(name)(rest) or 0


if __name__ == "__main__":
    sys.exit(main())
