"""The task, supervised warm start and greedy evaluation of benchmarks/time_to_reward.py.

Task "reverse": the prompt is `Reverse: d a c b` (3 to 5 letters drawn from LETTERS, each a single
token of the offline tokenizer both with and without a leading space), the answer is the letters in
reverse order, `b c a d`. Rows are {"prompt": text, "label": answer}; the reward is Sluice's built-in
`exact_match` (services/rollout/rewards/builtin.py: stripped response == stripped label), binary.
Prompts are encoded the way the rollout role encodes a text prompt (rollout.apply_chat_template=True:
one user message, chat template, generation prompt); the model answers " b c a d" and then EOS.

Warm start: a plain torch loop of next-token cross-entropy on the answer tokens (+ EOS) only, AdamW,
one thread, from the random model written by `init_model`, stopped as soon as the greedy score on a
slice of the training prompts reaches a target (see warm_start()); saved as a Hugging Face directory
with the tokenizer files, which both systems start from. It is deliberately short: the policy ends it
knowing the format and part of the task, so the reward has room to climb under RL.

Evaluation: greedy decoding (left-padded batches, `generate(do_sample=False)`, EOS stops) of a fixed
held-out prompt set that is disjoint from the training prompts; the score is the mean exact_match.
"""

from __future__ import annotations

import random
import time

import torch

from services.rollout.rewards.builtin import exact_match

LETTERS = "abcdfilm"
MIN_LEN, MAX_LEN = 3, 5


def reverse_row(rng: random.Random) -> dict:
    letters = [rng.choice(LETTERS) for _ in range(rng.randint(MIN_LEN, MAX_LEN))]
    return {"prompt": "Reverse: " + " ".join(letters), "label": " ".join(reversed(letters))}


def make_splits(seed: int, n_train: int, n_eval: int) -> tuple[list[dict], list[dict]]:
    """(train rows, held-out rows): distinct prompts, no prompt in both."""
    rng = random.Random(f"time-to-reward:{seed}")
    seen: set[str] = set()

    def distinct(n: int) -> list[dict]:
        rows: list[dict] = []
        while len(rows) < n:
            row = reverse_row(rng)
            if row["prompt"] not in seen:
                seen.add(row["prompt"])
                rows.append(row)
        return rows

    held_out = distinct(n_eval)  # drawn first, so the held-out set does not depend on n_train
    train = distinct(n_train)
    return train, held_out


def chat_messages(prompt: str) -> list[dict]:
    return [{"role": "user", "content": prompt}]


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    """The rollout role's encoding of a text prompt (services/rollout/service.py RolloutService.encode)."""
    ids = tokenizer.apply_chat_template(chat_messages(prompt), add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def sft_example(tokenizer, row: dict) -> tuple[list[int], int]:
    """(prompt + " answer" + EOS token ids, prompt length)."""
    prompt = encode_prompt(tokenizer, row["prompt"])
    answer = tokenizer.encode(" " + row["label"], add_special_tokens=False) + [tokenizer.eos_token_id]
    return prompt + answer, len(prompt)


def sft_batch(examples: list[tuple[list[int], int]], pad_id: int):
    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, (seq, plen) in enumerate(examples):
        ids[i, :len(seq)] = torch.tensor(seq)
        mask[i, :len(seq)] = 1
        labels[i, plen:len(seq)] = torch.tensor(seq[plen:])
    return ids, mask, labels


def warm_start(base_dir: str, out_dir: str, rows: list[dict], max_steps: int, batch_size: int, lr: float,
               seed: int, target: float, check_rows: list[dict], check_every: int = 5,
               max_new_tokens: int = 12) -> dict:
    """Supervised fine-tune of base_dir on rows until the greedy score on check_rows (training prompts,
    not the held-out set) reaches target, checked every check_every steps, or max_steps; writes out_dir
    (model + tokenizer). Reversal is learnt in a sudden jump whose step moves with the data order, so a
    target, not a step count, is what makes the starting point of both RL runs comparable across seeds."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    rng = random.Random(seed)
    tokenizer = AutoTokenizer.from_pretrained(base_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(base_dir, local_files_only=True, dtype=torch.float32)
    examples = [sft_example(tokenizer, r) for r in rows]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    started, losses, score, step = time.perf_counter(), [], 0.0, 0
    while step < max_steps and score < target:
        ids, mask, labels = sft_batch(rng.sample(examples, batch_size), tokenizer.pad_token_id)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        step += 1
        if step % check_every == 0:
            score = greedy_eval(model, tokenizer, check_rows, max_new_tokens)
    model.eval()
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    tail = losses[-check_every:]
    return {"steps": step, "batch_size": batch_size, "lr": lr, "target": target, "train_check_reward": score,
            "seconds": round(time.perf_counter() - started, 2), "final_loss": round(sum(tail) / len(tail), 4)}


@torch.no_grad()
def greedy_eval(model, tokenizer, rows: list[dict], max_new_tokens: int, batch_size: int = 64) -> float:
    """Mean exact_match of greedy answers to rows (the held-out set)."""
    was_training = model.training
    model.eval()
    pad = tokenizer.pad_token_id
    total = 0.0
    for start in range(0, len(rows), batch_size):
        chunk = rows[start:start + batch_size]
        prompts = [encode_prompt(tokenizer, r["prompt"]) for r in chunk]
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left padding
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=pad)
        texts = tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
        total += sum(exact_match(t, r["label"]) for t, r in zip(texts, chunk))
    if was_training:
        model.train()
    return total / len(rows)
