"""A role process's view of its run's lifecycle on the coordinator (docs/dcs.md, "Run lifecycle"): it waits
for the run to exist, notices when the run fails or is stopped (so the role exits instead of waiting for
rows, versions or a resume that will never come), and reports the role's own fatal error as the run's
failure. serve_role (role_service.py) drives it, over the coordinator client the role's session shares
(session.py), awaited on the host's event loop (DCSClient.aio); the role's loop never sees it."""

from __future__ import annotations

import asyncio
import logging
import traceback

from services.dcs.client import DCSClient, DCSError
from services.dcs.models import Run
from services.runtime.poll_backoff import poll_intervals

log = logging.getLogger(__name__)
EXITS = frozenset({"failed", "stopped"})  # a role exits when its run is in one of these (finished: it stays up)


class RunWatch:
    def __init__(self, dcs: DCSClient, run_id: str, role: str, poll_s: float = 1.0):
        self.dcs = dcs.aio
        self.run_id, self.role, self.poll_s = run_id, role, poll_s
        self.status: str | None = None  # the run's lifecycle status when last seen
        self._unreachable_logged = False

    async def read(self) -> Run | None:
        """The run now; None if it does not exist or the coordinator cannot be reached (both may pass)."""
        try:
            run = await self.dcs.run(self.run_id)
        except DCSError as exc:
            if exc.status != 404:
                log.warning("reading the run failed", extra={"error": str(exc)})
            return None
        except OSError as exc:  # DCSUnreachable: it may come up after this service, or be restarting
            if not self._unreachable_logged:
                log.warning("coordinator unreachable", extra={"error": str(exc)})
                self._unreachable_logged = True
            return None
        self._unreachable_logged = False
        self.status = run.status
        return run

    async def wait_for_run(self, stop: asyncio.Event) -> Run | None:
        """The run once it exists (None if `stop` is set first): looked for again soon at first (it is usually
        submitted while the roles start), then less often, up to every poll_s."""
        announced = False
        intervals = poll_intervals(self.poll_s)
        while not stop.is_set():
            run = await self.read()
            if run is not None:
                return run
            if not announced:
                log.info("waiting for the run to be created", extra={"run_id": self.run_id})
                announced = True
            try:
                await asyncio.wait_for(stop.wait(), next(intervals))
            except TimeoutError:
                pass
        return None

    @property
    def ended(self) -> bool:
        """The run failed or was stopped: the role should exit."""
        return self.status in EXITS

    async def until_ended(self) -> str:
        """Poll until the run fails or is stopped; its status then."""
        while not self.ended:
            await asyncio.sleep(self.poll_s)
            await self.read()
        log.info("the run ended; exiting at the next safe point", extra={"run_id": self.run_id, "status": self.status})
        assert self.status is not None  # ended: a status in EXITS
        return self.status

    async def report_failure(self, message: str, host: str, port: int) -> None:
        """Tell the coordinator this role failed (best effort: the process exits non-zero either way)."""
        try:
            node_id = await self._node_id(host, port)
            run = await self.dcs.fail_run(self.run_id, self.role, message, node_id=node_id)
            self.status = run.status
        except (DCSError, OSError) as exc:  # a run that ended already refuses it (409); it may be unreachable
            log.warning("could not report the failure", extra={"error": str(exc)})

    async def _node_id(self, host: str, port: int) -> str | None:
        """This process's registration (role, run, advertise host and status port), if it registered."""
        for node in (await self.dcs.topology()).roles.get(self.role, []):
            if node.run_id == self.run_id and node.host == host and node.ports.get("http") == port:
                return node.node_id
        return None


def failure_message(exc: BaseException) -> str:
    """`Type: message (at file:line in function)`, the innermost frame being where it was raised."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (at {frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name})" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"
