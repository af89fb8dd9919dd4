"""The launcher's side of the fork server (services/runtime/fork_server.py): `ForkServerClient` starts one server
and asks it for children; `ForkedChild` is such a child, with the part of `subprocess.Popen`'s interface a
launcher uses (pid, poll, wait, send_signal, kill, returncode).

A spawn does not wait for the server's preload: the request waits in its pipe, and the child's pid is known when
the server answers (`ForkedChild.pid` blocks until then), so a launcher starts a stack's other services meanwhile.
Children are signalled through the server, which signals only a child it has not reaped (a recycled pid is never
hit); if the server dies its children live on, are signalled directly, and their exit codes are unknown
(`UNKNOWN_EXIT`)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import IO, Callable, Mapping, Sequence

# the heavy imports of the engine, the roles, the TransferQueue and the coordinator (~5.5 CPU s in each process on
# a 2-core machine); none starts a thread at import (pyarrow's jemalloc would, but child_env turns its background
# thread off; gRPC is not here: its fork handlers and threads). pandas: pyarrow imports it, when installed, on its
# first conversion (~0.9 CPU s in every process that moves Arrow data, of a role's 1.6)
PRELOAD = (
    "torch",
    "transformers",
    "transformers.modeling_utils",
    "transformers.models.auto.modeling_auto",
    "transformers.models.auto.tokenization_auto",
    "transformers.models.qwen2.modeling_qwen2",
    "safetensors.torch",
    "numpy",
    "yaml",
    "pydantic",
    "fastapi",
    "uvicorn",
    "httpx",
    "redis.asyncio",
    "prometheus_client",
    "setproctitle",
    "pyarrow",
    "pandas",
    "aiohttp",
    "pydantic_settings",
)
# environment variables that libraries read when they are imported: a child is forked only when its values of
# these equal the server's, since it sees the preloaded modules as the server imported them
IMPORT_ENV_PREFIXES = (
    "OMP_",
    "MKL_",
    "HF_",
    "TRANSFORMERS_",
    "TORCH",
    "PYTORCH_",
    "TOKENIZERS_",
    "PYTHON",
    "CUDA_",
    "ARROW_",
    "JE_ARROW_",
)
# read only at use, and set by torch itself on its first compile in the launcher (torch._inductor's cache_dir()):
# a launcher that compiled after starting its server would otherwise never fork again
USE_TIME_ENV = frozenset({"TORCHINDUCTOR_CACHE_DIR"})
# applied by the forked child itself: PYTHONPATH's entries go onto its sys.path (fork_server._enter), so a run
# whose services import a module beside its run file forks all the same
CHILD_APPLIED_ENV = frozenset({"PYTHONPATH"})
UNKNOWN_EXIT = 255  # the exit code of a child whose server died before it: nobody could read it


def import_env(env: Mapping[str, str]) -> dict[str, str]:
    skipped = USE_TIME_ENV | CHILD_APPLIED_ENV
    return {k: v for k, v in env.items() if k.startswith(IMPORT_ENV_PREFIXES) and k not in skipped}


def module_of(argv: Sequence[str]) -> tuple[str, list[str]] | None:
    """(module, args) when argv is `<this python> -m module args...`, which a fork can run; else None."""
    if len(argv) >= 3 and argv[0] == sys.executable and argv[1] == "-m":
        return argv[2], list(argv[3:])
    return None


class ForkServerClient:
    """One fork server, from a launcher: one it started (`start`, its preload running while the launcher goes
    on), or one that another launcher started with --listen, reached on its socket (`connect`); thread-safe.
    `on_child(pid)` is called for each child when its pid is known (the launcher's reaper registers it)."""

    def __init__(
        self,
        env: Mapping[str, str],
        on_child: Callable[[int], None],
        writer: IO[bytes],
        reader: IO[bytes],
        proc: subprocess.Popen | None = None,
        sock: socket.socket | None = None,
    ):
        self.env = dict(env)
        self._on_child = on_child
        self._writer, self._reader = writer, reader
        self.proc, self._sock = proc, sock  # proc: the server, when this launcher started it
        self._lock = threading.Condition()
        self._next_id = 0
        self._pending: dict[int, ForkedChild] = {}  # by request id, until the server answers
        self._by_pid: dict[int, ForkedChild] = {}  # forked, until the server reports its exit
        self.gone = False
        threading.Thread(target=self._read_answers, name="fork-server", daemon=True).start()

    @classmethod
    def start(
        cls,
        env: dict[str, str],
        on_child: Callable[[int], None],
        preload: Sequence[str] = PRELOAD,
        listen: str | None = None,
    ) -> ForkServerClient:
        """A new server in environment `env`; with `listen`, other launchers may connect on that socket."""
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.runtime.fork_server", "--preload", ",".join(preload)]
            + (["--listen", listen] if listen else []),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            start_new_session=True,
        )
        assert proc.stdin is not None and proc.stdout is not None
        deadline = time.monotonic() + 30.0
        while listen and not os.path.exists(listen) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)  # it binds before its preload: from then on a launcher may connect
        return cls(env, on_child, proc.stdin, proc.stdout, proc=proc)

    @classmethod
    def connect(cls, path: str, on_child: Callable[[int], None], timeout_s: float = 30.0) -> ForkServerClient:
        """The server listening on `path`, once it has preloaded; OSError when none answers there."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout_s)
        try:
            sock.connect(path)
            reader = sock.makefile("rb")
            hello = json.loads(reader.readline() or b"{}")
            if "ready" not in hello or not isinstance(hello.get("env"), dict):
                raise OSError(f"no fork server answers on {path}")
        except (OSError, ValueError) as exc:
            sock.close()
            raise OSError(f"fork server {path}: {exc}") from exc
        sock.settimeout(None)
        return cls(hello["env"], on_child, sock.makefile("wb"), reader, sock=sock)

    def can_fork(self, env: Mapping[str, str]) -> bool:
        return not self.gone and import_env(env) == import_env(self.env)

    def spawn(self, module: str, args: list[str], env: Mapping[str, str], log: str | None) -> ForkedChild:
        with self._lock:
            self._next_id += 1
            child = ForkedChild(self, module)
            self._pending[self._next_id] = child
            request = {"spawn": self._next_id, "module": module, "args": args, "env": dict(env), "log": log}
            self._send({**request, "cwd": _current_directory()})
        return child

    def signal(self, child: ForkedChild, number: int) -> None:
        with self._lock:
            if child.returncode is not None:
                return
            if not self.gone:
                self._send({"signal": child.pid, "number": number})
                return
        try:
            os.kill(child.pid, number)
        except ProcessLookupError:
            pass

    def close(self) -> None:
        """Stops the server this launcher started (its children are the launcher's to stop): EOF on its stdin;
        of a connected server, ends the connection only."""
        try:
            self._writer.close()
        except OSError:
            pass
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._sock.close()
            return
        assert self.proc is not None
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def _send(self, message: dict) -> None:
        try:
            self._writer.write((json.dumps(message) + "\n").encode())
            self._writer.flush()
        except (OSError, ValueError):
            pass  # gone: its reader marks every child

    def _read_answers(self) -> None:
        try:
            self._read_lines()
        except (OSError, ValueError):
            pass  # a connection closed under the reader
        with self._lock:
            self.gone = True
            for child in [*self._pending.values(), *self._by_pid.values()]:
                child._server_gone()
            self._lock.notify_all()

    def _read_lines(self) -> None:
        for line in self._reader:
            try:
                answer = json.loads(line)
            except ValueError:
                continue
            if "spawned" in answer:
                self._spawned(answer)
            elif "exited" in answer:
                self._exited(answer["exited"], answer["code"])

    def _spawned(self, answer: dict) -> None:
        with self._lock:
            child = self._pending.pop(answer["spawned"], None)
            if child is None:
                return
            if "pid" in answer:
                child._pid = answer["pid"]
                self._by_pid[child._pid] = child
            else:
                child.error = answer.get("error", "refused")
                child.returncode = UNKNOWN_EXIT
            self._lock.notify_all()
        if child._pid is not None:
            self._on_child(child._pid)

    def _exited(self, pid: int, code: int) -> None:
        with self._lock:
            child = self._by_pid.pop(pid, None)
            if child is not None:
                child.returncode = code
            self._lock.notify_all()


class ForkedChild:
    """A child of the fork server, as a launcher sees a Popen."""

    def __init__(self, server: ForkServerClient, module: str):
        self._server = server
        self.module = module
        self._pid: int | None = None
        self.returncode: int | None = None
        self.error: str | None = None

    @property
    def pid(self) -> int:
        """Blocks until the server has forked it (it is still importing its preload at first)."""
        with self._server._lock:
            self._server._lock.wait_for(lambda: self._pid is not None or self.returncode is not None)
        if self._pid is None:
            raise RuntimeError(f"the fork server did not start {self.module}: {self.error}")
        return self._pid

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        with self._server._lock:
            if not self._server._lock.wait_for(lambda: self.returncode is not None, timeout):
                raise subprocess.TimeoutExpired(self.module, timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, number: int) -> None:
        if self.returncode is None:
            self._server.signal(self, number)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _server_gone(self) -> None:
        """Called under the server's lock once it is gone: a child it never forked failed; one it forked is now
        an orphan whose exit nobody reports, so it is watched through its pid."""
        if self._pid is None and self.returncode is None:
            self.error, self.returncode = "the fork server exited", UNKNOWN_EXIT
        elif self._pid is not None and self.returncode is None:
            threading.Thread(target=self._watch_orphan, name=f"orphan-{self._pid}", daemon=True).start()

    def _watch_orphan(self) -> None:
        assert self._pid is not None
        while running(self._pid):
            time.sleep(0.05)
        with self._server._lock:
            self.returncode = UNKNOWN_EXIT
            self._server._lock.notify_all()


def _current_directory() -> str | None:
    """Where the child starts, as a Popen child would: this process's directory (None: removed, the server's)."""
    try:
        return os.getcwd()
    except OSError:
        return None


def running(pid: int) -> bool:
    """The process exists and is not a zombie (an orphan's new parent may be slow to reap it, or never do)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
