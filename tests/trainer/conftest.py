"""Fixtures of the trainer's tests."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY


@pytest.fixture
def fresh_trainer_metrics():
    """An ActorTrainer registers its gauges with the process's Prometheus registry (once per process as a
    service): dropped around each test that asks, so a test may make one after another test made one."""

    def drop() -> None:
        for collector, names in list(REGISTRY._collector_to_names.items()):
            if any(name.startswith("sluice_trainer_") for name in names):
                REGISTRY.unregister(collector)

    drop()
    yield
    drop()
