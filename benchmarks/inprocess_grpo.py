"""The `inprocess` system of benchmarks/time_to_reward.py: GRPO without Sluice, the strongest way a user would
run it by hand, a plain synchronous (on-policy) loop in ONE process, one model, no services:

    torch.manual_seed(seed); model = warm start (float32); AdamW(lr, betas 0.9/0.999, no weight decay; fused, as the trainer's)
    for step in 1..steps:                                  # the clock starts at step 1's generation
        prompts = the step's --groups prompts, in the rollout role's order (PromptSource, shuffle_seed=seed)
        samples = generate --n-samples per prompt at --temperature, --max-new-tokens, EOS stops
                  (with each sampled token's log-prob, log_softmax(logits / T))
        reward  = the task's score(decoded response, row fields)          # as the rollout scores it
        adv     = grpo_advantages(reward, n), on every response token      # the advantage role's estimator
        actor_step(model, optimizer, batch, run, micro_batch_size)         # the Sluice trainer's loss code:
                  clip 0.2, no KL, token-mean over the step, grad clip 1.0, ONE optimizer step
        [engine] copy the new weights into the engine's model (in memory)
        step time = now; every --eval-every steps save_checkpoint (model + optimizer), scored afterwards

On-policy: the samples come from the weights being trained, so actor_step's PPO ratio is 1 (the clip never
bites, up to float noise between the generator's and the trainer's forward). Two generators:
  hf      transformers `model.generate` of the trained model object itself (no copy: eval() around generate),
          the whole step's prompts in one left-padded batch, num_return_sequences=n, KV cache, output_logits.
  engine  the built-in engine's Scheduler + BatchedDecoder as a library in this process (as
          benchmarks/engine_profile.py builds it), stepped by hand; its own float32 copy of the model, which
          follows the trained one after every optimizer step (services/dcs/sync/precision.load_into of the
          named parameters, inside the timed step); per-sample seeds as the rollout role gives them.
Torch intra-op threads: --inprocess-threads (set for the run with torch.set_num_threads, which sets OpenMP's
and MKL's thread counts too; restored after). The reward is the task's (benchmarks/ttr_tasks.py), called inline."""

from __future__ import annotations

import os
import statistics
import time

import torch

from services.algorithms.advantages import grpo_advantages
from services.dcs.sync.precision import load_into
from services.demo_tasks.warm_start import encode_prompt, left_padded
from services.model.loading import load_causal_lm
from services.run_contract.prompt_source import open_prompt_source
from services.run_contract.checkpoint import checkpoints, save_checkpoint
from services.run_contract.run_config import RunConfig
from services.trainer.actor_update import actor_step
from services.trainer.optimizer import adamw
from services.transferqueue.codec import Batch
from ttr_summary import evaluate
from warm_start import Score

Sample = tuple[list[int], list[float]]  # (response ids, EOS included if it stopped; their log-probs)


def hf_samples(model, tokenizer, prompts: list[list[int]], run: RunConfig) -> list[Sample]:
    """n samples per prompt (rows [i*n, (i+1)*n) are prompt i) from transformers' generate, one batch."""
    r, n = run.rollout, run.n_samples_per_prompt
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    ids, mask = left_padded(prompts, pad)
    width = ids.shape[1]
    model.eval()
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=True,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=0 if r.top_k < 0 else r.top_k,
        max_new_tokens=r.max_new_tokens,
        num_return_sequences=n,
        eos_token_id=eos,
        pad_token_id=pad,
        use_cache=True,
        return_dict_in_generate=True,
        output_logits=True,
    )
    model.train()
    generated = out.sequences[:, width:]
    logits = torch.stack(out.logits, dim=1).float() / r.temperature  # [B*n, steps, V], raw before processors
    chosen = torch.log_softmax(logits, dim=-1).gather(-1, generated.unsqueeze(-1)).squeeze(-1)
    samples = []
    for row, lps in zip(generated.tolist(), chosen.tolist()):
        length = row.index(eos) + 1 if eos in row else len(row)
        samples.append((row[:length], lps[:length]))
    return samples


class EngineGenerator:
    """The built-in engine's scheduler in this process, on its own copy of the model."""

    def __init__(self, model_dir: str, tokenizer, rows: int):
        from services.engine.config import EngineConfig
        from services.engine.server import make_pool, make_scheduler
        from services.engine.batched_decoder import BatchedDecoder

        self.model, _ = load_causal_lm(model_dir, "float32")
        config = EngineConfig(model="(in-process)", max_running=max(64, rows))
        self.scheduler = make_scheduler(BatchedDecoder(self.model, make_pool(self.model, config)), tokenizer, config)

    def follow(self, trained) -> None:
        """The trained weights into the engine's model, as the engine's weight update loads them."""
        load_into(self.model, {name: p.detach() for name, p in trained.named_parameters()})

    def samples(self, prompts: list[list[int]], positions: list[int], run: RunConfig) -> list[Sample]:
        from services.engine.request import Generation, share_prompts
        from services.engine.sampling import SamplingParams

        r, n = run.rollout, run.n_samples_per_prompt
        params = SamplingParams(
            max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k
        )
        gens = []
        for prompt, position in zip(prompts, positions):
            seed = run.optim.seed * 1_000_003 + position * 4099  # the rollout role's per-sample seeds
            gens += [
                Generation(
                    rid=f"{position}-{k}",
                    prompt=list(prompt),
                    params=params,
                    on_update=lambda g: None,
                    generator=torch.Generator().manual_seed(seed + k),
                )
                for k in range(n)
            ]
        sched = self.scheduler
        for group in share_prompts(gens):
            sched.submit(group)
        while sched.waiting or sched.running:
            sched.step()
        return [(list(g.output), list(g.logprobs)) for g in gens]


def step_batch(prompts: list[list[int]], samples: list[Sample], rewards: list[float], n: int) -> Batch:
    """The rows actor_step reads, as the trainer claims them (the rollout's and advantage role's columns)."""
    advantages = grpo_advantages(torch.tensor(rewards, dtype=torch.float32), n)
    prompt_of = [prompts[i // n] for i in range(len(samples))]
    return Batch(
        partition="inprocess",
        rows=list(range(len(samples))),
        columns={
            "tokens": [torch.tensor(p + ids, dtype=torch.int64) for p, (ids, _) in zip(prompt_of, samples)],
            "prompt_length": torch.tensor([len(p) for p in prompt_of], dtype=torch.int64),
            "response_length": torch.tensor([len(ids) for ids, _ in samples], dtype=torch.int64),
            "loss_mask": [torch.ones(len(ids)) for ids, _ in samples],
            "rollout_log_probs": [torch.tensor(lps, dtype=torch.float32) for _, lps in samples],
            "advantages": [torch.full((len(ids),), float(a)) for (ids, _), a in zip(samples, advantages)],
        },
    )


def train_loop(model, optimizer, gen, tokenizer, source, run: RunConfig, ckpt_dir: str, t: dict, score: Score) -> dict:
    """The timed loop (see the module docstring); t["t0"] is set at step 1's generation."""
    n, groups = run.n_samples_per_prompt, run.rollout_batch_size
    rec = {
        "step_end": {},
        "train_reward": {},
        "gen_s": [],
        "train_s": [],
        "sync_s": [],
        "response_tokens": [],
        "on_policy": [],
    }
    t["t0"] = time.monotonic()
    for step in range(1, run.num_steps + 1):
        began = time.monotonic()
        records = [source.record((step - 1) * groups + g) for g in range(groups)]
        prompts = [encode_prompt(tokenizer, r.prompt) for r in records]
        if gen is None:
            samples = hf_samples(model, tokenizer, prompts, run)
        else:
            samples = gen.samples(prompts, [r.position for r in records], run)
        texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids, _ in samples]
        rewards = [score(text, records[i // n].fields) for i, text in enumerate(texts)]
        generated = time.monotonic()
        metrics = actor_step(model, optimizer, step_batch(prompts, samples, rewards, n), run, run.micro_batch_size)
        trained = time.monotonic()
        if gen is not None:
            gen.follow(model)
        rec["step_end"][step] = time.monotonic() - t["t0"]
        rec["gen_s"].append(generated - began)
        rec["train_s"].append(trained - generated)
        rec["sync_s"].append(time.monotonic() - trained)
        rec["train_reward"][step] = sum(rewards) / len(rewards)
        rec["response_tokens"].append(sum(len(ids) for ids, _ in samples) / len(samples))
        m = metrics.means()
        rec["on_policy"].append(
            {k: m.get(k, 0.0) for k in ("clip_fraction", "ratio_max", "rollout_logprob_abs_diff", "approx_kl")}
        )
        if step % run.checkpoint_interval == 0:  # as the Sluice trainer: after the step is recorded
            save_checkpoint(ckpt_dir, "actor", model, optimizer, run.model, step, step, keep=1 << 30)
    return rec


def run_inprocess(
    run: RunConfig, generator: str, threads: int, eval_rows: list[dict], workdir: str, tokenizer, log, score: Score
) -> dict:
    """One run of the in-process loop: the raw dict time_to_reward.one_rep summarises."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        started = time.monotonic()
        torch.manual_seed(run.optim.seed)  # as the trainer; the hf generator samples from this stream
        model, _ = load_causal_lm(run.model, "float32")
        optimizer = adamw(model.parameters(), run.optim.lr, run.optim.betas, run.optim.weight_decay, "cpu")
        gen = EngineGenerator(run.model, tokenizer, run.global_batch_size) if generator == "engine" else None
        source = open_prompt_source(run.rollout.prompts, run.rollout.prompt_field, run.rollout.shuffle_seed)
        ckpt_dir, t = os.path.join(workdir, "checkpoints"), {}
        in_effect = torch.get_num_threads()  # torch.set_num_threads sets OpenMP's and MKL's too
        rec = train_loop(model, optimizer, gen, tokenizer, source, run, ckpt_dir, t, score)
    finally:
        torch.set_num_threads(previous)
    snaps = {c.next_step: c.path for c in checkpoints(ckpt_dir, "actor")}
    log(
        f"inprocess_{generator}: {run.num_steps} steps in {rec['step_end'][run.num_steps]:.1f}s "
        f"(median per step: generate {statistics.median(rec['gen_s']):.3f}s, "
        f"train {statistics.median(rec['train_s']):.3f}s); evaluating {len(snaps)} checkpoints"
    )
    evals = evaluate(snaps, tokenizer, eval_rows, run.rollout.max_new_tokens, score)
    med = {
        f"median_{k}": round(statistics.median(rec[k]), 4) for k in ("gen_s", "train_s", "sync_s", "response_tokens")
    }
    on_policy = {
        "first_step": {k: round(v, 6) for k, v in rec["on_policy"][0].items()},
        "max_clip_fraction": round(max(m["clip_fraction"] for m in rec["on_policy"]), 6),
        "max_ratio": round(max(m["ratio_max"] for m in rec["on_policy"]), 6),
    }
    return {
        "step_end": rec["step_end"],
        "train_reward": rec["train_reward"],
        "eval_reward": evals,
        "startup_s": t["t0"] - started,
        "generator": generator,
        "torch_threads": in_effect,
        "per_step": med,
        "on_policy": on_policy,
    }
