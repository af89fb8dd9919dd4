"""What `rollout.agent` may name, checked without the rollout (the preflight, the CLI) and loaded by it:
`import:package.module:function`, a function called as fn(sample, client), or the http(s) URL of an environment
service that plays episodes (services/rollout/agents.py)."""

from __future__ import annotations

from typing import Callable
from urllib.parse import urlsplit

from services.run_contract.imported_functions import check_import, import_function

FORM = "import:package.module:function or an http(s) URL of an environment service"


def load_agent(path: str) -> Callable:
    """'package.module:function' -> the callable, checked to take (sample, client)."""
    return import_function(path, "agent", ({}, None), "(sample, client)")


def check_agent_spec(spec: str | None) -> str | None:
    """What is wrong with `spec`, or None. Importing it runs its module's top level."""
    if spec is None:
        return None
    if spec.startswith(("http://", "https://")):
        return None if urlsplit(spec).hostname else f"agent URL {spec!r} names no host"
    if not spec.startswith("import:"):
        return f"agent {spec!r} must be {FORM}"
    return check_import(spec, "agent", load_agent)
