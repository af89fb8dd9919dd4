"""The rollout tests' fixtures: a tiny model, its tokenizer, and a prompt file of PROMPTS (row i has label i)."""

import json

import pytest
from transformers import AutoTokenizer

from services.model.init_model import init_model
from tests.engine.conftest import engine, start_engine, tiny_model_dir, tool_model  # noqa: F401 - fixtures shared with the engine's tests
from tests.rollout.rollout_harness import PROMPTS


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return init_model(str(tmp_path_factory.mktemp("tiny")), preset="tiny", arch="qwen2", seed=3)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "label": i}) + "\n" for i, p in enumerate(PROMPTS)))
    return str(path)
