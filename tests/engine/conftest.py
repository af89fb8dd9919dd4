from __future__ import annotations

import os

import pytest
import torch

from services.model.chat_format import render_chat, turn_end_ids
from services.model.init_model import init_model
from services.model.loading import load_causal_lm
from services.runtime.auth_token import token_env
from services.runtime.processes import ChildProcess, free_port, http_ok, sluice_argv
from tests.worker_fork_server import worker_fork_server


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return init_model(str(tmp_path_factory.mktemp("tiny-qwen2")), preset="tiny", arch="qwen2", seed=7)


def start_engine(
    model_dir: str, log_dir, *args: str, token: str = "", open_weight_updates: bool = True
) -> tuple[ChildProcess, str]:
    """An engine process with `token` (in its environment); without one, its weight updates are open unless
    `open_weight_updates` is False (tests of weight sync run without a token)."""
    port = free_port()
    if not token and open_weight_updates:
        args = ("--allow-unauthenticated-weight-updates", *args)
    proc = ChildProcess(
        "engine",
        sluice_argv("engine", "--model", model_dir, "--host", "127.0.0.1", "--port", str(port), *args),
        os.path.join(str(log_dir), f"engine-{port}.log"),
        env={"HF_HUB_OFFLINE": "1", **token_env(token)},
        forker=worker_fork_server(),
    )
    url = f"http://127.0.0.1:{port}"
    proc.wait_until(lambda: http_ok(url + "/health"), 90)
    return proc, url


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory):
    proc, url = start_engine(tiny_model_dir, tmp_path_factory.mktemp("engine"))
    yield url
    proc.stop()


QUESTION = [{"role": "user", "content": "What is 2 + 3?"}]
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "a + b",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
    },
}
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


def teach_tool_call(model, tok, model_dir: str, call: str) -> None:
    """Overfit `model` to answer QUESTION (with the ADD tool offered) by `call` and the end of its turn, in a few
    seconds of supervised steps, and save it to `model_dir`."""
    torch.manual_seed(0)
    prompt = render_chat(tok, QUESTION, [ADD])
    ids = torch.tensor([prompt + tok.encode(call, add_special_tokens=False) + turn_end_ids(tok)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(400):
        loss = torch.nn.functional.cross_entropy(model(ids).logits[0, len(prompt) - 1 : -1], ids[0, len(prompt) :])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if loss.item() < 0.005:
            break
    model.save_pretrained(model_dir)


@pytest.fixture(scope="session")  # ~14 s to teach: once per worker (and per conftest that names it)
def tool_model(tmp_path_factory):
    """The tiny model, overfit to answer QUESTION (with the ADD tool offered) by CALL and the end of its turn."""
    torch.manual_seed(0)
    model_dir = init_model(str(tmp_path_factory.mktemp("tool-model")), preset="tiny", arch="qwen2", seed=7)
    model, tok = load_causal_lm(model_dir)
    teach_tool_call(model, tok, model_dir, CALL)
    return model_dir, tok
