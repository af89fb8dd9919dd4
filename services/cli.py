"""`sluice`: one command for every Sluice service and tool.

    sluice tq-controller [flags]   TransferQueue controller (gRPC, metadata in Redis)
    sluice tq-shard [flags]        TransferQueue storage shard (gRPC, Arrow in memory)
    sluice dcs [flags]             control plane: nodes, weight versions, sync groups, run control (HTTP)
    sluice engine --model DIR      built-in rollout engine speaking SGLang's HTTP protocol
    sluice rollout [flags]         rollout role: prompts -> engines -> rewards -> TQ train_<step>
    sluice forward --role R        forward role: actor_fwd or reference log-probs
    sluice advantage [flags]       advantage role: advantages and returns per prompt group
    sluice trainer [flags]         trainer role: actor (or --role critic) updates, weight publishing
    sluice init-model DIR [flags]  write a random HF causal LM + offline tokenizer (tests, demo)
    sluice demo [flags]            the main job on one machine (see `sluice demo --help`)

Every service command takes --help; flags also come from environment variables (listed there).
"""

from __future__ import annotations

import sys


def _commands():
    # imported lazily: `sluice tq-shard --help` should not pay for importing everything
    def controller(argv):
        from services.transferqueue.controller.main import main
        return main(argv)

    def shard(argv):
        from services.transferqueue.shard.main import main
        return main(argv)

    def dcs(argv):
        from services.dcs.main import main
        return main(argv)

    def engine(argv):
        from services.engine.main import main
        return main(argv)

    def rollout(argv):
        from services.rollout.main import main
        return main(argv)

    def forward(argv):
        from services.forward.main import main
        return main(argv)

    def advantage(argv):
        from services.advantage.main import main
        return main(argv)

    def trainer(argv):
        from services.trainer.main import main
        return main(argv)

    def init_model(argv):
        from services.model.init_model import main
        return main(argv)

    def demo(argv):
        from services.demo import main
        return main(argv)

    return {"tq-controller": controller, "tq-shard": shard, "dcs": dcs, "engine": engine, "rollout": rollout,
            "forward": forward, "advantage": advantage, "trainer": trainer, "init-model": init_model,
            "demo": demo}


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
    commands = _commands()
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in commands:
        print(f"sluice: unknown command {name!r}; one of: {', '.join(commands)}", file=sys.stderr)
        return 2
    return commands[name](rest) or 0


if __name__ == "__main__":
    sys.exit(main())
