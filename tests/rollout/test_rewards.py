"""Reward functions: the built-ins, a Python function named by import path, and a remote HTTP
endpoint (a real uvicorn server in a subprocess: tests/rollout/reward_server.py)."""

from __future__ import annotations

import asyncio
import math
import random
import sys
import threading
import time

import httpx
import pytest

from services.run_contract.prompt_source import DEMO_TASKS, PromptRecord, open_prompt_source
from services.rollout.rewards import BUILTIN_REWARDS, RewardError, RewardFunction, build_reward
from services.runtime.processes import ChildProcess, free_port, http_ok
from tests.rollout import reward_fixtures
from tests.worker_fork_server import worker_fork_server

pytestmark = pytest.mark.one_worker  # its tests share a costly module fixture: ./dev test runs them on one worker

FIXTURES = "import:tests.rollout.reward_fixtures"


def row(label=None, prompt="What is 6 * 7?", **fields) -> PromptRecord:
    if label is not None:
        fields["label"] = label
    return PromptRecord(position=0, epoch=0, index=0, prompt=prompt, fields=fields)


async def score(spec: str, record: PromptRecord, response: str, **kwargs) -> float:
    reward = build_reward(spec, **kwargs)
    try:
        return await reward.score(record, response)
    finally:
        await reward.aclose()


# ------------------------------------------------------------------------------------- built-ins

MATH_CASES = [
    # (response, label, reward)
    (r"so the answer is \boxed{42}", "42", 1.0),
    (r"\boxed{41} no wait, \boxed{42}", "42", 1.0),  # the last box counts
    (r"\boxed{42} no wait, \boxed{41}", "42", 0.0),
    (r"\boxed{1,000}", "1000", 1.0),
    (r"\boxed{1,000}", "1,000", 1.0),
    (r"\boxed{\frac{1}{2}}", "0.5", 1.0),  # nested braces
    (r"\boxed{\dfrac{7}{2}}", "7/2", 1.0),
    (r"\boxed{-\frac{3}{4}}", "-0.75", 1.0),
    (r"\boxed{x = 5}", "5", 1.0),
    (r"\boxed{\$3.50}", "3.5", 1.0),
    (r"\boxed{{12}}", "12", 1.0),
    (r"I think \boxed{12} ... then \boxed{13", "12", 1.0),  # a box cut off mid-way is skipped
    ("It costs $3.50.", "3.5", 1.0),
    ("It costs $3.50.", "$3.50", 1.0),
    ("7/2", "3.5", 1.0),
    ("half of 7 is 7/2", "3.5", 1.0),
    ("3 apples, then 5 more: 8", "8", 1.0),  # the last number
    ("3 apples, then 5 more: 8", "5", 0.0),
    ("We get 2,500,000 in total.", "2500000", 1.0),
    ("x = -12", "-12", 1.0),
    ("10-3=7", "7", 1.0),
    ("0.50", ".5", 1.0),
    ("42.0", "42", 1.0),
    ("forty-two", "42", 0.0),  # no number at all
    ("", "42", 0.0),
    ("1/0", "1", 0.0),
]


@pytest.mark.parametrize("response, label, expected", MATH_CASES)
async def test_math_answer(response, label, expected):
    assert await score("math_answer", row(label), response) == expected


async def test_math_answer_labels():
    assert await score("math_answer", row(42), r"\boxed{42}") == 1.0  # a JSON number label
    assert await score("math_answer", row(answer="7"), "7", label_field="answer") == 1.0
    with pytest.raises(RewardError, match="math_answer: the label 'seven' is not a number"):
        await score("math_answer", row("seven"), "7")
    with pytest.raises(RewardError, match=r"reward math_answer needs the field 'label'; the row has \['answer'\]"):
        await score("math_answer", row(answer="7"), "7")


@pytest.mark.parametrize(
    "response, label, expected",
    [
        ("Paris", "Paris", 1.0),
        ("  Paris\n", " Paris ", 1.0),
        ("paris", "Paris", 0.0),
        ("Paris.", "Paris", 0.0),
        ("4", 4, 1.0),
    ],
)
async def test_exact_match(response, label, expected):
    assert await score("exact_match", row(label), response) == expected


async def test_arith_verifies_the_demo_task():
    source = open_prompt_source("demo:arith")
    reward = build_reward(DEMO_TASKS["arith"].reward)
    for p in range(20):
        record = source.record(p)
        assert await reward.score(record, f"The answer is {record.fields['label']}.") == 1.0
        assert await reward.score(record, rf"\boxed{{{int(record.fields['label']) + 1}}}") == 0.0


