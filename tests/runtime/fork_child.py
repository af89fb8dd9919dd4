"""A child for the fork server's tests, run as `python -m tests.runtime.fork_child MODE`: `report` prints what a
fresh interpreter's child would know about itself (argv, an env var, its session, numpy's first draw, its parent,
its directory, where the module FORK_CHILD_IMPORT names was found) as JSON and exits with the code in
FORK_CHILD_EXIT; `raise` raises; `sleep` sleeps until signalled, after writing `ready`."""

from __future__ import annotations

import importlib
import json
import os
import sys
import time


def main() -> None:
    mode = sys.argv[1]
    if mode == "report":
        import numpy as np

        print(
            json.dumps(
                {
                    "argv": sys.argv[1:],
                    "name": __name__,
                    "marker": os.environ.get("FORK_CHILD_MARKER"),
                    "session": os.getsid(0) == os.getpid(),
                    "draw": float(np.random.rand()),
                    "stdin": sys.stdin.read(),
                    "cmdline": open(f"/proc/{os.getpid()}/cmdline", "rb").read().decode(),
                    "ppid": os.getppid(),
                    "cwd": os.getcwd(),
                    "imported": importlib.import_module(name).__file__
                    if (name := os.environ.get("FORK_CHILD_IMPORT"))
                    else None,
                }
            ),
            flush=True,
        )
        sys.exit(int(os.environ.get("FORK_CHILD_EXIT", "0")))
    if mode == "raise":
        raise RuntimeError("fork_child raised on purpose")
    print("ready", flush=True)
    time.sleep(600)


if __name__ == "__main__":
    main()
