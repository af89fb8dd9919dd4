"""The run id a run file names: its top-level `name` (the RunConfig's name, which is the id every service of the
run works under). A deployment mounts the same run file (a ConfigMap in Kubernetes, a bind mount under compose)
into every role service (`--run-file`) and has `sluice submit` post it, so the run's id and its configuration
come from one place."""

from __future__ import annotations

import re

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
