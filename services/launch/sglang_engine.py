"""One real SGLang server as `sluice run` starts it (`stack.engine: sglang`): `python -m sglang.launch_server`
with the flags of services/launch/sglang_flags.py, ready once it generates and takes the stack's token.

The token is never on the command line (every user of the machine can read argv in the process list), and
SGLang 0.5.23 reads its api key from no environment variable. It does read a `--config` YAML file, merged into
its arguments in the server process before anything else (sglang/srt/utils/server_args_config_parser.py), so
the key goes there: a file of mode 0600 in a directory of mode 0700, removed once the server is ready (it has
read it by then), or when the server is stopped. SGLang logs its server arguments, the key among them, when it
starts: the server's log file is made 0600 before SGLang writes to it."""

from __future__ import annotations

import os
import shutil
import tempfile

import urllib.error
import urllib.request

import yaml

from services.launch.sglang_flags import server_argv
from services.runtime.processes import ChildProcess

START_S = 600.0  # loading a large model and capturing CUDA graphs, until the server generates
PROBE_S = 30.0  # one readiness probe: /health_generate generates a token (SGLang's own limit on it is 20 s)


class SGLangProcess(ChildProcess):
    """The index-th SGLang server of a run, on 127.0.0.1:port; `ready()` is its readiness probe."""

    def __init__(
        self,
        name: str,
        model: str,
        port: int,
        flags: tuple[str, ...],
        index: int,
        token: str,
        log_path: str,
        env: dict[str, str] | None = None,
    ):
        self.url = f"http://127.0.0.1:{port}"
        self.token = token
        self.key_dir = tempfile.mkdtemp(prefix="sluice-sglang-") if token else None
        try:
            config = _write_key(self.key_dir, token) if self.key_dir else None  # made just above when there is a token
            _private_file(log_path)
            super().__init__(name, server_argv(model, port, flags, index, config), log_path, env=env)
        except BaseException:
            self.drop_key()
            raise

    def ready(self) -> bool:
        """It generates (`/health_generate`: one token, 503 while it starts; never behind the key) and it
        takes the stack's token (`/get_model_info`). A server that refuses the token fails the start at once."""
        if _status(self.url + "/health_generate") != 200:
            return False
        status = _status(self.url + "/get_model_info", self.token)
        if status in (401, 403):
            raise RuntimeError(
                f"{self.name}: the SGLang server at {self.url} refused the stack's token "
                f"(HTTP {status}): it did not take the api key from its --config file"
            )
        if status == 200:
            self.drop_key()  # read at start, before the server listened: not needed any more
        return status == 200

    def drop_key(self) -> None:
        if self.key_dir is not None:
            shutil.rmtree(self.key_dir, ignore_errors=True)
            self.key_dir = None

    def finish(self, deadline: float) -> int | None:
        try:
            return super().finish(deadline)
        finally:
            self.drop_key()

    def kill(self) -> None:
        try:
            super().kill()
        finally:
            self.drop_key()


def _status(url: str, token: str = "") -> int | None:
    """The HTTP status of a GET (None: no answer). urllib, not httpx: a probe repeated for minutes while a
    model loads should not build an SSL context each time."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=PROBE_S) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, OSError):
        return None


def _write_key(directory: str, token: str) -> str:
    """SGLang's config file holding only the api key, readable by this user alone (SGLang needs `.yaml`).
    The key is spelt as the flag (`api-key`): SGLang makes each key `--<key>` as written, and its parser knows
    no `--api_key`. safe_dump quotes a token YAML would read as another type (`null`, `yes`, `1e5`)."""
    path = os.path.join(directory, "api-key.yaml")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(yaml.safe_dump({"api-key": token}))
    return path


def _private_file(path: str) -> None:
    """Create `path` (or keep it, appended to) with mode 0600."""
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600))
    os.chmod(path, 0o600)  # a log left by an earlier start keeps its mode otherwise
