"""The fork server: one process that imports the heavy libraries of Sluice's Python services once (torch,
transformers, the HTTP stack), then forks each service from that state, so a stack of N services pays those imports
once instead of N times. On a 2-core machine `import torch` costs ~1.4 CPU s and transformers' modelling ~2.9 s, in
the engine, the rollout, the trainer and the forward roles alike: the largest part of a local stack's start (issue
#36's stack start, benchmarks/stack_start.py). The launcher's side is services/runtime/forked_process.py.

Why not multiprocessing's forkserver: it pickles the process object to the server, and nothing that crosses a
process boundary here is pickled. Requests are JSON lines on stdin, answers JSON lines on stdout:

    {"spawn": ID, "module": "services.x", "args": [...], "env": {...}, "log": PATH or null, "cwd": DIR or null}
        -> {"spawned": ID, "pid": PID} or {"spawned": ID, "error": "..."}
    {"signal": PID, "number": N}      sent only to a child not yet reaped (never to a recycled pid)
    (unasked) {"exited": PID, "code": C}   C as Popen's returncode: -N for a child killed by signal N

Each child runs `python -m <module> <args>` as a fresh interpreter started in `cwd` would (the server's directory
without one; sys.path[0] that directory, then the env's PYTHONPATH entries; its own session, the env it was given,
stdin from /dev/null, stdout and stderr into its log, `__main__` the module), and exits with that code. EOF on
stdin means the launcher is gone: the server exits, and the launcher's reaper (services/runtime/reaper.py) ends
the children it registered.

With `--listen PATH` the server also takes launchers that connect on that unix socket (mode 0600): each is first
told `{"ready": PID, "env": {...}}` (the server's import-time environment, which a child's must equal), then
speaks as above on its connection; it may signal only the children it asked for, and hears only of their exits.
A connection's end stops nothing (its launcher's reaper ends its children); the owner's EOF ends the server.
`sluice run` and LocalRun use such a server when env SLUICE_FORK_SERVER names its socket (the test suite's
workers do, so every `sluice` command a test starts pays torch's imports once per worker).

Why forking is safe: the server has one thread (none of what it preloads starts one: pyarrow's jemalloc would,
but its background thread is off in the environment every child gets; gRPC, whose fork handlers can deadlock
with running threads, is not preloaded), and has started
no CUDA context and no OpenMP pool (both are made on first use, in the child). What a fork shares and a fresh
interpreter would not: the state of the preloaded modules at import, including the settings they read from the
environment then; the launcher forks only children whose import-time environment equals the server's
(forked_process.IMPORT_ENV_PREFIXES). `random` reseeds itself after a fork; numpy's global generator is reseeded
here.

Run as `python -m services.runtime.fork_server --preload torch,transformers,...`."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import selectors
import signal
import socket
import sys
import traceback

from services.runtime.forked_process import import_env

MODULE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def _answer(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def _preload(modules: list[str]) -> list[str]:
    """Imports each module; one that is not installed (transformers without the extra) is skipped."""
    loaded = []
    for name in modules:
        try:
            importlib.import_module(name)
            loaded.append(name)
        except ImportError as e:
            print(f"fork server: not preloading {name}: {e}", file=sys.stderr, flush=True)
    return loaded


def _checked(request: dict) -> tuple[str, list[str], dict[str, str], str | None, str | None]:
    """A spawn request's parts (module, args, env, log, cwd), or ValueError naming what is wrong."""
    module, args, env, log = request.get("module"), request.get("args"), request.get("env"), request.get("log")
    cwd = request.get("cwd")
    if cwd is not None and not isinstance(cwd, str):
        raise ValueError("cwd: a directory or null")
    if not isinstance(module, str) or not MODULE_NAME.match(module):
        raise ValueError(f"module: a dotted module name, got {module!r}")
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise ValueError("args: a list of strings")
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise ValueError("env: an object of strings")
    if log is not None and not isinstance(log, str):
        raise ValueError("log: a path or null")
    return module, args, env, log, cwd or None


