"""A built-in engine that registers itself with the coordinator (--dcs-url) as one of its run's engines: the
rollout follows the run's engine set and starts sending it requests once it serves the run's current weights,
which the trainer sends to every engine that reports an older version. Started engines join a running run,
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


def registration(config: EngineConfig, gpu: str | None) -> NodeRegistration:
    scheme = "https" if config.tls_cert_file else "http"
    return NodeRegistration(role="engine", host=config.advertise_host, ports={scheme: config.port},
                            run_id=config.run_id, device=config.device, weights_dtype=config.dtype, gpu=gpu)


def served_version(text: str) -> int:
    """The engine's version string as a number ("default", before any update, is 0)."""
    try:
        return int(text)
    except ValueError:
        return 0


async def stay_registered(config: EngineConfig, gpu: str | None, version: Callable[[], str],
                          stop: asyncio.Event) -> None:
    """Register (trying again while the coordinator is not up) and keep the registration's version current
    until `stop`; unregister on the way out."""
    dcs = DCSClient(config.dcs_url, token=config.auth_token or None)
    membership = None
    try:
        while membership is None and not stop.is_set():
            try:
                membership = await asyncio.to_thread(RunMembership, dcs, registration(config, gpu),
                                                     always_at_safe_point=True)
            except (OSError, DCSError) as exc:
                if isinstance(exc, DCSError) and exc.status not in (502, 503, 504):
                    log.error("the coordinator refused this engine's registration: serving without it",
                              extra={"error": str(exc)})
                    return
                log.warning("coordinator not reachable; trying again", extra={"error": str(exc)})
                await _wait(stop, RETRY_S)
        log.info("registered with the run", extra={"run_id": config.run_id, "dcs": config.dcs_url})
        while not stop.is_set() and membership is not None:
            membership.progress(weight_version=served_version(version()))
            await _wait(stop, 0.25)
    finally:
        if membership is not None:
            await asyncio.to_thread(membership.close)
        await asyncio.to_thread(dcs.close)


async def _wait(stop: asyncio.Event, seconds: float) -> None:
    try:
        await asyncio.wait_for(stop.wait(), seconds)
    except asyncio.TimeoutError:
        pass
