"""Agent rollouts through the real rollout role and a real engine: a scripted agent (tests/rollout/
scripted_agent.py) plays each sample's episode with the plain `openai` client against the rollout's per-episode
endpoint, served over HTTP; the data plane, ledger and trainer progress are in-memory fakes. The engine's model
is the tiny Qwen2 taught to call the `add` tool for the question (tests/engine/test_openai_routes.py), so the
tool call is the model's own. Sampling is greedy (a temperature under the engine's greedy threshold) so each
episode is the same every time."""

from __future__ import annotations

import asyncio
import http.server
import json
import threading

import openai
import pytest
import torch

from services.model.chat_format import render_chat
from services.model.loading import load_causal_lm
from services.rollout.config import RolloutConfig
from services.rollout.service import RolloutService
from services.run_contract.partitions import partition_name
from services.run_contract.run_config import RunConfig
from services.run_state.trainer_progress import TrainerProgress
from services.runtime.http_service import serve_http
from services.runtime.processes import free_port
from services.role.role_service import RoleStatus, build_status_app
from tests.engine.conftest import QUESTION, start_engine
from tests.fakes import FakeRunSession, InMemoryDataPlane, InMemoryLedger, ProgressBox
from tests.rollout import scripted_agent

pytestmark = [pytest.mark.timeout(300), pytest.mark.one_worker]
TOKEN = "agent-test-token"
N = 2


class Environment(http.server.ThreadingHTTPServer):
    """The scripted agent behind HTTP, as an environment service in any language would be: each POST is one
    episode ({"sample", "base_url", "api_key"} -> {"reward"})."""

    def __init__(self):
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                with openai.OpenAI(base_url=body["base_url"], api_key=body["api_key"], max_retries=0) as client:
                    reward = scripted_agent.agent(body["sample"], client)
                answer = json.dumps({"reward": reward}).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args):
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/episode"


def run_rollout(
    model_dir: str, prompts: str, engine_url: str, agent: str, num_steps: int = 2, chains: int = 1
) -> InMemoryDataPlane:
    run = RunConfig(
        name="r",
        model=model_dir,
        n_samples_per_prompt=N,
        rollout_batch_size=1,
        global_batch_size=N * chains,
        micro_batch_size=N,
        num_steps=num_steps,
        max_staleness=8,
        rollout={"prompts": prompts, "agent": agent, "temperature": 1e-7, "agent_max_turns": 4, "agent_chains": chains},
    )
    plane, ledger, progress = InMemoryDataPlane(), InMemoryLedger(), ProgressBox()

    session = FakeRunSession(run, plane, progress=progress, ledger=ledger)
    config = RolloutConfig(
        run_id="default",
        engine_url=engine_url,
        register_engines=False,
        version_poll_s=0.01,
        host="127.0.0.1",
        port=free_port(),
    )
    config._auth_token = TOKEN  # the stack's token, as SLUICE_AUTH_TOKEN would give it
    status = RoleStatus("rollout")
    service = RolloutService(config, status)

    async def trainer():
        for step in range(run.num_steps):
            while not (p := plane.partitions.get(partition_name("r", step))) or not p.sealed:
                await asyncio.sleep(0.01)
            progress.value = TrainerProgress(next_step=step + 1, version=0)

    async def main():
        http_stop = asyncio.Event()
        app = build_status_app(status, TOKEN, [service.episodes.router()])
        http = asyncio.create_task(serve_http(app, "127.0.0.1", config.port, http_stop))
        try:
            await asyncio.wait_for(asyncio.gather(service.run_loop(session, asyncio.Event()), trainer()), 240)
        finally:
            http_stop.set()
            await http

    asyncio.run(main())
    return plane


@pytest.fixture(scope="module", params=["python", "environment"])
def episodes(request, tool_model, tmp_path_factory):
    """The rollout's rows and the agent's calls, the agent a Python function in the rollout, or the same code
    behind an HTTP environment service."""
    model_dir, _ = tool_model
    prompts = tmp_path_factory.mktemp("prompts") / "q.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": QUESTION[0]["content"], "label": "5"}) + "\n" for _ in range(2)))
    proc, url = start_engine(model_dir, tmp_path_factory.mktemp("engine"), token=TOKEN)
    environment = Environment() if request.param == "environment" else None
    try:
        scripted_agent.CALLS.clear()
        agent = environment.url if environment else "import:tests.rollout.scripted_agent:agent"
        plane = run_rollout(model_dir, str(prompts), url, agent)
    finally:
        proc.stop()
        if environment:
            environment.shutdown()
    return plane, dict(scripted_agent.CALLS)


