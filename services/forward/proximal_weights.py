"""actor_fwd's weights: the newest published version and, for `algorithm.proximal_policy: previous`, the one
before it, so that every step is scored with the version its proximal policy names.

Decoupled PPO (Hilton et al. 2022, "Batch size-invariance for policy optimization"; AReaL, Fu et al. 2025) centres
the clip on a proximal policy pi_prox and reweights by the behaviour weight pi_prox / mu:

    L = E_mu[ (pi_prox / mu) * min(r * A, clip(r, 1 - eps, 1 + eps) * A) ],   r = pi_theta / pi_prox

The gradient where nothing is clipped is the off-policy policy gradient E_mu[(pi_theta / mu) A grad log pi_theta]
whatever pi_prox is; pi_prox only sets where the clip bites. With one optimizer step per training step (the
trainer's default), pi_prox = the weights step N trains with gives r = 1 at that step: the clip bounds nothing,
and a stale sample's update is as large as its weight allows. pi_prox = the version before (`previous`) bounds
each step's move from the last one, as plain PPO at staleness 1 does, at any staleness. Hilton et al. use an
average of recent policies; the previous version is the one-step case of it.

Holding two versions costs a second copy of the model in actor_fwd. A version is received into the older copy,
which then becomes the newest: no copy per version."""

from __future__ import annotations

import copy
import logging

import torch

from services.dcs.sync.receiver import follow_weights
from services.run_state.seams import WeightFollower

log = logging.getLogger(__name__)


class ProximalWeights:
    def __init__(self, model: torch.nn.Module, version: int, keep_previous: bool):
        self.current, self.current_version = model, version
        self.previous = copy.deepcopy(model) if keep_previous else None
        self.previous_version = version
        self._warned: set[int] = set()

    def follow(self, receiver: WeightFollower, wait_s: float) -> int | None:
        """follow_weights into the older copy (the only one without a previous), which becomes the newest: the
        version loaded, or None."""
        # a WeightFollower is WeightReceiver's seam (run_state/seams.py); the leaf dcs/sync names the class
        loaded = follow_weights(
            receiver,  # type: ignore[arg-type]
            self.previous if self.previous is not None else self.current,
            wait_s,
        )
        if loaded is not None:
            if self.previous is not None:
                self.previous, self.current = self.current, self.previous
                self.previous_version = self.current_version
            self.current_version = loaded
        return loaded

    def replace(self, model: torch.nn.Module, version: int) -> None:
        """A restarted role's weights loaded from a checkpoint: both copies hold that version."""
        self.current, self.current_version = model, version
        if self.previous is not None:
            self.previous, self.previous_version = copy.deepcopy(model), version

    def holding(self, version: int) -> torch.nn.Module:
        """The copy that holds `version`; the newest one (logged once) when neither does, as after a restart that
        found only the newest version in a checkpoint."""
        if self.current_version == version or self.previous is None:
            return self.current
        if self.previous_version == version:
            return self.previous
        if version not in self._warned:
            self._warned.add(version)
            log.warning(
                "the proximal version is not held; scoring with the newest one",
                extra={"wanted": version, "held": [self.previous_version, self.current_version]},
            )
        return self.current
