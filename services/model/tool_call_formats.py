"""Tool calls back out of what the model wrote, in the format its chat template defines (the template is what
taught the model the format, so it is what names it):

    hermes   Qwen2.5, Hermes, and the built-in tokenizer (services/model/tokenizer_build.py): each call a JSON
             object {"name": ..., "arguments": {...}} between <tool_call> and </tool_call>, anywhere in the reply
    llama3   Llama 3.1-3.3 JSON tool calling: the reply is the call, {"name": ..., "parameters": {...}} (several
             separated by ";"), optionally after <|python_tag|>
    mistral  Mistral: [TOOL_CALLS] followed by a JSON list of {"name": ..., "arguments": {...}}

A template is read as the first format whose marker it mentions (<tool_call>, [TOOL_CALLS], then Llama 3's
<|python_tag|> or its "parameters" instruction). What does not parse as such calls stays in the message's
text, as SGLang leaves an unparsable call. `hold` is what a stream holds back until the reply is whole: text
from there on may be a call (services/engine/openai_stream.py)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Callable

Calls = list[tuple[str, str]]  # (function name, arguments as a JSON string)
CALL_START, CALL_END = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_CALLS = "[TOOL_CALLS]"
_HERMES_CALL = re.compile(re.escape(CALL_START) + r"\s*(.*?)\s*" + re.escape(CALL_END), re.S)


def _call(obj) -> tuple[str, str] | None:
    """(name, arguments JSON) of a {"name", "arguments" | "parameters"} object; None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def _hermes(text: str) -> tuple[str | None, Calls]:
    calls: Calls = []

    def take(match: re.Match) -> str:
        try:
            call = _call(json.loads(match.group(1)))
        except json.JSONDecodeError:
            call = None
        if call is None:
            return match.group(0)
        calls.append(call)
        return ""

    rest = _HERMES_CALL.sub(take, text).strip()
    return (rest or None), calls


def _llama3(text: str) -> tuple[str | None, Calls]:
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG) :].strip()
    if not body.startswith("{"):
        return (text.strip() or None), []
    calls: Calls = []
    decoder, at = json.JSONDecoder(), 0
    while at < len(body):
        try:
            obj, end = decoder.raw_decode(body, at)
        except json.JSONDecodeError:
            return (text.strip() or None), []
        call = _call(obj)
        if call is None:
            return (text.strip() or None), []
        calls.append(call)
        at = end
        while at < len(body) and body[at] in " \t\r\n;":
            at += 1
    return None, calls


def _mistral(text: str) -> tuple[str | None, Calls]:
    before, marker, after = text.partition(MISTRAL_CALLS)
    if not marker:
        return (text.strip() or None), []
    try:
        listed = json.loads(after.strip())
    except json.JSONDecodeError:
        return (text.strip() or None), []
    calls = [_call(obj) for obj in (listed if isinstance(listed, list) else [listed])]
    if not calls or any(c is None for c in calls):
        return (text.strip() or None), []
    return (before.strip() or None), [c for c in calls if c is not None]  # none is None (checked above)


@dataclass(frozen=True)
class ToolCallFormat:
    name: str
    parse: Callable[[str], tuple[str | None, Calls]]  # reply text -> (the text without its calls or None, calls)
    hold: tuple[str, ...]


HERMES = ToolCallFormat("hermes", _hermes, (CALL_START,))
LLAMA3 = ToolCallFormat("llama3", _llama3, (PYTHON_TAG, "{"))
MISTRAL = ToolCallFormat("mistral", _mistral, (MISTRAL_CALLS,))


def tool_call_format(tokenizer) -> ToolCallFormat | None:
    """The tool-call format the model's chat template defines; None if it defines none."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if not isinstance(template, str):
        return None
    if CALL_START in template:
        return HERMES
    if MISTRAL_CALLS in template:
        return MISTRAL
    if PYTHON_TAG in template or ('"parameters"' in template and "tools" in template):
        return LLAMA3
    return None


def parse_tool_calls(text: str, fmt: ToolCallFormat | None = HERMES) -> tuple[str | None, Calls]:
    """(the text without its tool calls, or None if nothing else is left; [(name, arguments as JSON)])."""
    return (fmt or HERMES).parse(text)
