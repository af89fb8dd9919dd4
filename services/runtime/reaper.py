"""The reaper: a tiny watchdog process that kills a launcher's children when the launcher dies.

Why a separate process: a launcher (the test suite, `sluice demo`, `LocalRun`) has gRPC loaded, and gRPC's
`pthread_atfork` handlers can deadlock `fork()` while its threads run (grpc/grpc#17986, #31885, #37259). So
children are started with plain `subprocess.Popen` and no `preexec_fn`, which CPython runs through `vfork`
(no fork handlers), and nothing runs in the child before `exec`: `PR_SET_PDEATHSIG` is out (it also fires
when the *thread* that forked exits, not the process). Instead every launcher starts one reaper:

- its stdin is the read end of a pipe whose write end only the launcher holds (close-on-exec, so no child
  inherits it); the launcher writes `+PGID` when it starts a child in its own session and `-PGID` when it
  has reaped it;
- EOF on stdin means the launcher is gone (killed with -9 included: the kernel closes its descriptors), so
  the reaper sends SIGTERM to every process group still registered, waits `GRACE_S`, then SIGKILLs them.

The reaper lives in its own session, ignores SIGINT (a Ctrl-C to the terminal's group must not take it down
before it has reaped), and treats SIGTERM as EOF. It imports nothing from Sluice, so it starts in ~20 ms.
Run as `python -I reaper.py`.
"""

from __future__ import annotations

import os
import signal
import sys
import time

GRACE_S = 5.0


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def reap(groups: set[int], grace_s: float = GRACE_S) -> None:
    """SIGTERM every group, SIGKILL what is left after `grace_s`."""
    for pgid in groups:
        try:
            os.killpg(pgid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_group_alive(g) for g in groups):
        time.sleep(0.05)
    for pgid in groups:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def apply(line: str, groups: set[int]) -> None:
    """One registration line: `+PGID` adds a group, `-PGID` forgets it; anything else is ignored."""
    line = line.strip()
    if len(line) > 1 and line[0] in "+-" and line[1:].isdigit() and int(line[1:]) > 1:
        (groups.add if line[0] == "+" else groups.discard)(int(line[1:]))


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    groups: set[int] = set()

    def on_term(signum, frame):  # stopped on purpose: reap now
        reap(groups)
        os._exit(0)

    signal.signal(signal.SIGTERM, on_term)
    for line in sys.stdin:
        apply(line, groups)
    reap(groups)  # EOF: the launcher is gone


if __name__ == "__main__":
    main()
