"""A service's heap: frozen after start-up (no full collection walks the imports and the model), pauses measured.
services/runtime/heap.py."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap

from services.runtime import heap


def test_freeze_heap_does_nothing_outside_a_service():
    before = gc.get_freeze_count()
    assert heap.freeze_heap() == 0
    assert gc.get_freeze_count() == before


def test_a_service_process_freezes_what_it_loaded_and_measures_every_pause():
    code = textwrap.dedent("""
        import gc, json
        import torch  # a start-up's worth of objects
        from prometheus_client import generate_latest
        from services.runtime import heap
        first = heap.manage_service_heap()
        model = [torch.nn.Linear(4, 4) for _ in range(200)]  # loaded after the first freeze
        second = heap.freeze_heap()
        gc.collect()
        text = generate_latest().decode()
        pauses = sum(float(l.split()[-1]) for l in text.splitlines() if l.startswith("sluice_gc_pause_seconds_count"))
        frozen = [float(l.split()[-1]) for l in text.splitlines() if l.startswith("sluice_gc_frozen_objects ")]
        print(json.dumps({"first": first, "second": second, "pauses": pauses, "frozen": frozen,
                          "tracked": len(gc.get_objects())}))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    got = __import__("json").loads(out.stdout.strip().splitlines()[-1])
    assert got["first"] > 10_000  # torch's modules, now out of every collection's way
    assert got["second"] > got["first"]  # the model loaded afterwards, frozen by the second freeze
    assert got["frozen"] == [float(got["second"])]
    assert got["pauses"] >= 3  # the two freezes' collections and the explicit one, each measured
    assert got["tracked"] < got["second"] / 10  # what a full collection still walks
