"""The coordinator's one record of the weight version each engine holds (a real coordinator over a real Redis): an
engine says it as it registers, an ok sync report sets it for the engines it names, and nothing else moves it (no
heartbeat, no failed sync, no report naming an engine of another run or one that left); the engine set, the
topology and the run's status all read it."""

from __future__ import annotations

import pytest

from services.dcs.client import DCSClient, DCSError
from services.dcs.models import Heartbeat, NodeRegistration, RunConfig, SyncReport


def _run(client: DCSClient, name: str) -> None:
    client.create_run(
        RunConfig(
            name=name,
            model="/m",
            n_samples_per_prompt=2,
            rollout_batch_size=1,
            global_batch_size=2,
            micro_batch_size=2,
            rollout={"prompts": "demo:arith"},
        )
    )


def _engine(client: DCSClient, run: str, port: int, version: int | None):
    return client.register(
        NodeRegistration(role="engine", host="127.0.0.1", run_id=run, ports={"http": port}, weight_version=version)
    )


def _report(client: DCSClient, run: str, version: int, engines: list[str], ok: bool = True) -> None:
    client.report_sync(
        run,
        SyncReport(
            version=version,
            group="g",
            node_id="trainer",
            ok=ok,
            engines=engines,
            error=None if ok else "an engine did not answer",
        ),
    )


def _held(client: DCSClient, run: str) -> dict[str, int | None]:
    return {e.url: e.weight_version for e in client.engines(run).engines}


def _versions(client: DCSClient) -> dict[str, int | None]:
    return {n.node_id: n.weight_version for nodes in client.topology().roles.values() for n in nodes}


def test_an_engine_holds_its_registered_version_until_an_ok_sync_naming_it_records_the_next(client, uniq):
    run, other = uniq("run"), uniq("run")
    _run(client, run)
    _run(client, other)
    a, b = _engine(client, run, 32001, 0), _engine(client, run, 32002, 7)
    unsaid = _engine(client, run, 32003, None)  # registered by a client that did not say
    elsewhere = _engine(client, other, 32001, 2)
    assert (a.weight_version, b.weight_version, unsaid.weight_version) == (0, 7, None)
    assert _held(client, run) == {
        "http://127.0.0.1:32001": 0,
        "http://127.0.0.1:32002": 7,
        "http://127.0.0.1:32003": None,
    }

    _report(client, run, 8, [a.node_id, b.node_id, unsaid.node_id])
    assert _held(client, run) == {"http://127.0.0.1:32001": 8, "http://127.0.0.1:32002": 8, "http://127.0.0.1:32003": 8}
    _report(client, run, 9, [a.node_id], ok=False)  # a failed sync: nobody is known to hold 9
    _report(client, run, 9, [b.node_id, elsewhere.node_id])  # another run's engine is not this report's to set
    assert _held(client, run) == {"http://127.0.0.1:32001": 8, "http://127.0.0.1:32002": 9, "http://127.0.0.1:32003": 8}
    assert _held(client, other) == {"http://127.0.0.1:32001": 2}

    # everyone reads the same record: the topology, the run's status
    assert {n.node_id: n.weight_version for n in client.topology().roles["engine"] if n.run_id == run} == {
        a.node_id: 8,
        b.node_id: 9,
        unsaid.node_id: 8,
    }
    assert {s.node_id: s.weight_version for s in client.status(run).services} == {
        a.node_id: 8,
        b.node_id: 9,
        unsaid.node_id: 8,
    }


def test_heartbeats_carry_no_engine_version_and_a_node_that_left_is_not_brought_back(client, uniq):
    run = uniq("run")
    _run(client, run)
    engine = _engine(client, run, 32011, 3)
    with pytest.raises(DCSError) as err:
        client.heartbeat(engine.node_id, Heartbeat(weight_version=5))
    assert err.value.status == 409 and "not from heartbeats" in err.value.detail
    client.heartbeat(engine.node_id, Heartbeat(step=1))  # a heartbeat without one is fine, and changes nothing
    assert _versions(client)[engine.node_id] == 3

    forward = client.register(NodeRegistration(role="actor_fwd", host="127.0.0.1", run_id=run))
    client.heartbeat(forward.node_id, Heartbeat(weight_version=4))  # a forward role's receiver says its own
    assert _versions(client)[forward.node_id] == 4

    client.unregister(engine.node_id)
    _report(client, run, 6, [engine.node_id])  # a report landing after it left
    again = _engine(client, run, 32011, 0)  # the same engine, restarted: a new registration with its initial weights
    assert _held(client, run) == {"http://127.0.0.1:32011": 0}
    assert engine.node_id not in _versions(client) and _versions(client)[again.node_id] == 0


def test_only_an_engine_registers_a_weight_version(client, uniq):
    with pytest.raises(DCSError) as err:
        client.register(
            NodeRegistration.model_construct(
                role="actor_fwd",
                rank=0,
                host="h",
                ports={},
                device="cpu",
                parallel={},
                master_port=None,
                run_id=uniq("run"),
                weights_dtype=None,
                gpu=None,
                weight_version=2,
            )
        )
    assert err.value.status == 422 and "engines only" in str(err.value.detail)
    with pytest.raises(ValueError, match="engines only"):
        NodeRegistration(role="actor_fwd", host="h", weight_version=2)
