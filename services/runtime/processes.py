"""Child processes for running the stack on one machine (the demo, tests, benchmarks): a private
redis-server and Sluice services, each started as a real process and stopped with SIGTERM.

Never `fork()` here: the launchers have gRPC loaded (see services/runtime/reaper.py for why and for how
children still die with a killed launcher)."""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import IO, Callable, Iterable, Sequence

from services.runtime import reaper
from services.runtime.forked_process import ForkedChild, ForkServerClient, module_of
from services.runtime.redis_password import redis_conf_line, write_private_file


EPHEMERAL_DEFAULT = (32768, 60999)  # Linux's default net.ipv4.ip_local_port_range
PICK_FLOOR = 10000  # below this sit the well-known services a user may start later (5432, 6379, 8080, ...)
_pick = random.SystemRandom()  # not the seeded `random`: two processes seeded alike would pick alike
# a picked port is no other pick's, in any launcher on this machine, for this long: it covers the time from the
# pick to the service's bind (an engine loads its model first), after which a bind check sees it taken
PORT_HOLD_S = 180.0
PORT_CLAIMS = os.path.join(tempfile.gettempdir(), "sluice-ports")


def ephemeral_ports() -> tuple[int, int]:
    """The range the kernel takes outgoing connections' local ports (and bind-to-0 ports) from."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return EPHEMERAL_DEFAULT


def free_port(host: str = "127.0.0.1") -> int:
    """A port on `host` that nobody listens on now, for a server started later to bind. Picked at random
    outside the kernel's ephemeral range: a port from inside it (what binding to 0 gives) could be taken as
    the local port of any outgoing connection before the server binds it (seen in CI: an engine that loads
    its model first found its port taken), and bind-to-0 hands a port just freed to the next caller in any
    process. Falls back to binding 0 where the ephemeral range leaves no room outside it."""
    low, high = ephemeral_ports()
    candidates = [(PICK_FLOOR, low - 1), (high + 1, 65535)]
    candidates = [(a, b) for a, b in candidates if b - a >= 1000]
    for _ in range(64 if candidates else 0):
        a, b = _pick.choice(candidates)
        port = _pick.randint(a, b)
        if not _claimed(port):
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _claimed(port: int) -> bool:
    """Claims a picked port among this machine's launchers, this one included (two picks were seen to agree while
    neither service had bound yet): a file per port under the temp directory, made exclusively, or taken over
    when older than PORT_HOLD_S. False while another pick holds it; True where no such file can be written."""
    path = os.path.join(PORT_CLAIMS, str(port))
    try:
        os.makedirs(PORT_CLAIMS, exist_ok=True)
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        return True
    except FileExistsError:
        try:
            if time.time() - os.stat(path).st_mtime < PORT_HOLD_S:
                return False
            os.utime(path)
            return True
        except OSError:
            return False
    except OSError:
        return True


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Children get one torch/BLAS thread each: on a small machine oversubscription costs 20-50x. pyarrow's
    jemalloc starts no background thread (it purges as it allocates instead): the fork server's process must have
    one thread when it forks, and pyarrow's default pool is mimalloc in any case."""
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    env.setdefault("JE_ARROW_MALLOC_CONF", "background_thread:false")
    env.update(extra or {})
    return env


class Reaper:
    """This process's reaper (services/runtime/reaper.py), started on first use: children registered with
    it are killed when this process dies, however it dies. Thread-safe; one per process."""

    _lock = threading.Lock()
    _instance: "Reaper | None" = None

    def __init__(self):
        read_fd, write_fd = os.pipe()  # both close-on-exec: only the reaper gets the read end, as stdin
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-I", reaper.__file__],
                stdin=read_fd,
                stdout=subprocess.DEVNULL,
                start_new_session=True,
            )
        finally:
            os.close(read_fd)
        self._pipe = os.fdopen(write_fd, "w", buffering=1)
        self._write_lock = threading.Lock()

    @classmethod
    def get(cls) -> "Reaper":
        with cls._lock:
            if cls._instance is None or cls._instance.proc.poll() is not None:
                cls._instance = Reaper()
            return cls._instance

    def _send(self, line: str) -> None:
        with self._write_lock:
            try:
                self._pipe.write(line + "\n")
            except (BrokenPipeError, ValueError):
                pass  # the reaper is gone: nothing left to register with

    def register(self, pgid: int) -> None:
        self._send(f"+{pgid}")

    def forget(self, pgid: int) -> None:
        self._send(f"-{pgid}")


class StopsOnExit:
    """A group of local processes used as a context manager: leaving the block calls its stop()."""

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