def test_each_call_continues_the_last_one_token_for_token(episodes, tool_model):
    _, calls = episodes
    _, tok = tool_model
    assert len(calls) == 2 * N
    for turns in calls.values():
        assert len(turns) == 4
        assert turns[0]["finish_reason"] == "tool_calls" and turns[0]["tool_calls"][0].function.name == "add"
        # the first call of each chain is the template's rendering of its messages
        assert turns[0]["prompt_token_ids"] == render_chat(tok, turns[0]["messages"], [scripted_agent.ADD])
        assert turns[2]["prompt_token_ids"] == render_chat(tok, turns[2]["messages"])
        # a call that sends the reply back continues the previous prompt + output exactly (the tool call's
        # ids as the model wrote them), then the template's tokens for what was added
        for before, after in ((turns[0], turns[1]), (turns[2], turns[3])):
            context = before["prompt_token_ids"] + before["token_ids"]
            assert after["prompt_token_ids"][: len(context)] == context
        assert "<tool_response>\n5\n</tool_response>" in tok.decode(turns[1]["prompt_token_ids"])


def test_the_sample_is_the_last_chain_with_model_tokens_masked_in(episodes):
    plane, calls = episodes
    rows = [row for p in plane.partitions.values() for row in p.rows]
    assert len(rows) == 2 * N and all(float(row["reward"]) == 1.0 for row in rows)
    for row in rows:
        turns = calls[(int(row["prompt_position"]), int(row["sample_index"]))]
        third, fourth = turns[2], turns[3]
        tokens, prompt_length = row["tokens"].tolist(), int(row["prompt_length"])
        assert tokens[:prompt_length] == third["prompt_token_ids"]
        assert tokens == fourth["prompt_token_ids"] + fourth["token_ids"]
        inserted = len(fourth["prompt_token_ids"]) - len(third["prompt_token_ids"]) - len(third["token_ids"])
        assert row["loss_mask"].tolist() == [1.0] * len(third["token_ids"]) + [0.0] * inserted + [1.0] * len(
            fourth["token_ids"]
        )
        assert int(row["response_length"]) == len(tokens) - prompt_length


def test_rollout_log_probs_are_the_models_under_teacher_forcing(episodes, tool_model):
    plane, _ = episodes
    model, _ = load_causal_lm(tool_model[0])
    for row in (row for p in plane.partitions.values() for row in p.rows):
        tokens, start = row["tokens"], int(row["prompt_length"])
        with torch.no_grad():  # greedy sampling reports log-probs of the raw logits
            logp = torch.log_softmax(model(tokens[None]).logits[0].float(), dim=-1)
        forced = logp[start - 1 : -1].gather(-1, tokens[start:, None])[:, 0]
        mask = row["loss_mask"].bool()
        torch.testing.assert_close(row["rollout_log_probs"][mask], forced[mask], atol=2e-4, rtol=0)
        assert (row["rollout_log_probs"][~mask] == 0).all()


def test_with_agent_chains_two_each_chain_is_its_own_sample_with_the_episodes_reward(tool_model, tmp_path):
    """The scripted agent's history rewrite leaves two consistent chains: with rollout.agent_chains 2 both are
    written, in order, each exactly the tokens the engine saw and produced, both with the episode's reward."""
    model_dir, _ = tool_model
    prompts = tmp_path / "q.jsonl"
    prompts.write_text(json.dumps({"prompt": QUESTION[0]["content"], "label": "5"}) + "\n")
    proc, url = start_engine(model_dir, tmp_path, token=TOKEN)
    try:
        scripted_agent.CALLS.clear()
        plane = run_rollout(
            model_dir, str(prompts), url, "import:tests.rollout.scripted_agent:agent", num_steps=1, chains=2
        )
    finally:
        proc.stop()
    partition = plane.partitions[partition_name("r", 0)]
    rows = partition.rows
    assert partition.group_size == 2 * N and len(rows) == 2 * N
    assert [int(r["sample_index"]) for r in rows] == list(range(2 * N))  # each row its own sample id
    for k in range(N):
        first, second = rows[2 * k], rows[2 * k + 1]
        turns = scripted_agent.CALLS[(int(first["prompt_position"]), k)]
        for row, (a, b) in ((first, turns[:2]), (second, turns[2:])):
            assert row["tokens"].tolist() == b["prompt_token_ids"] + b["token_ids"]
            assert row["tokens"].tolist()[: int(row["prompt_length"])] == a["prompt_token_ids"]
            assert float(row["loss_mask"].sum()) == len(a["token_ids"]) + len(b["token_ids"])
        assert float(first["reward"]) == float(second["reward"]) == 1.0