def _exit_code(code: object) -> int:
    """SystemExit's code as the interpreter turns it into an exit status."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _run_child(module: str, args: list[str], env: dict[str, str], log: str | None, cwd: str | None) -> None:
    """In the forked child: become `python -m module args`, started in `cwd`, in a session of its own; never
    returns."""
    code = 1
    try:
        os.setsid()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        null = os.open(os.devnull, os.O_RDONLY)
        out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644) if log else os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.closerange(3, 1 << 16)  # the server's pipes, and anything a preloaded module opened
        _show_command_line(module, args)  # before the environment changes: setproctitle takes over its memory
        os.environ.clear()
        os.environ.update(env)
        _enter(cwd, env.get("PYTHONPATH", ""))
        if "numpy" in sys.modules:  # a fresh interpreter seeds numpy's global generator from the OS
            sys.modules["numpy"].random.seed()
        import runpy

        sys.argv = [module, *args]
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            code = _exit_code(e.code)
        except KeyboardInterrupt:
            code = 128 + signal.SIGINT
        except BaseException:
            traceback.print_exc()
        _shut_down_interpreter()
    finally:
        os._exit(code)


def _enter(cwd: str | None, python_path: str) -> None:
    """The directory and sys.path `python -m` started in `cwd` with this PYTHONPATH would have: sys.path[0] that
    directory, then PYTHONPATH's entries (ones the server's path lacks; its own stay, and a preloaded module stays
    the one the server imported)."""
    try:
        started_in: str | None = os.getcwd()
    except OSError:  # the server's directory was removed since it started
        started_in = None
    if cwd:
        os.chdir(cwd)
    if sys.path and sys.path[0] in (started_in, ""):
        sys.path[0] = os.getcwd()
    sys.path[1:1] = [p for p in dict.fromkeys(python_path.split(os.pathsep)) if p and p not in sys.path]


def _show_command_line(module: str, args: list[str]) -> None:
    """ps and /proc/PID/cmdline show `python -m module args`, as for a service started on its own, not the fork
    server's command line (without setproctitle installed they keep showing the server's)."""
    try:
        import setproctitle
    except ImportError:
        return
    setproctitle.setproctitle(" ".join([sys.executable, "-m", module, *args]))


def _shut_down_interpreter() -> None:
    """What the interpreter does at a normal exit before it is torn down: wait for non-daemon threads, run the
    atexit handlers, flush stdout and stderr (os._exit does none of them)."""
    import atexit
    import threading

    try:
        threading._shutdown()  # type: ignore[attr-defined]  # the interpreter's own exit step, as it runs it
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass


class Channel:
    """One launcher's requests and answers: the owner's stdin and stdout, or a connection on the --listen socket.
    Its children are the ones it asked for: only it may signal them, and only it hears of their exits."""

    def __init__(self, fd: int, sock: socket.socket | None = None):
        self.fd, self.sock = fd, sock
        self.pending = b""
        self.children: set[int] = set()
        self.open = True

    def answer(self, message: dict) -> None:
        if self.sock is None:
            _answer(message)
            return
        if self.open:
            try:
                self.sock.sendall((json.dumps(message) + "\n").encode())
            except OSError:
                self.open = False  # its launcher is gone: its reaper stops the children


class ForkServer:
    """The server's loop: reads requests, forks children, reports their exits. With `listen`, other launchers
    (`sluice run` started by a test, a second local run) connect on that unix socket and are served alike; the
    server lives as long as its owner's stdin."""

    def __init__(self, listen: str | None = None) -> None:
        self.owner = Channel(0)
        self.channels: dict[int, Channel] = {0: self.owner}
        self.by_pid: dict[int, Channel] = {}
        self.wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        os.set_blocking(self.wake_r, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # only to wake select through the wakeup fd
        self.listener: socket.socket | None = None
        if listen:
            self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.listener.bind(listen)
            os.chmod(listen, 0o600)  # whoever connects runs any module as this user
            self.listener.listen(16)
        self.selector = selectors.DefaultSelector()

    def serve(self) -> None:
        self.selector.register(0, selectors.EVENT_READ)
        self.selector.register(self.wake_r, selectors.EVENT_READ)
        if self.listener is not None:
            self.selector.register(self.listener.fileno(), selectors.EVENT_READ)
        while True:
            for key, _ in self.selector.select():
                if key.fd == self.wake_r:
                    while _drained(self.wake_r):
                        pass
                elif self.listener is not None and key.fd == self.listener.fileno():
                    self._accept()
                elif not self._read_requests(self.channels[key.fd]):
                    if key.fd == 0:
                        return
                    self._hang_up(self.channels[key.fd])
            self._reap()

    def _accept(self) -> None:
        assert self.listener is not None
        try:
            sock, _ = self.listener.accept()
        except OSError:
            return
        channel = Channel(sock.fileno(), sock)
        self.channels[channel.fd] = channel
        self.selector.register(channel.fd, selectors.EVENT_READ)
        channel.answer({"ready": os.getpid(), "env": import_env(os.environ)})  # what its children's must equal

    def _hang_up(self, channel: Channel) -> None:
        self.selector.unregister(channel.fd)
        del self.channels[channel.fd]
        channel.open = False
        assert channel.sock is not None
        channel.sock.close()

    def _read_requests(self, channel: Channel) -> bool:
        """Handles every complete line from `channel`; False at EOF."""
        try:
            data = os.read(channel.fd, 1 << 16)
        except OSError:
            data = b""
        if not data:
            return False
        channel.pending += data
        while b"\n" in channel.pending:
            line, channel.pending = channel.pending.split(b"\n", 1)
            if line.strip():
                self._handle(channel, line)
        return True

    def _handle(self, channel: Channel, line: bytes) -> None:
        try:
            request = json.loads(line)
            if not isinstance(request, dict):
                raise ValueError("a request is a JSON object")
        except ValueError as e:
            channel.answer({"error": f"bad request: {e}"})
            return
        if "signal" in request:
            pid, number = request["signal"], request.get("number")
            if isinstance(pid, int) and isinstance(number, int) and pid in channel.children:
                try:
                    os.kill(pid, number)
                except ProcessLookupError:
                    pass  # exited, not yet reaped: its exit is reported
            return
        self._spawn(channel, request)

    def _spawn(self, channel: Channel, request: dict) -> None:
        ident = request.get("spawn")
        try:
            module, args, env, log, cwd = _checked(request)
        except ValueError as e:
            channel.answer({"spawned": ident, "error": str(e)})
            return
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _run_child(module, args, env, log, cwd)
        channel.children.add(pid)
        self.by_pid[pid] = channel
        channel.answer({"spawned": ident, "pid": pid})

    def _reap(self) -> None:
        while self.by_pid:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            channel = self.by_pid.pop(pid, None)
            if channel is not None:
                channel.children.discard(pid)
                channel.answer({"exited": pid, "code": os.waitstatus_to_exitcode(status)})


def _drained(fd: int) -> bool:
    try:
        return bool(os.read(fd, 4096))
    except BlockingIOError:
        return False


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preload", default="", help="comma-separated modules imported before any fork")
    parser.add_argument(
        "--listen", default=None, help="also serve launchers that connect on this unix socket (in a private directory)"
    )
    opts = parser.parse_args(argv)
    server = ForkServer(opts.listen)  # listening first: a launcher that connects meanwhile waits in the backlog
    loaded = _preload([m for m in opts.preload.split(",") if m])
    _answer({"ready": os.getpid(), "preloaded": loaded})
    server.serve()
    # nothing to clean up (the children are the launcher's); tearing down torch and transformers took ~1.4 s, on
    # the way out of every local run
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
