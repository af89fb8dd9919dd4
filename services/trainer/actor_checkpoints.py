"""The actor trainer's checkpoints: which steps are due, the files a sharded backend (fsdp, megatron) writes on
every rank, a finished step's checkpoint (written on the publish worker: services/trainer/publishing.py) and the
final one when the trainer stops."""

from __future__ import annotations

import logging
import os
import threading

import torch

from services.run_contract.checkpoint import ShardedState, save_checkpoint
from services.run_contract.run_config import RunConfig
from services.runtime.spans import span
from services.trainer.backend import TrainerBackend
from services.trainer.checkpoint_copy import TrainingStateCopy
from services.trainer.config import TrainerConfig
from services.trainer.data_parallel import DataParallel, Order

log = logging.getLogger(__name__)


class ActorCheckpoints:
    def __init__(
        self,
        config: TrainerConfig,
        run: RunConfig,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        backend: TrainerBackend,
        dp: DataParallel,
    ):
        self.config, self.run, self.dp = config, run, dp
        self.model, self.optimizer, self.backend = model, optimizer, backend
        self.checkpointed = 0  # next_step of the newest checkpoint, or where this process resumed

    def due(self, step: int) -> bool:
        return bool(self.config.checkpoint_dir) and self.run.checkpoint.due_after(step)

    def scratch(self, next_step: int) -> str:
        """Where a backend that checkpoints sharded (fsdp, megatron) writes before the checkpoint directory exists
        (a .tmp name: ignored, and replaced, if a crash leaves it)."""
        return os.path.join(self.config.checkpoint_dir, "actor", f"step_{next_step:08d}.sharded.tmp")

    def sharded_state(self, step: int) -> ShardedState | None:
        """After step N trained, on every rank: a sharded backend writes, when N is due for a checkpoint, its files
        (a collective: in the main loop, in the same order on every rank). Returns what it wrote (leader) or None."""
        if not (self.backend.gathers and self.due(step)):
            return None
        return self.backend.write_checkpoint_files(self.scratch(step + 1))

    def write(
        self, next_step: int, version: int, state: ShardedState | None = None, copied: TrainingStateCopy | None = None
    ) -> None:
        with span("checkpoint", next_step - 1, version):
            save_checkpoint(
                self.config.checkpoint_dir,
                "actor",
                self.model,
                self.optimizer,
                self.run.model,
                next_step,
                version,
                keep=self.run.checkpoint.keep_last,
                state=state,
                copied=copied,
            )
        self.checkpointed = next_step

    def final(self, next_step: int, version: int, halted_mid_step: bool, halt: threading.Event) -> None:
        """Stopped (SIGTERM, a stopped run, or the last step done), with every finished step published and
        recorded: checkpoint the last finished step, so that a restart resumes right after it and loses no step
        and the trained model can be exported. Not when optimizer steps of the unfinished step already moved the
        weights (`halted_mid_step`, num_iters_per_train_update > 1): those weights are no step's, and a restart
        resumes from the previous checkpoint as after a crash."""
        if not (self.config.checkpoint_dir and self.run.checkpoint.on_stop) or next_step == self.checkpointed:
            return
        if halted_mid_step:
            log.warning(
                "stopped inside a step whose optimizer steps had begun: no final checkpoint",
                extra={"next_step": next_step, "checkpointed": self.checkpointed},
            )
            return
        state = None
        if self.backend.gathers:  # the other ranks join the gather; stopped, they may have left already
            if halt.is_set():
                log.warning(
                    "stopped: the sharded trainer resumes from its last interval checkpoint",
                    extra={"next_step": next_step, "checkpointed": self.checkpointed},
                )
                return
            self.dp.order(Order.CHECKPOINT, next_step, version)
            state = self.backend.write_checkpoint_files(self.scratch(next_step))
        self.write(next_step, version, state)
        log.info("final checkpoint", extra={"next_step": next_step, "version": version})
