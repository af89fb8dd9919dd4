"""Roles read the run's configuration from the coordinator; they may start before it is submitted."""

from __future__ import annotations

import logging
import time

from services.dcs.client import DCSClient, DCSError
from services.run_contract.run_config import RunConfig
from services.runtime.poll_backoff import poll_intervals

log = logging.getLogger(__name__)


def wait_for_run(dcs: DCSClient, run_id: str, stop=None, poll_s: float = 1.0) -> RunConfig | None:
    """The run's config once it exists (None if `stop` is set first, or if the run already failed or was
    stopped: there is nothing to work for). Connection errors are retried: the coordinator may come up
    after this service. Looked for again soon at first, then less often, up to every poll_s."""
    announced = False
    intervals = poll_intervals(poll_s)
    while stop is None or not stop.is_set():
        try:
            run = dcs.run(run_id)
            if run.status in ("failed", "stopped"):
                log.info("the run has ended; nothing to do", extra={"run_id": run_id, "status": run.status})
                return None
            return run.config
        except DCSError as exc:
            if exc.status != 404:
                raise
            if not announced:
                log.info("waiting for the run to be created", extra={"run_id": run_id})
                announced = True
        except OSError as exc:  # DCSUnreachable: it may come up after this service
            log.warning("coordinator unreachable", extra={"error": str(exc)})
        time.sleep(next(intervals))
    return None
