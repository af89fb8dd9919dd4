"""The sample's fields in a run's training partition (<run_id>/train_<N>, services/run_contract/partitions.py):
one registry of each field's name, dtype, shape and writer, and the sets each role writes and reads, built from
it. Roles name these sets instead of keeping their own lists; tests/run_contract/test_sample_fields.py checks
that the rollout writes exactly its set, that every consumer reads only what the run's producers write, and that
docs/services.md shows this table."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Literal, Mapping

from services.run_contract.run_config import RunConfig

Writer = Literal["rollout", "actor_fwd", "reference", "critic", "advantage"]


class Per(str, Enum):
    """How many values a field holds for one sample, and so its TransferQueue kind."""

    SAMPLE = "sample"  # one value: a SCALAR column, read as a tensor [n]
    TOKEN = "token"  # one per token of prompt + response: RAGGED, prompt_length + response_length long
    RESPONSE_TOKEN = "response token"  # one per response token: RAGGED, response_length long


@dataclass(frozen=True)
class SampleField:
    name: str
    dtype: str  # a TransferQueue dtype name (docs/transferqueue.md)
    per: Per
    writer: Writer
    meaning: str


FIELDS: tuple[SampleField, ...] = (
    SampleField("tokens", "int64", Per.TOKEN, "rollout", "the prompt's token ids followed by the response's"),
    SampleField("prompt_length", "int64", Per.SAMPLE, "rollout", "tokens of the prompt"),
    SampleField("response_length", "int64", Per.SAMPLE, "rollout", "tokens of the response"),
    SampleField(
        "loss_mask",
        "float32",
        Per.RESPONSE_TOKEN,
        "rollout",
        "1 for a token the model generated and trains on; 0 for tokens inserted between an agent's model "
        "calls, for a cut-off sample under overlong filtering, for an episode's padding copies",
    ),
    SampleField(
        "rollout_log_probs",
        "float32",
        Per.RESPONSE_TOKEN,
        "rollout",
        "the engine's log-probs of the sampled tokens (the behaviour policy mu)",
    ),
    SampleField("reward", "float32", Per.SAMPLE, "rollout", "the sample's reward, with any reward shaping"),
    SampleField(
        "weight_version",
        "int64",
        Per.SAMPLE,
        "rollout",
        "the weight version the sample's generation began under (its staleness counts from it)",
    ),
    SampleField(
        "token_weight_versions",
        "int64",
        Per.RESPONSE_TOKEN,
        "rollout",
        "the weight version that produced each response token",
    ),
    SampleField("prompt_position", "int64", Per.SAMPLE, "rollout", "the prompt's global position in the run"),
    SampleField("sample_index", "int64", Per.SAMPLE, "rollout", "the sample's index in its group, 0..group_rows-1"),
    SampleField("step", "int64", Per.SAMPLE, "rollout", "the step that trains the sample"),
    SampleField(
        "log_probs",
        "float32",
        Per.RESPONSE_TOKEN,
        "actor_fwd",
        "the trainer's weights' log-probs of the response (the proximal policy pi_old)",
    ),
    SampleField(
        "ref_log_probs",
        "float32",
        Per.RESPONSE_TOKEN,
        "reference",
        "the reference model's log-probs of the response (the KL term)",
    ),
    SampleField("values", "float32", Per.RESPONSE_TOKEN, "critic", "the critic's value V at each response token"),
    SampleField("advantages", "float32", Per.RESPONSE_TOKEN, "advantage", "the estimator's advantage per token"),
    SampleField("returns", "float32", Per.RESPONSE_TOKEN, "advantage", "the return per token (the critic's target)"),
)
BY_NAME: dict[str, SampleField] = {f.name: f for f in FIELDS}


def writes(writer: str) -> tuple[str, ...]:
    """The fields `writer` (a Writer) writes, in the registry's order."""
    return tuple(f.name for f in FIELDS if f.writer == writer)


ROLLOUT_FIELDS = writes("rollout")
# what running a model over a sample reads (forward roles, the critic's values)
MODEL_INPUTS = ("tokens", "prompt_length", "response_length")
CRITIC_TRAIN_INPUTS = MODEL_INPUTS + ("loss_mask", "values", "returns")
# what the trainer's leader reads of a whole global batch for its step record when data-parallel ranks split it
STEP_RECORD_INPUTS = ("response_length", "prompt_position", "sample_index", "weight_version", "reward")
RECOVERY_INPUTS = ("prompt_position",)  # the rollout's recovery of groups lost with a storage shard


def kl_in_reward(run: RunConfig) -> bool:
    return run.algorithm.kl_in_reward and run.algorithm.kl_coef > 0


def policy_log_probs(run: RunConfig) -> str:
    """The policy log-probs the trainer's old policy and the reward's KL use: actor_fwd's when it runs."""
    return "log_probs" if run.uses_actor_fwd else "rollout_log_probs"


