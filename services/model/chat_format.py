"""Chat messages to prompt token ids through the model's own chat template (tool calls back out of what the model
wrote: services/model/tool_call_formats.py)."""

from __future__ import annotations

import json
from typing import Any, Iterable

from jinja2 import TemplateError

# tokens that end an assistant turn in common chat templates (ChatML, Llama 3, Phi, Gemma)
_TURN_ENDS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")


class ChatFormatError(ValueError):
    """Messages or tools the model's chat template cannot render (the message says why)."""


def turn_end_ids(tokenizer) -> list[int]:
    """Ids of the tokens that end an assistant turn in the model's template (a chat completion stops there)."""
    vocab = tokenizer.get_vocab()
    return [vocab[t] for t in _TURN_ENDS if t in vocab]


def template_message(message: dict) -> dict:
    """A message as chat templates read it: text parts joined into one string, tool-call arguments given as
    a JSON string (OpenAI's form) parsed into the object templates expect."""
    out = {k: v for k, v in message.items() if v is not None}
    content = out.get("content")
    if isinstance(content, list):
        out["content"] = "".join(part["text"] for part in content)
    if out.get("tool_calls"):
        calls = []
        for call in out["tool_calls"]:
            fn = dict(call["function"])
            if isinstance(fn.get("arguments"), str):
                try:
                    fn["arguments"] = json.loads(fn["arguments"])
                except json.JSONDecodeError:
                    pass  # rendered as the string it is
            calls.append({**call, "function": fn})
        out["tool_calls"] = calls
    return out


def render_chat_text(
    tokenizer, messages: Iterable[dict], tools: list[dict] | None = None, **template_kwargs: Any
) -> str:
    """The prompt text of `messages` (and `tools`) with the generation prompt of an assistant turn appended."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ChatFormatError("the model has no chat template")
    try:
        return tokenizer.apply_chat_template(
            [template_message(m) for m in messages],
            tools=tools or None,
            add_generation_prompt=True,
            tokenize=False,
            **template_kwargs,
        )
    except (TemplateError, TypeError, KeyError) as exc:
        raise ChatFormatError(f"the chat template cannot render these messages: {exc}") from None


def render_chat(
    tokenizer, messages: Iterable[dict], tools: list[dict] | None = None, **template_kwargs: Any
) -> list[int]:
    """The prompt ids of `messages` (and `tools`): the rendered text, tokenized as transformers'
    apply_chat_template(tokenize=True) does (no special tokens added)."""
    text = render_chat_text(tokenizer, messages, tools, **template_kwargs)
    return tokenizer.encode(text, add_special_tokens=False)
