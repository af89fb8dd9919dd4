"""The names of the algorithm choices, written once: the run config's fields are typed with these
Literals and the torch code checks against the same tuples. No torch here, so the coordinator can
validate a run config without importing it."""

from __future__ import annotations

from typing import Literal, get_args

Estimator = Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "ppo"]
KLKind = Literal["k1", "k2", "k3"]
LossAggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]

ESTIMATORS: tuple[str, ...] = get_args(Estimator)
KL_KINDS: tuple[str, ...] = get_args(KLKind)
AGGREGATIONS: tuple[str, ...] = get_args(LossAggregation)
