"""`stack.engine: sglang`: `sluice run` starts `python -m sglang.launch_server` with the run's flags, the stack's
token as SGLang's api key in a 0600 `--config` file (never in argv, removed once the server is ready), waits
until the server generates and takes the token, and stops it with SIGTERM; without SGLang it refuses before
starting anything. Real SGLang needs GPUs: the server here is tests/launch/fake_sglang (SGLang 0.5.23's
launcher: its flags, config file and api-key check, in front of the stand-in of tests/dcs/sglang_receiver.py)."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys

import httpx
import pytest
import yaml

from services.cli import main as sluice
from services.front_door.run_file import RunFileError, parse_run_file
from services.launch.local_run import LocalRun
from services.launch.sglang_engine import SGLangProcess, _write_key
from services.launch.sglang_flags import gpu_argv, lora_argv
from services.run_contract.run_config import RunConfig
from services.runtime.processes import free_port

ROOT = pathlib.Path(__file__).resolve().parents[2]
FAKE = pathlib.Path(__file__).resolve().parent / "fake_sglang"
ENV = {"PYTHONPATH": os.pathsep.join([str(FAKE), str(ROOT)])}
TOKEN = "s3cret-" + "7f3a" * 4
# after SIGTERM: exit 0, or uvicorn's graceful shutdown then the signal raised again; not the SIGKILL at timeout
CLEAN_STOP = (0, -signal.SIGTERM)


def start(tmp_path, flags: tuple[str, ...], token: str = TOKEN, index: int = 1) -> tuple[SGLangProcess, int]:
    port = free_port()
    proc = SGLangProcess(
        f"engine-{index}", "/models/m", port, flags, index, token, str(tmp_path / f"engine-{index}.log"), env=ENV
    )
    return proc, port


def test_the_server_gets_the_runs_flags_and_the_key_only_from_a_private_file(tmp_path):
    proc, port = start(
        tmp_path, ("--dtype", "bfloat16", "--mem-fraction-static", "0.3", "--enable-memory-saver", "--tp-size", "2")
    )
    key_file = os.path.join(proc.key_dir, "api-key.yaml")
    try:
        proc.wait_until(proc.ready, 120)
        auth = {"Authorization": f"Bearer {TOKEN}"}
        seen = httpx.get(proc.url + "/fake_launch", headers=auth).json()
        assert seen["argv"] == [
            "--model-path",
            "/models/m",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dtype",
            "bfloat16",
            "--mem-fraction-static",
            "0.3",
            "--enable-memory-saver",
            "--tp-size",
            "2",
            "--base-gpu-id",
            "2",
            "--config",
            key_file,
        ]
        assert seen["config"] == {"path": key_file, "mode": "0o600", "dir_mode": "0o700"}
        args = seen["args"]
        assert (
            args["api_key"],
            args["dtype"],
            args["mem_fraction_static"],
            args["enable_memory_saver"],
            args["tp_size"],
            args["base_gpu_id"],
        ) == (TOKEN, "bfloat16", 0.3, True, 2, 2)
        assert not os.path.exists(key_file) and proc.key_dir is None  # read at start; gone once ready
        with open(f"/proc/{proc.proc.pid}/cmdline", "rb") as f:
            assert TOKEN.encode() not in f.read()
        assert httpx.get(proc.url + "/get_model_info").status_code == 401
        assert httpx.get(proc.url + "/get_model_info", headers=auth).json()["weight_version"] == "default"
        # the server logs its arguments, key included, as SGLang does: only this user may read the log
        assert os.stat(proc.log_path).st_mode & 0o777 == 0o600 and TOKEN in proc.log_tail()
    finally:
        code = proc.stop(timeout_s=20)
    assert code in CLEAN_STOP


def test_an_unknown_flag_stops_the_server_as_sglangs_argparse_does_and_the_key_file_goes(tmp_path):
    proc, _ = start(tmp_path, ("--no-such-flag", "1"), index=0)
    key_dir = proc.key_dir
    with pytest.raises(RuntimeError, match="unrecognized arguments: --no-such-flag 1"):
        proc.wait_until(proc.ready, 120)
    assert proc.stop() == 2
    assert not os.path.exists(key_dir)


def test_without_a_token_there_is_no_key_file_and_no_key(tmp_path):
    proc, port = start(tmp_path, (), token="", index=0)
    try:
        proc.wait_until(proc.ready, 120)
        seen = httpx.get(proc.url + "/fake_launch").json()
        assert seen["argv"][-2:] == ["--base-gpu-id", "0"] and seen["config"] is None
        assert seen["args"]["api_key"] is None
    finally:
        assert proc.stop(timeout_s=20) in CLEAN_STOP


@pytest.mark.parametrize("token", ["null", "yes", "1e5", "0x1F", "a: b", "~"])
def test_a_token_yaml_would_read_as_another_type_reaches_sglang_as_the_same_string(tmp_path, token):
    path = _write_key(str(tmp_path), token)
    with open(path) as f:
        assert yaml.safe_load(f) == {"api-key": token}  # as SGLang's config parser loads it


def test_a_token_starting_with_a_dash_is_refused_because_sglangs_parser_takes_it_for_a_flag(tmp_path, monkeypatch):
    config = tmp_path / "key.yaml"
    config.write_text(yaml.safe_dump({"api-key": "-abc"}))
    out = subprocess.run(
        [sys.executable, "-m", "sglang.launch_server", "--model-path", "m", "--config", str(config)],
        env={**os.environ, **ENV},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "--api-key: expected one argument" in out.stderr
    monkeypatch.syspath_prepend(str(FAKE))  # SGLang importable: only the token is wrong
    run = RunConfig(name="dash", model="/models/m")
    with pytest.raises(RuntimeError, match="starts with '-'"):
        LocalRun(run, log_dir=str(tmp_path / "logs"), token="-abc", engine="sglang")
    assert not (tmp_path / "logs").exists()  # refused before anything started


def test_sluice_run_without_sglang_refuses_before_starting_anything(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "sglang", None)  # not importable, whatever this Python has installed
    path = tmp_path / "run.yaml"
    path.write_text("name: r\nmodel: model\nstack:\n  engine: sglang\n  init_model: tiny\n")
    assert sluice(["run", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"sluice run: {path}:4:3: stack.engine: SGLang is not installed in this Python" in err
    assert 'pip install "sglang[all]==0.5.23"' in err and "or set stack.engine: builtin" in err
    assert not (tmp_path / "runs").exists()
    with pytest.raises(RuntimeError, match="engine sglang: SGLang is not installed"):
        LocalRun(RunConfig(name="r", model=str(tmp_path / "model")), log_dir=str(tmp_path / "logs"), engine="sglang")
    assert not (tmp_path / "logs").exists()


def test_the_run_files_sglang_flags_are_sglangs_and_the_stacks_own_are_refused():
    stack = "stack:\n  engine: sglang\n  engine_flags:\n"
    run_file = parse_run_file(
        f"name: r\nmodel: /m\n{stack}    dtype: bfloat16\n    mem_fraction_static: 0.3\n"
        "    enable_memory_saver: true\n    disable_cuda_graph: false\n"
    )
    assert run_file.engine_argv() == ("--dtype", "bfloat16", "--mem-fraction-static", "0.3", "--enable-memory-saver")
    for flag in ("api_key", "port", "model_path"):
        with pytest.raises(RunFileError) as exc:
            parse_run_file(f"name: r\nmodel: /m\n{stack}    {flag}: x\n")
        assert exc.value.problems == [
            f"run.yaml:5:3: stack.engine_flags: Value error, {flag!r} is set by "
            "`sluice run` on every SGLang server; the stack sets model_path, model, "
            "host, port, api_key, admin_api_key, config"
        ]
    with pytest.raises(RunFileError, match="'enable_memory_saver' is not an engine flag"):
        parse_run_file("name: r\nmodel: /m\nstack:\n  engine_flags:\n    enable_memory_saver: true\n")
    with pytest.raises(RunFileError, match="stack.engine: Input should be 'builtin' or 'sglang'"):
        parse_run_file("name: r\nmodel: /m\nstack:\n  engine: vllm\n")


def test_a_lora_runs_servers_get_sglangs_lora_flags_and_target_modules_sglang_cannot_serve_are_refused(
    tmp_path, monkeypatch
):
    assert lora_argv(("--dtype", "bfloat16"), 8, ["q_proj", "v_proj"]) == (
        "--dtype",
        "bfloat16",
        "--enable-lora",
        "--max-lora-rank",
        "8",
        "--lora-target-modules",
        "q_proj",
        "v_proj",
    )
    assert lora_argv(("--enable-lora", "--max-lora-rank", "16"), 8, ["q_proj"]) == (  # the run file's own win
        "--enable-lora",
        "--max-lora-rank",
        "16",
        "--lora-target-modules",
        "q_proj",
    )
    lora = "trainer:\n  lora:\n    rank: 4\n"
    assert parse_run_file(f"name: r\nmodel: /m\n{lora}stack:\n  engine: sglang\n").trainer.lora.rank == 4
    with pytest.raises(
        RunFileError,
        match=r"stack.engine sglang: trainer.lora.target_modules \['c_attn'\] are not "
        "modules SGLang 0.5.23 applies LoRA adapters to",
    ):
        parse_run_file(f"name: r\nmodel: /m\n{lora}    target_modules: [q_proj, c_attn]\nstack:\n  engine: sglang\n")
    monkeypatch.syspath_prepend(str(FAKE))  # SGLang importable: only the target modules are wrong
    run = RunConfig(name="r", model="/m", trainer={"lora": {"target_modules": ["c_attn"]}})
    with pytest.raises(RuntimeError, match=r"engine sglang: trainer.lora.target_modules \['c_attn'\]"):
        LocalRun(run, log_dir=str(tmp_path / "logs"), engine="sglang")
    assert not (tmp_path / "logs").exists()  # refused before anything started


def test_servers_side_by_side_each_take_their_own_gpus():
    assert gpu_argv([], 0) == ["--base-gpu-id", "0"]
    assert gpu_argv(["--dtype", "bfloat16"], 3) == ["--dtype", "bfloat16", "--base-gpu-id", "3"]
    assert gpu_argv(["--base-gpu-id", "1", "--tp-size", "2"], 2) == ["--tp-size", "2", "--base-gpu-id", "5"]
    assert gpu_argv(["--tensor-parallel-size", "4"], 1) == ["--tensor-parallel-size", "4", "--base-gpu-id", "4"]


@pytest.mark.slow
def test_a_local_run_starts_sglang_servers_with_the_stacks_token_and_restarts_them(tmp_path, monkeypatch):
    from services.model.init_model import init_model

    monkeypatch.syspath_prepend(str(FAKE))  # where `sluice run` looks for SGLang: this Python
    run = RunConfig(name="sgl", model=init_model(str(tmp_path / "model"), preset="tiny"))
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with LocalRun(
        run,
        log_dir=str(tmp_path / "logs"),
        token=TOKEN,
        engine="sglang",
        engines=2,
        engine_args=("--dtype", "bfloat16"),
        python_path=(str(FAKE), str(ROOT)),
        submit=False,
    ) as lr:
        assert lr.role_argv["rollout"][:2] == ["rollout", "--engine-url"]
        assert lr.role_argv["rollout"][2] == ",".join(lr.engine_urls)
        for i, url in enumerate(lr.engine_urls):
            args = httpx.get(url + "/fake_launch", headers=auth).json()["args"]
            assert (args["model_path"], args["api_key"], args["dtype"], args["base_gpu_id"]) == (
                run.model,
                TOKEN,
                "bfloat16",
                i,
            )
            assert lr.procs[f"engine-{i}"].key_dir is None
        first = lr.procs["engine-1"]
        lr.restart("engine-1")  # as the supervisor does: a new key file, the same port
        assert lr.procs["engine-1"] is not first and lr.procs["engine-1"].key_dir is None
        assert httpx.get(lr.engine_urls[1] + "/fake_launch", headers=auth).json()["args"]["api_key"] == TOKEN
        engines = [lr.procs["engine-0"], lr.procs["engine-1"]]
    assert all(proc.returncode in CLEAN_STOP for proc in engines)
