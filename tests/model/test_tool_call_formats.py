"""Tool calls read back in the format the chat template defines (services/model/tool_call_formats.py): Hermes
tags, Llama 3's bare JSON, Mistral's [TOOL_CALLS] list; what is not a call stays text; the format is found
from the template."""

import json
from types import SimpleNamespace

import pytest

from services.model.tool_call_formats import HERMES, LLAMA3, MISTRAL, parse_tool_calls, tool_call_format

ADD = {"a": 2, "b": 3}


def _args(calls):
    return [(name, json.loads(args)) for name, args in calls]


def test_hermes_calls_between_tags_leave_the_rest_as_text():
    text = f"Let me add.\n<tool_call>\n{json.dumps({'name': 'add', 'arguments': ADD})}\n</tool_call>"
    content, calls = parse_tool_calls(text, HERMES)
    assert content == "Let me add." and _args(calls) == [("add", ADD)]
    broken = "<tool_call>{not json}</tool_call>"
    assert parse_tool_calls(broken, HERMES) == (broken, [])


@pytest.mark.parametrize(
    "text",
    [
        json.dumps({"name": "add", "parameters": ADD}),
        "<|python_tag|>" + json.dumps({"name": "add", "parameters": ADD}),
        "  " + json.dumps({"name": "add", "arguments": ADD}) + "\n",
    ],
)
def test_llama3_a_reply_that_is_a_json_call_is_the_call(text):
    assert parse_tool_calls(text, LLAMA3)[0] is None and _args(parse_tool_calls(text, LLAMA3)[1]) == [("add", ADD)]


def test_llama3_several_calls_and_text_that_is_not_a_call():
    two = json.dumps({"name": "add", "parameters": ADD}) + "; " + json.dumps({"name": "mul", "parameters": {"a": 1}})
    assert _args(parse_tool_calls(two, LLAMA3)[1]) == [("add", ADD), ("mul", {"a": 1})]
    for text in ("The answer is {5}.", '{"x": 1}', '{"name": "add", "parameters": {} } and then prose'):
        assert parse_tool_calls(text, LLAMA3) == (text.strip(), [])


def test_mistral_calls_follow_the_marker_as_a_json_list():
    text = "Sure. [TOOL_CALLS] " + json.dumps(
        [{"name": "add", "arguments": ADD}, {"name": "neg", "arguments": {"a": 1}}]
    )
    content, calls = parse_tool_calls(text, MISTRAL)
    assert content == "Sure." and _args(calls) == [("add", ADD), ("neg", {"a": 1})]
    assert parse_tool_calls("[TOOL_CALLS] [oops", MISTRAL) == ("[TOOL_CALLS] [oops", [])


@pytest.mark.parametrize(
    "template,want",
    [
        ("{% for t in tools %}<tools>{{ t }}</tools>{% endfor %}<tool_call>", HERMES),
        ("{%- if tools %}[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]", MISTRAL),
        ('{%- if tools %}Respond in the format {"name": function name, "parameters": dictionary}{% endif %}', LLAMA3),
        ("{{- '<|python_tag|>' + tool_call.name }}", LLAMA3),
        ("{% for m in messages %}{{ m.content }}{% endfor %}", None),
    ],
)
def test_the_format_is_the_one_the_template_writes(template, want):
    assert tool_call_format(SimpleNamespace(chat_template=template)) is want
    assert tool_call_format(SimpleNamespace(chat_template=None)) is None
