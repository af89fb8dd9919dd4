"""The PPO critic: a value head on the policy's backbone (transformers' *ForTokenClassification with
one label, initialised from the run's model). V at response token t is read at the position that
predicts token t, like the log-probs (services/model/response_batch.py)."""

from __future__ import annotations

import torch

from services.algorithms.policy_loss import value_loss
from services.run_contract.run_config import RunConfig
from services.model.loading import check_model_dir
from services.model.response_batch import ResponseBatch
from services.trainer.actor_update import StepMetrics, micro_batches, pad
from services.trainer.precision import autocast
from services.transferqueue.codec import Batch


def load_critic(directory: str, dtype=torch.float32):
    from transformers import AutoModelForTokenClassification

    check_model_dir(directory, tokenizer=False)  # a clear error naming the directory and the missing file
    return AutoModelForTokenClassification.from_pretrained(directory, num_labels=1, dtype=dtype, local_files_only=True)


def response_values(critic, rb: ResponseBatch) -> torch.Tensor:
    out = critic(input_ids=rb.input_ids, attention_mask=rb.attention_mask)
    return rb.gather_response(out.logits)[..., 0].float()


def critic_step(
    critic, optimizer, batch: Batch, run: RunConfig, micro_batch_size: int, device: str = "cpu", precision: str = "fp32"
) -> StepMetrics:
    """One optimizer step of the value model over `batch`; bf16-mixed runs its forward under bfloat16 autocast
    (its values, and so the loss, are float32: response_values)."""
    masks = batch["loss_mask"]
    total_tokens = float(sum(float(m.sum()) for m in masks))
    metrics = StepMetrics()
    critic.train()
    optimizer.zero_grad(set_to_none=True)
    for sl, rb, mask in micro_batches(batch, micro_batch_size, device):
        width = rb.mask.shape[1]
        with autocast(precision, device):
            values = response_values(critic, rb)
        loss, m = value_loss(
            values,
            pad(batch["values"][sl], width).to(device),
            pad(batch["returns"][sl], width).to(device),
            mask,
            clip=run.algorithm.value_clip,
            loss_agg=run.algorithm.loss_agg,
            total_tokens=total_tokens,
            total_seqs=float(len(masks)),
        )
        loss.backward()
        metrics.add(m, float(mask.sum()))
        metrics.loss += float(loss.detach())
    metrics.grad_norm = float(torch.nn.utils.clip_grad_norm_(critic.parameters(), run.optim.grad_clip))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return metrics