class ChildProcess:
    """A child in its own session (so signals to our terminal group do not reach it), started without
    `preexec_fn` (CPython then uses vfork, which runs none of gRPC's fork handlers) and registered with this
    process's reaper, so it dies with us even when we are SIGKILLed.

    With `forker`, a `python -m module` child is forked from that fork server instead, when its import-time
    environment is the server's (the server registers it with the reaper once forked)."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_path: str | None = None,
        env: dict | None = None,
        forker: ForkServerClient | None = None,
    ):
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self._reaper = Reaper.get()
        full_env, module = child_env(env), module_of(self.argv)
        self.proc: subprocess.Popen | ForkedChild
        if forker is not None and module is not None and forker.can_fork(full_env):
            self._log: int | IO[bytes] = subprocess.DEVNULL
            if log_path:
                open(log_path, "ab").close()  # there from the start, as a Popen child's is
            self.proc = forker.spawn(module[0], module[1], full_env, log_path)
        else:
            self._log = open(log_path, "ab") if log_path else subprocess.DEVNULL
            self.proc = subprocess.Popen(
                self.argv,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                env=full_env,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
            self._reaper.register(self.proc.pid)
        self._forgotten = self._terminated = False

    def _forget(self) -> None:
        if not self._forgotten:
            self._forgotten = True
            if not (isinstance(self.proc, ForkedChild) and self.proc.error is not None):  # never forked: no pid
                self._reaper.forget(self.proc.pid)

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    def alive(self) -> bool:
        if self.proc.poll() is None:
            return True
        self._forget()
        return False

    def wait_until(self, ready: Callable[[], bool], timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; log: {self.log_tail()}")
            if ready():
                return
            time.sleep(0.02)
        self.kill()  # never left running unready and untracked (a restart would then find its port taken)
        raise TimeoutError(f"{self.name} not ready after {timeout_s}s; log: {self.log_tail()}")

    def log_tail(self, n: int = 4000) -> str:
        if not self.log_path:
            return "(no log)"
        with open(self.log_path, "rb") as f:
            return f.read()[-n:].decode(errors="replace")

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL if it does not exit in time; returns the exit code."""
        self.terminate()
        return self.finish(time.monotonic() + timeout_s)

    def terminate(self) -> None:
        """SIGTERM, once: a second one could reach a service whose event loop (and with it the handler that
        turns SIGTERM into a clean stop) has already closed, and kill it on its way out."""
        if not self._terminated and self.alive():
            self._terminated = True
            self.proc.send_signal(signal.SIGTERM)

    def finish(self, deadline: float) -> int | None:
        """Wait until the monotonic `deadline` for it to exit, then SIGKILL it; returns the exit code."""
        try:
            self.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._forget()
        if not isinstance(self._log, int):  # DEVNULL is an int; a log file is ours to close
            self._log.close()
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL: the crash case."""
        if self.alive():
            self.proc.kill()
            self.proc.wait()
        self._forget()


def stop_together(
    processes: Callable[[], Iterable[ChildProcess]], timeout_s: float, starting: Callable[[], bool] = lambda: False
) -> None:
    """Stop processes at once: SIGTERM to all, one shared deadline, then SIGKILL to what is left.

    Why not one after the other: each exit takes its own time (on a GPU the CUDA context's teardown adds
    seconds to the engine's and the trainer's), and one that hangs would hold every later one back by its
    whole timeout; together they take as long as the slowest. `processes()` is asked again until all have
    exited: a process that a restart (`starting()`: one is still on its way) started after the first look
    is stopped too, and the restart, whose process then exits, ends."""
    deadline = time.monotonic() + timeout_s
    signalled: dict[int, ChildProcess] = {}
    while True:
        for proc in processes():
            if id(proc) not in signalled:
                signalled[id(proc)] = proc
                proc.terminate()
        exited = not any(proc.alive() for proc in signalled.values())
        if (exited and not starting()) or time.monotonic() >= deadline:
            break
        time.sleep(0.02)
    for proc in signalled.values():
        proc.finish(deadline)


def sluice_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "services.cli", *args]


def start_redis(
    port: int | None = None,
    log_dir: str | None = None,
    data_dir: str | None = None,
    password: str = "",
    appendfsync: str = "everysec",
) -> tuple[ChildProcess, str]:
    """A private redis-server on a free port -> (process, url): memory only, or with `data_dir` an
    append-only file there, fsynced every second (`appendfsync`: or "always", on every write). Redis writes
    each command to the file before it replies, so a killed redis-server restarted on the same port and
    directory loses nothing it acknowledged; only a machine crash can lose the last second.

    `password`: Redis requires it (AUTH). It goes into a redis.conf (mode 0600) whose path is redis-server's
    argv, never onto argv itself (every user's process list); the url carries no password."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed (apt-get install -y redis-server)")
    if appendfsync not in ("everysec", "always"):
        raise ValueError(f"appendfsync: everysec or always, got {appendfsync!r}")
    port = port or free_port()
    workdir = data_dir or tempfile.mkdtemp(prefix="sluice-redis-")
    os.makedirs(workdir, exist_ok=True)
    log_path = os.path.join(log_dir or workdir, f"redis-{port}.log")
    conf = [write_private_file(os.path.join(workdir, "redis.conf"), redis_conf_line(password))] if password else []
    persistence = ["--appendonly", "yes", "--appendfsync", appendfsync] if data_dir else ["--appendonly", "no"]
    proc = ChildProcess(
        "redis",
        [binary, *conf, "--port", str(port), "--bind", "127.0.0.1", "--save", "", *persistence, "--dir", workdir],
        log_path,
    )
    proc.wait_until(lambda: _redis_answers(port, password), 10)
    return proc, f"redis://127.0.0.1:{port}/0"


def _redis_answers(port: int, password: str) -> bool:
    """PING answered (after AUTH, with a password), the append-only file loaded."""
    import redis

    try:
        with redis.Redis(port=port, password=password or None, socket_timeout=0.5, socket_connect_timeout=0.2) as r:
            return bool(r.ping())
    except redis.RedisError:  # not listening yet, or still loading its file
        return False


def listening(host: str, port: int) -> bool:
    """Something accepts TCP connections on host:port: the first look of a readiness check, 10-30x cheaper than
    an HTTP or gRPC request (a launcher polls a starting process every 20 ms, on the cores it starts on)."""
    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except OSError:
        return False


def http_ok(url: str) -> bool:
    import urllib.error
    import urllib.parse
    import urllib.request

    parts = urllib.parse.urlsplit(url)
    if not listening(parts.hostname or "127.0.0.1", parts.port or (443 if parts.scheme == "https" else 80)):
        return False
    try:
        with urllib.request.urlopen(url, timeout=0.5) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False
