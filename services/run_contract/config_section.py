"""What every section of the run config shares: strict parsing and the bounds its numbers are held to."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

# bounds that keep every number a run config carries finite and within what the services can act on
BIG = 1 << 40  # steps, intervals, versions: more than any run will reach
SEED_MAX = (1 << 63) - 1


class ConfigSection(BaseModel):
    # unknown keys are errors; so are NaN and Infinity (which YAML and Python's JSON both read)
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
