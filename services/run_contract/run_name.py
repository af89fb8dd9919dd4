"""The run id a run file names: its top-level `name` (the RunConfig's name, which is the id every service of the
run works under). A deployment mounts the same run file (a ConfigMap in Kubernetes, a bind mount under compose)
into every role service (`--run-file`) and has `sluice submit` post it, so the run's id and its configuration
come from one place."""

from __future__ import annotations

import re

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings

from services.run_contract.run_config import RunConfig


def run_name_from_file(path: str) -> str:
    """The `name` of the run file at `path`; ValueError naming the file and the problem."""
    import yaml  # only roles started with --run-file need it

    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except OSError as exc:
        raise ValueError(f"run file {path!r} cannot be read: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"run file {path!r} is not valid YAML: {exc}") from None
    name = data.get("name") if isinstance(data, dict) else None
    if not isinstance(name, str):
        raise ValueError(f"run file {path!r} has no top-level `name` (the run id)")
    pattern = next(m.pattern for m in RunConfig.model_fields["name"].metadata if hasattr(m, "pattern"))
    if not re.fullmatch(pattern, name):
        raise ValueError(f"run file {path!r}: name {name!r} does not match {pattern}")
    return name


class RunIdSettings(BaseSettings):
    """The run a service works for: --run-id, or the name in --run-file (a deployment's one run file)."""

    run_id: str = Field("default", description="the run (created on the coordinator) this service works for")
    run_file: str = Field(
        "",
        description="a run YAML (what `sluice submit` posts); its `name` is the run id, "
        "so a deployment takes both from one file; empty = --run-id",
    )

    @model_validator(mode="after")
    def _run_id_from_run_file(self) -> "RunIdSettings":
        if self.run_file:
            name = run_name_from_file(self.run_file)
            if "run_id" in self.model_fields_set and self.run_id != name:
                raise ValueError(f"run_id {self.run_id!r} differs from the name {name!r} in run_file {self.run_file}")
            self.run_id = name
        return self
