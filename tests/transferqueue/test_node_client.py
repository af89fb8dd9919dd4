"""A second language through protobuf: the Node.js client (services/transferqueue/client/node, grpc-js
with stubs loaded from proto/ at runtime) against a real controller and shards, cross-checked both ways
with the Python client. Values cross the process boundary as JSON only."""

from __future__ import annotations

import json
import shutil

import grpc
import pytest
import torch

from services.runtime.auth_token import token_env
from services.transferqueue.client.queue import TransferQueue
from services.transferqueue.local_stack import LocalTransferQueue
from services.transferqueue.pb import transferqueue_pb2 as pb
from tests.node_package import cli, run_node

pytestmark = [
    pytest.mark.slow,  # every case starts Node processes (about a second each)
    pytest.mark.skipif(shutil.which("node") is None, reason="node is not on PATH: the Node.js client cannot run"),
]


def test_node_roundtrip_put_claim_get_ack(node_client, tq_stack, tq, uniq):
    p, task = uniq("node_p"), uniq("node_t")
    out = run_node(
        node_client, "roundtrip.mjs", "--controller", tq_stack.controller_address, "--partition", p, "--task", task
    )
    expected = {"id": [10, 11, 12], "score": [0.5, -1.25, 3.0], "logprobs": [[-0.5, -1.5], [], [-0.25, -2.0, -4.0]]}
    assert out["put"] == [0, 1, 2] and out["acked"] == 3
    for read in (out["claimed"], out["get"]):
        assert read["rows"] == [0, 1, 2]
        assert read["columns"] == expected
        assert read["schema"] == {
            "id": {"dtype": "int64", "kind": "SCALAR", "shape": []},
            "score": {"dtype": "float32", "kind": "SCALAR", "shape": []},
            "logprobs": {"dtype": "float32", "kind": "RAGGED", "shape": []},
        }
    assert out["claimed"]["leaseId"]
    # the controller saw the Node client's ack: everything consumed, nothing left to claim
    assert [(t.task, t.ready, t.consumed, t.leased) for t in tq.partition(p).tasks if t.task == task] == [
        (task, 3, 3, 0)
    ]
    assert tq.claim(p, task, 3).rows == []
    # and the Python client reads the Node client's rows with the declared dtypes
    batch = tq.get(p, [2, 0], ["id", "score", "logprobs"])
    assert batch["id"].dtype == torch.int64 and batch["id"].tolist() == [12, 10]
    assert batch["score"].dtype == torch.float32 and batch["score"].tolist() == [3.0, 0.5]
    assert [t.dtype for t in batch["logprobs"]] == [torch.float32, torch.float32]
    assert [t.tolist() for t in batch["logprobs"]] == [[-0.25, -2.0, -4.0], [-0.5, -1.5]]