@pytest.mark.parametrize(
    "response, expected",
    [
        ("ace", 1.0),
        ("Ace!", 1.0),  # case and punctuation do not count
        ("axe", 2 / 3),
        ("xyz", 0.0),
        ("123 ...", 0.0),  # no letters
        ("", 0.0),
    ],
)
async def test_letters(response, expected):
    assert await score("letters", row(letters="abcde"), response) == pytest.approx(expected)


async def test_letters_reward_varies_for_random_text():
    """A randomly initialised model writes near-random text; the reward must still vary, or advantage
    estimators see no signal."""
    source, reward = open_prompt_source("demo:letters"), build_reward(DEMO_TASKS["letters"].reward)
    rng = random.Random(0)
    record = source.record(0)
    samples = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(12)) for _ in range(16)]
    rewards = [await reward.score(record, s) for s in samples]
    assert all(0.0 <= r <= 1.0 for r in rewards) and len(set(rewards)) >= 4
    with pytest.raises(RewardError, match="reward letters needs the field 'letters'"):
        await reward.score(row("x"), "abc")


def test_build_reward_refuses_unknown_specs():
    assert set(BUILTIN_REWARDS) == {"exact_match", "math_answer", "arith", "letters"}
    for bad in ("exact", "ftp://host/score", "", "import"):
        with pytest.raises(
            ValueError,
            match=r"expected a built-in name \(arith, exact_match, letters, "
            r"math_answer\), import:module.path:function, an http:// or "
            r"https:// URL, or model:",
        ):
            build_reward(bad)
    assert isinstance(build_reward("letters"), RewardFunction)


# ------------------------------------------------------------------------------------- import path


async def test_imported_sync_function_runs_in_a_worker_thread():
    record = row("42")
    reward = build_reward(f"{FIXTURES}:label_in_response")
    try:
        assert await reward.score(record, "it is 42") == 1.0
        assert await reward.score(record, "it is 41") == 0.0
    finally:
        await reward.aclose()
    assert record.fields == {"label": "42"}  # the function changed its copy only
    assert len(reward_fixtures.CALL_THREADS) >= 2 and threading.get_ident() not in reward_fixtures.CALL_THREADS


async def test_imported_async_function():
    assert await score(f"{FIXTURES}:prompt_length", row(prompt="x" * 25), "") == 0.25
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert await score(f"{FIXTURES}:prompt_length", row(prompt=chat), "") == 0.02


async def test_imported_function_errors_name_the_function():
    with pytest.raises(
        RewardError,
        match=r"reward function import:tests.rollout.reward_fixtures:wrong_type "
        r"returned str \('high'\), expected a number",
    ):
        await score(f"{FIXTURES}:wrong_type", row("1"), "x")
    with pytest.raises(RewardError, match="not_finite returned nan, expected a finite number"):
        await score(f"{FIXTURES}:not_finite", row("1"), "x")
    with pytest.raises(RewardError, match="reward_fixtures:raises raised KeyError: 'answer'") as raised:
        await score(f"{FIXTURES}:raises", row("1"), "x")
    assert raised.value.kind == "exception"


async def test_an_imported_function_past_its_time_limit_is_a_timeout():
    with pytest.raises(RewardError, match="slow_async gave no answer within 0.05s") as raised:
        await score(f"{FIXTURES}:slow_async", row("1"), "x", timeout_s=0.05)
    assert raised.value.kind == "timeout"
    assert await score(f"{FIXTURES}:prompt_length", row(prompt="x" * 25), "", timeout_s=5) == 0.25  # in time


