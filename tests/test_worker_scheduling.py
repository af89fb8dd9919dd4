"""./dev test's scheduling (tests/worker_scheduling.py): a module marked one_worker is one unit of work, any other
test its own."""

from __future__ import annotations

import pathlib

from tests.worker_scheduling import OneWorkerModules

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _scheduler() -> OneWorkerModules:
    scheduler = object.__new__(OneWorkerModules)  # only the scope rule is under test, not xdist's wiring
    scheduler._root, scheduler._marked = ROOT, {}
    return scheduler


def test_a_marked_modules_tests_share_one_scope_and_others_stay_alone():
    scheduler = _scheduler()
    marked = "tests/engine/test_engine.py"
    assert "pytest.mark.one_worker" in (ROOT / marked).read_text()
    assert scheduler._split_scope(f"{marked}::test_a") == scheduler._split_scope(f"{marked}::test_b[x]") == marked
    alone = "tests/test_demo_check.py::test_a_finished_run_passes_only_with_every_step_trained"
    assert scheduler._split_scope(alone) == alone


def test_a_node_id_that_is_no_file_is_its_own_scope():
    assert _scheduler()._split_scope("tests/gone.py::test_x") == "tests/gone.py::test_x"
