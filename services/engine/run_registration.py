"""A built-in engine that registers itself with the coordinator (--dcs-url) as one of its run's engines: the
rollout follows the run's engine set and starts sending it requests once it serves the run's current weights,
which the trainer sends to every engine the coordinator records with an older version: the registration says the
version this engine holds as it joins, and each weight sync that reaches it records the next (its heartbeats carry
none). Started engines join a running run,
stopped ones leave it (their lease lapses and the rollout resubmits their requests): `kubectl scale` of the
engine Deployment needs no restart of anything. An engine removed over REST stays out until added again."""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from services.dcs.client import DCSClient, DCSError
from services.dcs.membership import RunMembership
from services.dcs.models import NodeRegistration
from services.engine.config import EngineConfig

log = logging.getLogger(__name__)
RETRY_S = 2.0  # between tries to reach a coordinator that is not up yet


def registration(config: EngineConfig, gpu: str | None, version: int = 0) -> NodeRegistration:
    scheme = "https" if config.tls_cert_file else "http"
    return NodeRegistration(
        role="engine",
        host=config.advertise_host,
        ports={scheme: config.port},
        run_id=config.run_id,
        device=config.device,
        weights_dtype=config.dtype,
        gpu=gpu,
        weight_version=version,
    )


def served_version(text: str) -> int:
    """The engine's version string as a number ("default", before any update, is 0)."""
    try:
        return int(text)
    except ValueError:
        return 0


async def stay_registered(
    config: EngineConfig, gpu: str | None, version: Callable[[], str], stop: asyncio.Event
) -> None:
    """Register with the version it serves (trying again while the coordinator is not up) and stay registered
    until `stop`; unregister on the way out. (A re-registration after the coordinator forgot it says the version
    it first registered with, never newer than what it holds: at worst the trainer sends it the weights again.)"""
    dcs = DCSClient(config.dcs_url, token=config.auth_token or None)
    membership = None
    try:
        while membership is None and not stop.is_set():
            try:
                membership = await asyncio.to_thread(
                    RunMembership, dcs, registration(config, gpu, served_version(version())), always_at_safe_point=True
                )
            except (OSError, DCSError) as exc:
                if isinstance(exc, DCSError) and exc.status not in (502, 503, 504):
                    log.error(
                        "the coordinator refused this engine's registration: serving without it",
                        extra={"error": str(exc)},
                    )
                    return
                log.warning("coordinator not reachable; trying again", extra={"error": str(exc)})
                await _wait(stop, RETRY_S)
        log.info("registered with the run", extra={"run_id": config.run_id, "dcs": config.dcs_url})
        await stop.wait()
    finally:
        if membership is not None:
            await asyncio.to_thread(membership.close)
        await asyncio.to_thread(dcs.close)


async def _wait(stop: asyncio.Event, seconds: float) -> None:
    try:
        await asyncio.wait_for(stop.wait(), seconds)
    except asyncio.TimeoutError:
        pass
