"""The role services of a run on one machine (services/launch/local_run.py starts them): which ones the run
needs, each one's `sluice` command line, and the process a role runs as."""

from __future__ import annotations

from services.run_contract.run_config import RunConfig
from services.runtime.forked_process import ForkServerClient
from services.runtime.processes import ChildProcess, free_port, http_ok


class RoleProcess(ChildProcess):
    """A role service's process, and the base URL it serves /healthz, /status and /metrics at."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        log_path: str,
        env: dict[str, str],
        status_url: str,
        forker: ForkServerClient | None = None,
    ):
        self.status_url = status_url
        super().__init__(name, argv, log_path, env=env, forker=forker)

    def healthy(self) -> bool:
        return http_ok(self.status_url + "/healthz")


def role_commands(
    run: RunConfig,
    engine_urls: list[str],
    judge_url: str | None,
    checkpoint_dir: str | None,
    output_dir: str,
    trainer_ranks: int,
) -> dict[str, list[str]]:
    """Each role service the run needs, by name, and its `sluice` arguments before those every role gets
    (stack_flags): trainer, rollout and advantage always; critic, actor_fwd and reference as the run config
    asks; with `trainer_ranks` > 1, a trainer process per data-parallel rank."""
    ckpt = ["--checkpoint-dir", checkpoint_dir] if checkpoint_dir else []
    # the trainer's run dir (steps.jsonl, tracking files) is <output_dir>/<run name>; role_args may move it
    roles = {
        "trainer": ["trainer", *ckpt, "--output-dir", output_dir],
        "rollout": ["rollout", "--engine-url", ",".join(engine_urls)],
        "advantage": ["advantage"],
    }
    if judge_url is not None:  # named, not one of --engine-url: the rollout never registers it
        roles["rollout"] += ["--judge-urls", f"judge={judge_url}"]
    if run.uses_critic:
        roles["critic"] = ["trainer", "--role", "critic", *ckpt]
    if run.uses_actor_fwd:
        roles["actor_fwd"] = ["forward", "--role", "actor_fwd", *ckpt]
    if run.uses_reference:
        roles["reference"] = ["forward", "--role", "reference"]
    if trainer_ranks > 1:  # one process per data-parallel rank; rank 0 hosts the rendezvous
        dp = ["--dp-size", str(trainer_ranks), "--dp-master", f"127.0.0.1:{free_port()}"]
        roles["trainer"] += [*dp, "--dp-rank", "0"]
        for r in range(1, trainer_ranks):
            roles[f"trainer-{r}"] = ["trainer", *ckpt, *dp, "--dp-rank", str(r)]
    return roles


def stack_flags(run_id: str, dcs_url: str, tq_controller: str, redis_url: str) -> list[str]:
    """The arguments every role gets: its run, and where the coordinator, TransferQueue and Redis are."""
    return [
        "--run-id",
        run_id,
        "--dcs-url",
        dcs_url,
        "--tq-controller",
        tq_controller,
        "--redis-url",
        redis_url,
        "--host",
        "127.0.0.1",
    ]
