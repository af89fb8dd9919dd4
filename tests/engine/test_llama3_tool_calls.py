"""Tool calls in the format the chat template defines, on the real engine: the tiny model under a Llama 3 style
template (tools described with a "parameters" JSON instruction, a call written as the bare JSON object) and
taught to answer with such a call; the `openai` client gets it parsed, whole and streamed."""

from __future__ import annotations

import json
import shutil

import openai
import pytest

from services.model.chat_format import render_chat
from services.model.loading import load_causal_lm
from services.model.tool_call_formats import LLAMA3, tool_call_format
from tests.engine.conftest import ADD, QUESTION, start_engine, teach_tool_call

TOKEN = "llama3-tools-token"
TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nCall a function by answering in the format "
    '{"name": function name, "parameters": dictionary of argument name and its value}.\n'
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{%- if m.tool_calls %}{% for c in m.tool_calls %}"
    '{{ {"name": c.function.name, "parameters": c.function.arguments} | tojson }}{% endfor %}'
    "{%- else %}{{ m.content }}{%- endif %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CALL = json.dumps({"name": "add", "parameters": {"a": 2, "b": 3}})


@pytest.fixture(scope="module")
def served(tool_model, tmp_path_factory):
    """tool_model's weights and tokenizer under TEMPLATE, overfit to answer QUESTION with CALL."""
    model_dir = str(tmp_path_factory.mktemp("llama3-tools") / "model")
    shutil.copytree(tool_model[0], model_dir)
    model, tok = load_causal_lm(model_dir)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(model_dir)
    teach_tool_call(model, tok, model_dir, CALL)
    proc, url = start_engine(model_dir, tmp_path_factory.mktemp("engine"), token=TOKEN)
    client = openai.OpenAI(base_url=url + "/v1", api_key=TOKEN, max_retries=0, timeout=60)
    yield client, tok
    client.close()
    proc.stop()


def test_the_templates_format_is_read_and_the_call_parsed_whole_and_streamed(served):
    client, tok = served
    assert tool_call_format(tok) is LLAMA3
    out = client.chat.completions.create(model="m", messages=QUESTION, tools=[ADD], temperature=0, max_tokens=100)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 2, "b": 3}
    chunks = list(
        client.chat.completions.create(
            model="m", messages=QUESTION, tools=[ADD], temperature=0, max_tokens=100, stream=True
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == ""  # the call is not streamed as text
    [streamed] = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert streamed.function.name == "add" and json.loads(streamed.function.arguments) == {"a": 2, "b": 3}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    # the call sent back renders as the template writes it, and the next turn goes on from there
    follow = QUESTION + [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "5"},
    ]
    assert CALL in tok.decode(render_chat(tok, follow, [ADD]))
