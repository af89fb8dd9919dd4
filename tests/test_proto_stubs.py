"""proto/ is the contract: the committed Python stubs must be exactly what protoc makes of it."""

from __future__ import annotations

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_committed_stubs_match_proto(tmp_path):
    spec = importlib.util.spec_from_file_location("generate", ROOT / "proto" / "generate.py")
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    written = generate.generate(tmp_path)
    assert written
    stale = []
    for path in written:
        committed = ROOT / path.relative_to(tmp_path)
        if not committed.exists() or committed.read_bytes() != path.read_bytes():
            stale.append(str(committed.relative_to(ROOT)))
    assert stale == [], f"stale generated stubs (run `python proto/generate.py`): {stale}"
