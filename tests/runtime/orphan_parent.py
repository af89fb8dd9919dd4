"""A launcher for the kill -9 test: starts a redis-server, a Python child and a child forked by a fork server from
a worker thread that then exits (PR_SET_PDEATHSIG would kill them right there), prints their pids (and the fork
server's) as JSON, and waits to be killed."""

from __future__ import annotations

import json
import sys
import threading
import time

from services.runtime.fork_server_choice import start_fork_server
from services.runtime.processes import ChildProcess, start_redis


def main() -> None:
    started = {}

    def start() -> None:
        redis, _ = start_redis()
        sleeper = ChildProcess("sleeper", [sys.executable, "-c", "import time; time.sleep(600)"])
        forker = start_fork_server(preload=("json",))
        forked = ChildProcess("forked", [sys.executable, "-m", "tests.runtime.fork_child", "sleep"], forker=forker)
        assert forker is not None
        started.update(redis=redis.proc.pid, sleeper=sleeper.proc.pid, forked=forked.proc.pid, forker=forker.proc.pid)

    worker = threading.Thread(target=start)
    worker.start()
    worker.join()
    time.sleep(0.5)  # the starting thread is gone; children must still be alive
    print(json.dumps(started), flush=True)
    time.sleep(600)


if __name__ == "__main__":
    main()