@pytest.mark.parametrize(
    "spec, message",
    [
        ("import:tests.rollout.reward_fixtures", "must look like module.path:function"),
        ("import:tests.rollout.no_such_module:f", "cannot import module 'tests.rollout.no_such_module'"),
        (f"{FIXTURES}:missing", "has no attribute 'missing'"),
        (f"{FIXTURES}:NOT_A_FUNCTION", "'NOT_A_FUNCTION' is a int, not a function"),
        (f"{FIXTURES}:two_args", "the function must take (response, fields, prompt)"),
    ],
)
def test_bad_import_paths_are_refused_when_built(spec, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build_reward(spec)


# ------------------------------------------------------------------------------------- remote HTTP


@pytest.fixture(scope="module")
def reward_server(tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("reward-server") / "server.log"
    proc = ChildProcess(
        "reward-server",
        [sys.executable, "-m", "tests.rollout.reward_server", "--port", str(port)],
        str(log),
        forker=worker_fork_server(),
    )
    url = f"http://127.0.0.1:{port}"
    proc.wait_until(lambda: http_ok(url + "/health"), 30)
    yield url
    proc.stop()


def requests_seen(server: str, key: str) -> dict:
    return httpx.get(f"{server}/requests/{key}").json()


async def test_remote_reward_posts_prompt_response_and_fields(reward_server):
    record = row("42", prompt=[{"role": "user", "content": "6*7?"}], key="plain", extra=[1, 2])
    reward = build_reward(f"{reward_server}/score")
    try:
        assert await reward.score(record, " 42 ") == 1.0
        assert await reward.score(record, "41") == 0.0
        # one client, many concurrent requests
        assert await asyncio.gather(*(reward.score(record, str(40 + i)) for i in range(8))) == [0, 0, 1, 0, 0, 0, 0, 0]
    finally:
        await reward.aclose()
    seen = requests_seen(reward_server, "plain")
    assert seen["counts"] == {"/score": 10}
    assert seen["body"]["prompt"] == record.prompt and seen["body"]["fields"] == record.fields
    assert seen["authorization"] is None


async def test_remote_reward_retries_5xx_then_succeeds(reward_server):
    assert await score(f"{reward_server}/flaky?fail=2", row("42", key="flaky2"), "42", retries=3) == 1.0
    assert requests_seen(reward_server, "flaky2")["counts"] == {"/flaky": 3}


async def test_remote_reward_gives_up_after_the_retries(reward_server):
    with pytest.raises(RewardError, match=r"failed 3 time\(s\); last: HTTP 503: .*overloaded \(3\)") as raised:
        await score(f"{reward_server}/flaky?fail=100", row("42", key="flaky100"), "42", retries=2)
    assert raised.value.kind == "exception"
    assert requests_seen(reward_server, "flaky100")["counts"] == {"/flaky": 3}


async def test_remote_reward_times_out_and_retries(reward_server):
    start = time.monotonic()
    with pytest.raises(RewardError, match=r"failed 2 time\(s\); last: no answer within 0.3s") as raised:
        await score(f"{reward_server}/slow?sleep_s=10", row("42", key="slow"), "42", timeout_s=0.3, retries=1)
    assert raised.value.kind == "timeout"
    assert time.monotonic() - start < 5  # two 0.3 s tries and a back-off, not the 10 s answer
    # both tries reached the server; on a busy machine it may read the second after the client gave up on it
    deadline = time.monotonic() + 10
    while requests_seen(reward_server, "slow")["counts"] != {"/slow": 2} and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert requests_seen(reward_server, "slow")["counts"] == {"/slow": 2}
    # within the timeout it is an ordinary answer
    assert await score(f"{reward_server}/slow?sleep_s=0.05", row("42", key="quick"), "42", timeout_s=5) == 1.0


async def test_remote_reward_4xx_is_not_retried(reward_server):
    with pytest.raises(RewardError, match=r"refused the request: HTTP 422: .*fields.label is required"):
        await score(f"{reward_server}/reject", row("42", key="reject"), "42", retries=3)
    assert requests_seen(reward_server, "reject")["counts"] == {"/reject": 1}


async def test_remote_reward_bearer_token(reward_server):
    assert await score(f"{reward_server}/auth", row("42", key="auth"), "42", token="secret") == 1.0
    assert requests_seen(reward_server, "auth")["authorization"] == "Bearer secret"
    with pytest.raises(RewardError, match="HTTP 401"):
        await score(f"{reward_server}/auth", row("42", key="noauth"), "42")
    assert requests_seen(reward_server, "noauth")["counts"] == {"/auth": 1}


async def test_remote_reward_must_be_a_finite_number(reward_server):
    with pytest.raises(RewardError, match="returned nan, expected a finite number"):
        await score(f"{reward_server}/nan", row("42"), "42")
    with pytest.raises(RewardError, match=r"returned str \('high'\), expected a number"):
        await score(f"{reward_server}/not_a_number", row("42"), "42")
    with pytest.raises(RewardError, match="cannot be sent as JSON"):
        await score(f"{reward_server}/score", row("42", weight=math.inf), "42")


async def test_remote_reward_connection_refused_is_retried():
    url = f"http://127.0.0.1:{free_port()}/score"  # nothing listens there
    start = time.monotonic()
    with pytest.raises(RewardError, match=r"failed 3 time\(s\); last: ConnectError"):
        await score(url, row("42"), "42", retries=2)
    assert 0.1 < time.monotonic() - start < 3.0  # it backed off between attempts


def test_remote_reward_settings_are_checked():
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        build_reward("http://127.0.0.1:1/score", timeout_s=0)
    with pytest.raises(ValueError, match="retries must be an int >= 0"):
        build_reward("http://127.0.0.1:1/score", retries=-1)