def test_python_reads_what_node_put(node_client, tq_stack, tq, uniq):
    p = uniq("node_p")
    tq.create_partition(p, placement_block=2)  # 5 rows over both shards
    columns = {
        "i64": {"dtype": "int64", "values": [0, -1, 2**40, 3, 4]},
        "i32": {"dtype": "int32", "values": [1, -2, 3, 4, 5]},
        "f32": {"dtype": "float32", "values": [0.5, 1.0, -2.25, 3.0, 4.5]},
        "tokens": [[1, 2], [3], [], [4], [5, 6, 7]],  # plain integers: int64, as numpy infers them
        "lp": {"dtype": "float32", "ragged": [[0.5], [], [1.5, 2.5], [-1.0, -2.0, -3.0], [7.0]]},
        "text": ["a", "bc", "", "d", "é"],
        "flag": [True, False, True, True, False],
        "grid": {"dtype": "float64", "shape": [2, 2], "values": list(range(20))},
    }
    out = cli(node_client, "put", tq_stack.controller_address, "--partition", p, "--columns", json.dumps(columns))
    assert out["rows"] == [0, 1, 2, 3, 4]
    schema = {f.name: (f.dtype, pb.FieldKind.Name(f.kind), list(f.shape)) for f in tq.schema(p)}
    assert schema == {
        "i64": ("int64", "SCALAR", []),
        "i32": ("int32", "SCALAR", []),
        "f32": ("float32", "SCALAR", []),
        "tokens": ("int64", "RAGGED", []),
        "lp": ("float32", "RAGGED", []),
        "text": ("string", "STRING", []),
        "flag": ("bool", "SCALAR", []),
        "grid": ("float64", "TENSOR", [2, 2]),
    }
    order = [4, 1, 3, 0, 2]
    batch = tq.get(p, order, list(columns))
    assert batch["i64"].dtype == torch.int64 and batch["i64"].tolist() == [4, -1, 3, 0, 2**40]
    assert batch["i32"].dtype == torch.int32 and batch["i32"].tolist() == [5, -2, 4, 1, 3]
    assert batch["f32"].dtype == torch.float32 and batch["f32"].tolist() == [4.5, 1.0, 3.0, 0.5, -2.25]
    assert [t.dtype for t in batch["tokens"]] == [torch.int64] * 5
    assert [t.tolist() for t in batch["tokens"]] == [[5, 6, 7], [3], [4], [1, 2], []]
    assert [t.tolist() for t in batch["lp"]] == [[7.0], [], [-1.0, -2.0, -3.0], [0.5], [1.5, 2.5]]
    assert batch["text"] == ["é", "bc", "d", "a", ""]
    assert batch["flag"].dtype == torch.bool and batch["flag"].tolist() == [False, False, True, True, True]
    assert batch["grid"].dtype == torch.float64 and batch["grid"].shape == (5, 2, 2)
    assert batch["grid"][0].flatten().tolist() == [16.0, 17.0, 18.0, 19.0]
    # the same fields written by Python into the same partition: one read spans both writers' chunks,
    # which the shard concatenates, so the Node client's Arrow types must equal pyarrow's exactly
    more = tq.put(
        p,
        {
            "i64": torch.arange(5, 7),
            "i32": torch.zeros(2, dtype=torch.int32),
            "f32": torch.ones(2),
            "tokens": [torch.arange(3), torch.arange(0)],
            "lp": [torch.ones(1), torch.ones(2)],
            "text": ["x", "y"],
            "flag": torch.ones(2, dtype=torch.bool),
            "grid": torch.ones(2, 2, 2, dtype=torch.float64),
        },
    )
    mixed = tq.get(p, [more[1], 1, more[0], 0], list(columns))
    assert mixed["i64"].tolist() == [6, -1, 5, 0]
    assert [t.tolist() for t in mixed["tokens"]] == [[], [3], [0, 1, 2], [1, 2]]
    assert [t.tolist() for t in mixed["lp"]] == [[1.0, 1.0], [], [1.0], [0.5]]
    assert mixed["text"] == ["y", "bc", "x", "a"]
    assert mixed["grid"][:, 0, 0].tolist() == [1.0, 4.0, 1.0, 0.0]


def test_node_claims_what_python_put(node_client, tq_stack, tq, uniq):
    p, task = uniq("node_p"), uniq("node_t")
    tq.create_partition(p, group_size=2, placement_block=2)  # 6 rows over both shards
    tq.register_task(task, ["ids", "logp"], group_size=2)
    rows = tq.put(
        p,
        {
            "ids": [torch.arange(k + 1) for k in range(6)],
            "logp": [torch.full((k,), -0.5) for k in range(6)],
            "reward": torch.tensor([0.0, 1.0, 0.5, 0.25, -1.0, 2.0]),
            "step": torch.arange(100, 106, dtype=torch.int32),
            "uid": torch.arange(6) * 2**33,
            "half": torch.tensor([0.5, 1.5, -2.0, 3.0, 0.25, 1.0], dtype=torch.float16),
            "bf16": torch.tensor([0.5, 1.5, -2.0, 3.0, 0.25, 1.0], dtype=torch.bfloat16),
            "emb": torch.arange(24, dtype=torch.float32).reshape(6, 2, 2),
            "prompt": ["p0", "p1", "p2", "p3", "p4", "p5"],
            "done": torch.tensor([True, False, True, False, True, False]),
        },
    )
    out = cli(
        node_client,
        "claim",
        tq_stack.controller_address,
        "--partition",
        p,
        "--task",
        task,
        "--batch-size",
        "4",
        "--wait-s",
        "5",
        "--ack",
    )
    assert out["rows"] == rows[:4] and out["acked"] == 4
    assert out["columns"] == {
        "ids": [[0], [0, 1], [0, 1, 2], [0, 1, 2, 3]],
        "logp": [[], [-0.5], [-0.5, -0.5], [-0.5, -0.5, -0.5]],
    }
    assert out["schema"] == {
        "ids": {"dtype": "int64", "kind": "RAGGED", "shape": []},
        "logp": {"dtype": "float32", "kind": "RAGGED", "shape": []},
    }
    # the rest (whole group of 2) with every column, read in a shuffled order through get
    fields = ["reward", "step", "uid", "half", "bf16", "emb", "prompt", "done", "ids"]
    got = cli(
        node_client,
        "get",
        tq_stack.controller_address,
        "--partition",
        p,
        "--rows",
        json.dumps([5, 0, 3]),
        "--fields",
        json.dumps(fields),
    )
    c, s = got["columns"], got["schema"]
    assert c["reward"] == [2.0, 0.0, 0.25] and s["reward"]["dtype"] == "float32"
    assert c["step"] == [105, 100, 103] and s["step"]["dtype"] == "int32"
    assert c["uid"] == [5 * 2**33, 0, 3 * 2**33] and s["uid"]["dtype"] == "int64"
    assert c["half"] == [1.0, 0.5, 3.0] and s["half"]["dtype"] == "float16"
    assert c["bf16"] == [1.0, 0.5, 3.0] and s["bf16"]["dtype"] == "bfloat16"
    assert c["emb"] == {"shape": [3, 2, 2], "data": [20, 21, 22, 23, 0, 1, 2, 3, 12, 13, 14, 15]}
    assert s["emb"] == {"dtype": "float32", "kind": "TENSOR", "shape": [2, 2]}
    assert c["prompt"] == ["p5", "p0", "p3"] and s["prompt"]["kind"] == "STRING"
    assert c["done"] == [False, True, False]
    assert c["ids"] == [[0, 1, 2, 3, 4, 5], [0], [0, 1, 2, 3]]
    # the Node client's ack is what Python sees: only the last group is left for the task
    assert tq.claim(p, task, 6).rows == rows[4:]


