"""A tokenizer built offline (no hub download): byte-level BPE trained on a small generated corpus
of English and arithmetic, saved in the Hugging Face fast-tokenizer format so transformers'
AutoTokenizer loads it like any other."""

from __future__ import annotations

import random

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
# ChatML, and tools in Qwen2.5's (Hermes) format: the signatures in the system turn, each call the model makes as
# <tool_call>{"name": ..., "arguments": {...}}</tool_call>, each result as a user turn in <tool_response> tags
CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n' }}</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\n</tool_call><|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and tools and loop.first %}"
    "{% elif message['role'] == 'assistant' and message['tool_calls'] %}<|im_start|>assistant\n"
    "{% if message['content'] %}{{ message['content'] }}\n{% endif %}"
    "{% for call in message['tool_calls'] %}<tool_call>\n{\"name\": \"{{ call['function']['name'] }}\", "
    "\"arguments\": {{ call['function']['arguments'] | tojson }}}\n</tool_call>{% if not loop.last %}{{ '\\n' }}"
    "{% endif %}{% endfor %}<|im_end|>\n"
    "{% elif message['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message['content'] }}\n"
    "</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_WORDS = (
    "the a of to and in is it you that he was for on are with as his they be at one have this from "
    "or had by word but what some we can out other were all there when up use your how said an each "
    "she which do their time if will way about many then them write would like so these her long make "
    "thing see him two has look more day could go come did number sound no most people my over know "
    "water than call first who may down side been now find answer question sum product reward model "
    "step think therefore boxed total"
).split()


def _corpus(seed: int = 0, lines: int = 4000):
    rng = random.Random(seed)
    for _ in range(lines):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op = rng.choice("+-*")
        yield f"What is {a} {op} {b}? The answer is \\boxed{{{eval(f'{a}{op}{b}')}}}."
        yield " ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 16))).capitalize() + "."


def build_tokenizer(vocab_size: int = 1024, seed: int = 0) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>", bos_token=None, unk_token=None
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast
