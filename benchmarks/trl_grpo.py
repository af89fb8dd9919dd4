"""The `trl` system of benchmarks/time_to_reward.py: trl.GRPOTrainer on CPU, float32, no gradient
checkpointing, generation every step (on-policy), the benchmark's hyper-parameters mapped onto GRPOConfig
(loss_type "dapo" is the token mean over the global batch; beta 0 is no KL).

TRL at its best on this machine: it runs in its own process (`python benchmarks/trl_grpo.py SPEC.json OUT.json`,
started by run_trl) whose environment gives OpenMP and MKL every core (OMP_NUM_THREADS = MKL_NUM_THREADS =
--trl-threads, default os.cpu_count(), set before torch loads) and which sets torch's intra-op threads to the
same; the count torch reports inside the first step is in the result. The benchmark's own process and the Sluice
services keep one thread each.

A step-end callback records the step's time and writes the checkpoints every --eval-every steps
(save_checkpoint, as the Sluice trainer); the benchmark's process scores them afterwards (ttr_summary.evaluate).
The spec and the result cross the process boundary as JSON (TrlSpec, TrlResult)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from pydantic import BaseModel, Field

HERE = os.path.dirname(os.path.abspath(__file__))


class TrlSpec(BaseModel):
    """One TRL run, as the benchmark's process hands it to the TRL process."""

    task: str
    warm_dir: str
    prompts_path: str  # the training rows, JSONL {"prompt", "label"}: the file the Sluice rollout reads
    workdir: str
    threads: int = Field(ge=1)
    steps: int = Field(ge=1)
    groups: int = Field(ge=1)
    n_samples: int = Field(ge=2)
    micro_batch_size: int = Field(ge=1)
    max_new_tokens: int = Field(ge=1)
    temperature: float = Field(gt=0)
    lr: float = Field(gt=0)
    eval_every: int = Field(ge=1)
    seed: int


class TrlResult(BaseModel):
    step_end: dict[int, float]  # step -> seconds from the first step's start to its end
    train_reward: dict[int, float]  # step -> TRL's logged mean reward
    startup_s: float  # construction until the first step
    torch_threads: int  # torch.get_num_threads() inside the first step
    env_threads: dict[str, str]  # OMP_NUM_THREADS and MKL_NUM_THREADS as this process saw them


def trl_env(threads: int) -> dict[str, str]:
    """The TRL process's environment: OpenMP and MKL on `threads` threads (this process may pin its own)."""
    return {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
    }


def run_trl(spec: TrlSpec, eval_rows: list[dict], tokenizer, score, log) -> dict:
    """Runs the TRL process (its output to our stderr), then scores its checkpoints here: the raw dict
    time_to_reward.one_rep summarises."""
    from services.run_contract.checkpoint import checkpoints
    from ttr_summary import evaluate

    os.makedirs(spec.workdir, exist_ok=True)
    spec_path, out_path = os.path.join(spec.workdir, "trl_spec.json"), os.path.join(spec.workdir, "trl_result.json")
    with open(spec_path, "w") as f:
        f.write(spec.model_dump_json())
    proc = subprocess.Popen(
        [sys.executable, os.path.join(HERE, "trl_grpo.py"), spec_path, out_path],
        env=trl_env(spec.threads),
        stdout=sys.stderr,
        stderr=sys.stderr,
    )
    try:
        rc = proc.wait()
    finally:
        if proc.poll() is None:  # interrupted: the TRL process goes with us
            proc.kill()
            proc.wait()
    if rc != 0:
        raise RuntimeError(f"trl: the TRL process exited with {rc} (its output is above)")
    with open(out_path) as f:
        result = TrlResult.model_validate_json(f.read())
    snaps = {c.next_step: c.path for c in checkpoints(os.path.join(spec.workdir, "checkpoints"), "actor")}
    log(
        f"trl: {spec.steps} steps in {max(result.step_end.values()):.1f}s on {result.torch_threads} torch threads; "
        f"evaluating {len(snaps)} checkpoints"
    )
    evals = evaluate(snaps, tokenizer, eval_rows, spec.max_new_tokens, score)
    return {
        "step_end": result.step_end,
        "train_reward": result.train_reward,
        "eval_reward": evals,
        "startup_s": result.startup_s,
        "torch_threads": result.torch_threads,
        "env_threads": result.env_threads,
    }


# ---------------------------------------------------------------------------------- the TRL process


def grpo_config(spec: TrlSpec):
    from trl import GRPOConfig

    rows = spec.groups * spec.n_samples
    return GRPOConfig(
        output_dir=os.path.join(spec.workdir, "trl"),
        per_device_train_batch_size=spec.micro_batch_size,
        gradient_accumulation_steps=rows // spec.micro_batch_size,
        num_generations=spec.n_samples,
        max_completion_length=spec.max_new_tokens,
        temperature=spec.temperature,
        top_p=1.0,
        top_k=0,
        learning_rate=spec.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        max_grad_norm=1.0,
        beta=0.0,
        epsilon=0.2,
        num_iterations=1,
        loss_type="dapo",
        scale_rewards="group",
        max_steps=spec.steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        seed=spec.seed,
        disable_tqdm=True,
        dataloader_num_workers=0,
        remove_unused_columns=False,
    )


def recorder(spec: TrlSpec, rec: dict):
    """The step-end callback: step times, logged rewards, checkpoints every eval_every steps."""
    import torch
    from transformers import TrainerCallback

    from services.run_contract.checkpoint import save_checkpoint

    ckpt_dir = os.path.join(spec.workdir, "checkpoints")

    class Recorder(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            if rec["t0"] is None:
                rec["t0"] = time.monotonic()
                rec["torch_threads"] = torch.get_num_threads()

        def on_step_end(self, a, state, control, model=None, optimizer=None, **kw):
            step = state.global_step
            if step % spec.eval_every == 0:  # as the Sluice trainer's checkpoint_interval
                save_checkpoint(ckpt_dir, "actor", model, optimizer, spec.warm_dir, step, step, keep=1 << 30)
            rec["step_end"][step] = time.monotonic() - rec["t0"]

        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                rec["reward"][state.global_step] = float(logs["reward"])

    return Recorder()


def train(spec: TrlSpec) -> TrlResult:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOTrainer

    from ttr_tasks import TASKS
    from warm_start import chat_messages

    torch.set_num_threads(spec.threads)
    score = TASKS[spec.task].score
    rec = {"t0": None, "step_end": {}, "reward": {}, "torch_threads": 0}

    def reward(prompts, completions, label, **kw):
        return [score(c[0]["content"] if isinstance(c, list) else c, {"label": y}) for c, y in zip(completions, label)]

    started = time.monotonic()
    with open(spec.prompts_path) as f:
        train_rows = [json.loads(line) for line in f if line.strip()]
    tokenizer = AutoTokenizer.from_pretrained(spec.warm_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(spec.warm_dir, local_files_only=True, dtype=torch.float32)
    data = Dataset.from_list([{"prompt": chat_messages(r["prompt"]), "label": r["label"]} for r in train_rows])
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=grpo_config(spec),
        train_dataset=data,
        processing_class=tokenizer,
        callbacks=[recorder(spec, rec)],
    )
    check_same_prompt_ids(trainer, tokenizer, train_rows[0]["prompt"])
    trainer.train()
    return TrlResult(
        step_end=rec["step_end"],
        train_reward=rec["reward"],
        startup_s=rec["t0"] - started,
        torch_threads=rec["torch_threads"],
        env_threads={k: os.environ.get(k, "") for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")},
    )


def check_same_prompt_ids(trainer, tokenizer, prompt: str) -> None:
    """TRL's tokenization of the chat prompt must give the rollout role's ids."""
    from services.demo_tasks.warm_start import encode_prompt
    from warm_start import chat_messages

    ids, _, _ = trainer._tokenize_prompts([chat_messages(prompt)])
    if [int(t) for t in ids[0]] != encode_prompt(tokenizer, prompt):
        raise RuntimeError("TRL and the Sluice rollout encode the prompt differently")


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: trl_grpo.py SPEC.json OUT.json (started by benchmarks/time_to_reward.py)", file=sys.stderr)
        return 2
    sys.path.insert(1, os.path.dirname(HERE))  # the repository, for `services`
    with open(argv[0]) as f:
        spec = TrlSpec.model_validate_json(f.read())
    result = train(spec)
    with open(argv[1], "w") as f:
        f.write(result.model_dump_json())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
