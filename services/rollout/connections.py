"""The rollout's own seams beside its run session (services/role/session.py): the engine pool it is given, and
its node's registration. A role test passes in-memory engines instead (tests/fakes/engines.py)."""

from __future__ import annotations

from services.dcs.models import NodeRegistration
from services.rollout.config import RolloutConfig
from services.rollout.engine_pool import EnginePool, Engines


def engine_pool(config: RolloutConfig) -> Engines:
    """The engines of `config` (the default of RolloutService's `engines` seam)."""
    return EnginePool(
        config.engine_urls, timeout_s=config.request_timeout_s, api_key=config.auth_token or None
    )  # the stack's one token (docs/security.md)


def registration(config: RolloutConfig) -> NodeRegistration:
    """This rollout's node (its engines' registrations are the fleet's: services/rollout/engine_fleet.py)."""
    return NodeRegistration(
        role="rollout", host=config.advertise_host, ports={"http": config.port}, run_id=config.run_id
    )
