"""The `trl` system of benchmarks/time_to_reward.py: trl.GRPOTrainer on CPU in one process, float32, no
gradient checkpointing, generation every step (on-policy), the benchmark's hyper-parameters mapped onto
GRPOConfig (loss_type "dapo" is the token mean over the global batch; beta 0 is no KL). A step-end callback
records the step's time and writes the checkpoints every --eval-every steps (save_checkpoint, as the Sluice
trainer); they are scored afterwards (ttr_summary.evaluate)."""

from __future__ import annotations

import os
import time

import torch

from services.demo_tasks.warm_start import encode_prompt
from services.rollout.rewards.builtin import exact_match
from services.run_contract.checkpoint import checkpoints, save_checkpoint
from ttr_summary import evaluate
from warm_start import chat_messages


def run_trl(args, warm_dir: str, train_rows: list[dict], eval_rows: list[dict], workdir: str, tokenizer,
            log) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    ckpt_dir = os.path.join(workdir, "checkpoints")
    rec = {"t0": None, "step_end": {}, "reward": {}}

    class Recorder(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            if rec["t0"] is None:
                rec["t0"] = time.monotonic()

        def on_step_end(self, a, state, control, model=None, optimizer=None, **kw):
            step = state.global_step
            if step % args.eval_every == 0:  # as the Sluice trainer's checkpoint_interval
                save_checkpoint(ckpt_dir, "actor", model, optimizer, warm_dir, step, step, keep=1 << 30)
            rec["step_end"][step] = time.monotonic() - rec["t0"]

        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                rec["reward"][state.global_step] = float(logs["reward"])

    def reward(prompts, completions, label, **kw):
        return [exact_match(c[0]["content"] if isinstance(c, list) else c, y) for c, y in zip(completions, label)]

    started = time.monotonic()
    rows = args.groups * args.n_samples
    config = GRPOConfig(
        output_dir=os.path.join(workdir, "trl"), per_device_train_batch_size=args.micro_batch_size,
        gradient_accumulation_steps=rows // args.micro_batch_size, num_generations=args.n_samples,
        max_completion_length=args.max_new_tokens, temperature=args.temperature, top_p=1.0, top_k=0,
        learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=0.999, max_grad_norm=1.0, beta=0.0, epsilon=0.2, num_iterations=1,
        loss_type="dapo", scale_rewards="group", max_steps=args.steps, logging_steps=1, save_strategy="no",
        report_to="none", use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False, seed=args.seed,
        disable_tqdm=True, dataloader_num_workers=0, remove_unused_columns=False)
    model = AutoModelForCausalLM.from_pretrained(warm_dir, local_files_only=True, dtype=torch.float32)
    data = Dataset.from_list([{"prompt": chat_messages(r["prompt"]), "label": r["label"]} for r in train_rows])
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=data,
                          processing_class=tokenizer, callbacks=[Recorder()])
    check_same_prompt_ids(trainer, tokenizer, train_rows[0]["prompt"])
    trainer.train()
    startup = rec["t0"] - started
    snaps = {c.next_step: c.path for c in checkpoints(ckpt_dir, "actor")}
    log(f"trl: {args.steps} steps in {max(rec['step_end'].values()):.1f}s; evaluating {len(snaps)} checkpoints")
    evals = evaluate(snaps, tokenizer, eval_rows, args.max_new_tokens)
    return {"step_end": rec["step_end"], "train_reward": rec["reward"], "eval_reward": evals, "startup_s": startup}


def check_same_prompt_ids(trainer, tokenizer, prompt: str) -> None:
    """TRL's tokenization of the chat prompt must give the rollout role's ids."""
    ids, _, _ = trainer._tokenize_prompts([chat_messages(prompt)])
    if [int(t) for t in ids[0]] != encode_prompt(tokenizer, prompt):
        raise RuntimeError("TRL and the Sluice rollout encode the prompt differently")