def advantage_inputs(run: RunConfig) -> tuple[str, ...]:
    """What the advantage role reads: the KL penalty's log-probs when the KL is in the reward, values for ppo."""
    fields: tuple[str, ...] = ("reward", "response_length", "loss_mask")
    if kl_in_reward(run):
        fields += ("ref_log_probs", policy_log_probs(run))
    if run.uses_critic:
        fields += ("values",)
    return fields


def actor_inputs(run: RunConfig) -> tuple[str, ...]:
    """What the actor trains on: log_probs with actor_fwd; ref_log_probs when the KL is a loss term."""
    fields: tuple[str, ...] = MODEL_INPUTS + (
        "loss_mask",
        "rollout_log_probs",
        "advantages",
        "reward",
        "weight_version",
        "prompt_position",
        "sample_index",
    )
    if run.uses_actor_fwd:
        fields += ("log_probs",)
    if run.uses_reference and not run.algorithm.kl_in_reward:
        fields += ("ref_log_probs",)
    return fields


def producers(run: RunConfig) -> dict[Writer, tuple[str, ...]]:
    """The roles that write fields in this run, with what each writes."""
    out: dict[Writer, tuple[str, ...]] = {"rollout": ROLLOUT_FIELDS}
    if run.uses_actor_fwd:
        out["actor_fwd"] = writes("actor_fwd")
    if run.uses_reference:
        out["reference"] = writes("reference")
    if run.uses_critic:
        out["critic"] = writes("critic")
    out["advantage"] = writes("advantage")
    return out


def consumers(run: RunConfig) -> dict[str, tuple[str, ...]]:
    """Each read of the run's samples (by the task or role that reads them), with the fields it needs."""
    out = {
        "actor_train": actor_inputs(run),
        "trainer_step_record": STEP_RECORD_INPUTS,
        "advantage": advantage_inputs(run),
        "rollout_recover": RECOVERY_INPUTS,
    }
    if run.uses_actor_fwd:
        out["actor_fwd"] = MODEL_INPUTS
    if run.uses_reference:
        out["reference"] = MODEL_INPUTS
    if run.uses_critic:
        out["critic_values"] = MODEL_INPUTS
        out["critic_train"] = CRITIC_TRAIN_INPUTS
    return out


def written_fields(run: RunConfig) -> frozenset[str]:
    return frozenset(name for fields in producers(run).values() for name in fields)


def _dtype(value: Any) -> str:
    return str(getattr(value, "dtype", type(value).__name__)).removeprefix("torch.")


def _field_problems(field: SampleField, value: Any, n: int, lengths: dict[str, list[int]]) -> list[str]:
    if field.per is Per.SAMPLE:
        shape = tuple(getattr(value, "shape", ()))
        ok = shape == (n,) and _dtype(value) == field.dtype
        return [] if ok else [f"{field.name}: {_dtype(value)} {shape}, the registry says {field.dtype} ({n},)"]
    if not isinstance(value, (list, tuple)) or len(value) != n:
        return [f"{field.name}: not a list of {n} tensors (one per sample)"]
    out = []
    for i, v in enumerate(value):
        want = lengths["response_length"][i] + (lengths["prompt_length"][i] if field.per is Per.TOKEN else 0)
        if _dtype(v) != field.dtype or tuple(getattr(v, "shape", ())) != (want,):
            out.append(
                f"{field.name}[{i}]: {_dtype(v)} {tuple(getattr(v, 'shape', ()))}, the registry says "
                f"{field.dtype} ({want},): one per {field.per.value}"
            )
    return out


def column_problems(columns: Mapping[str, Any]) -> list[str]:
    """What in `columns` (a put's columns of sample fields, with prompt_length and response_length) disagrees
    with the registry: unknown names, dtypes, and shapes (a SAMPLE field a tensor [n]; a TOKEN or RESPONSE_TOKEN
    field a list of n 1-D tensors, prompt_length + response_length or response_length long); [] when all agree."""
    unknown = [f"{name}: not a sample field" for name in columns if name not in BY_NAME]
    if "prompt_length" not in columns or "response_length" not in columns:
        return unknown + ["the columns lack prompt_length or response_length"]
    lengths = {k: [int(x) for x in columns[k]] for k in ("prompt_length", "response_length")}
    n = len(lengths["response_length"])
    return unknown + [
        p
        for name, value in columns.items()
        if name in BY_NAME
        for p in _field_problems(BY_NAME[name], value, n, lengths)
    ]


def fields_table() -> str:
    """The registry as the markdown table docs/services.md shows."""
    rows = ["| field | dtype | per | written by | meaning |", "|---|---|---|---|---|"]
    rows += [f"| `{f.name}` | {f.dtype} | {f.per.value} | {f.writer} | {f.meaning} |" for f in FIELDS]
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(fields_table(), end="")
