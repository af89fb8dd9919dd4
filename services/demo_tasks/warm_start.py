"""A short supervised warm start for a demo task, so RL starts from a model that knows the answer's format.

A random model of a few million parameters scores 0 on `demo:reverse`: every sample of a group gets the
same reward, GRPO's advantages are all zero and nothing is learnt. A few seconds of next-token
cross-entropy on the answer tokens (+ EOS) of training rows, stopped as soon as the greedy score on a
slice of training prompts reaches `target`, leaves a policy that answers in the right shape and is right
some of the time: the reward then has room to climb under RL.

Loss: mean over answer tokens of -log p(token | prompt, earlier answer tokens), AdamW, gradient clip 1.0.
Prompts are encoded the way the rollout role encodes a text prompt with `apply_chat_template: true`
(one user message, the chat template, the generation prompt)."""

from __future__ import annotations

import random
import time
from typing import Callable

import torch

Scorer = Callable[[str, dict], float]  # (response text, row fields) -> reward


def exact_label(response: str, fields: dict) -> float:
    """The built-in `exact_match` reward on the row's "label" field."""
    return 1.0 if response.strip() == str(fields.get("label", "")).strip() else 0.0


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
    )
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def sft_example(tokenizer, prompt: str, answer: str) -> tuple[list[int], int]:
    """(prompt + " answer" + EOS token ids, prompt length)."""
    ids = encode_prompt(tokenizer, prompt)
    target = tokenizer.encode(" " + answer, add_special_tokens=False) + [tokenizer.eos_token_id]
    return ids + target, len(ids)


def sft_batch(examples: list[tuple[list[int], int]], pad_id: int):
    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, (seq, plen) in enumerate(examples):
        ids[i, : len(seq)] = torch.tensor(seq)
        mask[i, : len(seq)] = 1
        labels[i, plen : len(seq)] = torch.tensor(seq[plen:])
    return ids, mask, labels


def warm_start(
    base_dir: str,
    out_dir: str,
    rows: list[tuple[str, dict]],
    max_steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    target: float,
    check_rows: list[tuple[str, dict]],
    check_every: int = 5,
    max_new_tokens: int = 12,
    score: Scorer = exact_label,
) -> dict:
    """Fine-tune base_dir on rows ((prompt, fields with "label")) until the greedy score on check_rows
    (training prompts, not a held-out set) reaches target, checked every check_every steps, or max_steps;
    writes out_dir (model + tokenizer files, chat template included)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    rng = random.Random(seed)
    tokenizer = AutoTokenizer.from_pretrained(base_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(base_dir, local_files_only=True, dtype=torch.float32)
    examples = [sft_example(tokenizer, prompt, fields["label"]) for prompt, fields in rows]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    started, losses, check, step = time.perf_counter(), [], 0.0, 0
    while step < max_steps and check < target:
        ids, mask, labels = sft_batch(rng.sample(examples, batch_size), tokenizer.pad_token_id)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        step += 1
        if step % check_every == 0:
            check = greedy_eval(model, tokenizer, check_rows, max_new_tokens, score)
    model.eval()
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    tail = losses[-check_every:]
    return {
        "steps": step,
        "batch_size": batch_size,
        "lr": lr,
        "target": target,
        "train_check_reward": check,
        "seconds": round(time.perf_counter() - started, 2),
        "final_loss": round(sum(tail) / len(tail), 4),
    }


def left_padded(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input ids, attention mask) of prompts left-padded to the longest, as `generate` takes a batch."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    return ids, mask


@torch.no_grad()
def greedy_eval(
    model,
    tokenizer,
    rows: list[tuple[str, dict]],
    max_new_tokens: int,
    score: Scorer = exact_label,
    batch_size: int = 64,
) -> float:
    """Mean score of greedy answers (left-padded batches, EOS stops) to rows."""
    was_training = model.training
    model.eval()
    pad = tokenizer.pad_token_id
    total = 0.0
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        ids, mask = left_padded([encode_prompt(tokenizer, prompt) for prompt, _ in chunk], pad)
        width = ids.shape[1]
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=pad,
        )
        texts = tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
        total += sum(score(text, fields) for text, (_, fields) in zip(texts, chunk))
    if was_training:
        model.train()
    return total / len(rows)
