"""What a stack's start costs, and what keeps it short (services/runtime/startup.py, poll_backoff.py): a service logs
when its process began and what its imports took; imports run without the cyclic collector; a role waiting for
its run looks again soon, then less often; `sluice run`'s own checks import neither torch nor transformers."""

from __future__ import annotations

import asyncio
import gc
import itertools
import json
import subprocess
import sys
import textwrap
import time

import pytest

from services.dcs.client import DCSClient
from services.dcs.local import LocalDCS
from services.dcs.models import RunConfig
from services.role import run_watch
from services.runtime.poll_backoff import poll_intervals
from services.runtime.startup import imports_uncollected


def test_poll_intervals_start_short_and_grow_by_half_up_to_the_most():
    assert list(itertools.islice(poll_intervals(0.2), 6)) == pytest.approx([0.05, 0.075, 0.1125, 0.16875, 0.2, 0.2])
    assert list(itertools.islice(poll_intervals(0.01), 3)) == [0.01, 0.01, 0.01]  # never longer than asked


def test_imports_run_without_the_collector_and_leave_it_as_they_found_it():
    assert gc.isenabled()
    with pytest.raises(ImportError):
        with imports_uncollected():
            assert not gc.isenabled()
            import services.no_such_module  # noqa: F401  (a failing import restores it too)
    assert gc.isenabled()
    gc.disable()
    try:
        with imports_uncollected():
            pass
        assert not gc.isenabled()  # a caller's own choice is kept
    finally:
        gc.enable()


def test_a_role_waiting_for_its_run_looks_again_soon_then_less_often(dcs, client, uniq, monkeypatch):
    name = uniq("late")
    waited: list[float] = []

    def intervals(poll_s: float):  # the run is submitted after the role's fourth look
        for seconds in poll_intervals(poll_s):
            waited.append(seconds)
            if len(waited) == 4:
                client.create_run(RunConfig(name=name, model="/nowhere/model"))
            yield seconds

    monkeypatch.setattr(run_watch, "poll_intervals", intervals)
    with DCSClient(dcs.url) as role_client:
        run = asyncio.run(run_watch.RunWatch(role_client, name, "advantage", poll_s=1.0).wait_for_run(asyncio.Event()))
    assert run.config.name == name
    assert waited == pytest.approx([0.05, 0.075, 0.1125, 0.16875])


def test_a_service_logs_when_its_process_began_and_what_its_imports_took(tmp_path):
    before = time.time()
    with LocalDCS(log_dir=str(tmp_path)) as dcs:
        pid = dcs.proc.proc.pid
    with open(tmp_path / "dcs.log") as f:
        start = next(e for e in map(json.loads, f) if e["msg"] == "service starting")
    assert start["command"] == "dcs" and start["pid"] == pid
    # its process began after we started it (to the kernel's 10 ms clock tick) and before it wrote the line
    assert before - 0.02 <= start["started_at"] <= start["ts"]
    assert start["import_s"] == pytest.approx(start["ts"] - start["started_at"], abs=0.01)
    assert 0 < start["import_cpu_s"] <= start["import_s"] + 0.01  # one thread imports


def test_sluice_runs_checks_of_a_run_import_neither_torch_nor_transformers(tmp_path):
    model = tmp_path / "model"
    subprocess.run(
        [sys.executable, "-m", "services.cli", "init-model", str(model), "--preset", "tiny"],
        check=True,
        capture_output=True,
        timeout=300,
    )
    code = textwrap.dedent(f"""
        import json, sys
        from services.front_door.supervisor import main  # what `sluice run` imports
        from services.front_door.run_preparation import preflight
        from services.front_door.run_file import RunFile
        problems = preflight(RunFile(name="r", model={str(model)!r}))
        print(json.dumps({{"problems": [str(p) for p in problems],
                          "loaded": [m for m in ("torch", "transformers") if m in sys.modules]}}))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"problems": [], "loaded": []}
    (model / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "Nonsense"}}')
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(got["problems"]) == 1 and "the tokenizer does not load" in got["problems"][0]