def test_node_client_surfaces_grpc_errors(node_client, tq_stack, tq, uniq):
    missing, task = uniq("node_missing"), uniq("node_t")
    tq.register_task(task, ["x"])
    out = cli(node_client, "claim", tq_stack.controller_address, "--partition", missing, "--task", task, expect_rc=3)[
        "error"
    ]
    assert out["codeName"] == "NOT_FOUND" and out["code"] == grpc.StatusCode.NOT_FOUND.value[0]
    assert missing in out["details"]
    # a schema conflict with what Python committed is refused by the controller
    p = uniq("node_p")
    tq.create_partition(p)
    tq.put(p, {"x": torch.arange(2)})
    out = cli(
        node_client,
        "put",
        tq_stack.controller_address,
        "--partition",
        p,
        "--columns",
        json.dumps({"x": {"dtype": "float32", "values": [1.0]}}),
        expect_rc=3,
    )["error"]
    assert out["codeName"] == "INVALID_ARGUMENT" and "x" in out["details"]
    # a bad column is refused by the client before anything is sent
    out = cli(
        node_client,
        "put",
        tq_stack.controller_address,
        "--partition",
        p,
        "--columns",
        json.dumps({"x": {"dtype": "int64", "values": [1.5]}}),
        expect_rc=3,
    )["error"]
    assert out["codeName"] == "INVALID_ARGUMENT" and "not an integer" in out["details"]
    assert tq.partition(p).allocated_rows == 2


def test_node_client_sends_the_bearer_token(node_client, tmp_path, uniq):
    with LocalTransferQueue(shards=1, token="s3cret", log_dir=str(tmp_path)) as stack:
        p = uniq("node_p")
        columns = json.dumps({"x": {"dtype": "int64", "values": [7, 8]}})
        token_file = tmp_path / "token"
        token_file.write_text("s3cret\n")
        for env in (token_env(""), token_env("wrong")):
            out = cli(
                node_client,
                "put",
                stack.controller_address,
                "--partition",
                p,
                "--create",
                "--columns",
                columns,
                env=env,
                expect_rc=3,
            )["error"]
            assert out["codeName"] == "UNAUTHENTICATED"
        # the token as the services read it: env SLUICE_AUTH_TOKEN_FILE (wins), or env SLUICE_AUTH_TOKEN
        assert cli(
            node_client,
            "put",
            stack.controller_address,
            "--partition",
            p,
            "--create",
            "--columns",
            columns,
            env={"SLUICE_AUTH_TOKEN_FILE": str(token_file), "SLUICE_AUTH_TOKEN": "wrong"},
        )["rows"] == [0, 1]
        assert cli(
            node_client,
            "put",
            stack.controller_address,
            "--partition",
            p,
            "--columns",
            columns,
            env=token_env("s3cret"),
        )["rows"] == [2, 3]
        # a token file that cannot be read is a clear error, not an unauthenticated call
        out = cli(
            node_client,
            "put",
            stack.controller_address,
            "--partition",
            p,
            "--columns",
            columns,
            env={"SLUICE_AUTH_TOKEN_FILE": str(tmp_path / "missing")},
            expect_rc=3,
        )["error"]
        assert out["codeName"] == "INVALID_ARGUMENT" and "SLUICE_AUTH_TOKEN_FILE" in out["details"]
        with TransferQueue(stack.controller_address, token="s3cret") as tq:
            assert tq.get(p, [0, 1, 2, 3], ["x"])["x"].tolist() == [7, 8, 7, 8]
