"""The run file's reference, generated from the pydantic models so it cannot drift from them: the commented
starting file `sluice run --print-defaults` writes, and docs/configuration.md (`python -m
services.front_door.config_reference > docs/configuration.md`; a test fails when the committed doc is stale)."""

from __future__ import annotations

import sys
import types
import typing
from typing import Iterator

import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined, to_jsonable_python

from services.front_door.run_file import RunFile

# required fields have no default: the starting file gets these, the doc says "required"
PLACEHOLDERS = {"name": "my-run", "model": "model", "buffer": 32}
STARTER_OVERRIDES = {("stack", "init_model"): "tiny"}  # so the starting file runs as it is

DOC_HEADER = """# Configuration: the run file

One YAML file describes a run: every field of the run (what the coordinator stores and every service
reads) at the top level, and a `stack:` section for what `sluice run` starts on this machine.

```bash
sluice run --print-defaults > run.yaml   # a complete, commented starting file
sluice run run.yaml                      # validate, check, start every service, follow the run
```

Relative paths (`model`, `rollout.prompts`, `eval.prompts`, the `stack` directories, `stack.judge.model`) are
relative to the file's own directory, and the module of an `import:` reward may sit beside the file (`sluice run` puts
that directory on the services' `PYTHONPATH`). A file with a problem is rejected before anything starts, each problem naming the place and
the key, e.g. `run.yaml:12:5: rollout.max_new_tokens: Input should be greater than or equal to 1`;
unknown keys are errors, not ignored.

This page is generated from the pydantic models (`services/front_door/config_reference.py`); after
changing a field, run `python -m services.front_door.config_reference > docs/configuration.md`.
"""


def _type_name(annotation) -> str:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:  # a constrained type (e.g. a module name): the type it constrains
        return _type_name(args[0])
    if origin is typing.Literal:
        return " \\| ".join(repr(a) if not isinstance(a, str) else a for a in args)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join("null" if a is type(None) else _type_name(a) for a in args)
    if origin in (list, tuple, dict):
        inner = ", ".join("..." if a is Ellipsis else _type_name(a) for a in args)
        return f"{origin.__name__}[{inner}]"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    return getattr(annotation, "__name__", str(annotation))


_BOUNDS = (
    ("ge", ">="),
    ("gt", ">"),
    ("le", "<="),
    ("lt", "<"),
    ("min_length", "length >="),
    ("max_length", "length <="),
    ("pattern", "matches"),
)


def _limits(field) -> str:
    """The field's constraints, e.g. `>= 1, <= 64` (from its Field(ge=..., le=...) metadata)."""
    found = []
    for item in field.metadata:
        for attr, sign in _BOUNDS:
            value = getattr(item, attr, None)
            if value is not None:
                found.append(f"{sign} `{value}`")
    return ", ".join(found)


def _section(annotation) -> type[BaseModel] | None:
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _optional_section(annotation) -> type[BaseModel] | None:
    """The section of an `X | None` field (off by default, e.g. trainer.lora): its fields are listed too."""
    if typing.get_origin(annotation) not in (typing.Union, types.UnionType):
        return None
    found = [a for a in typing.get_args(annotation) if _section(a) is not None]
    return found[0] if len(found) == 1 else None


def _default(field):
    if field.default_factory is not None:
        value = field.default_factory()
        return value.model_dump(mode="json") if isinstance(value, BaseModel) else value
    return PydanticUndefined if field.is_required() else field.default


def _fields(model: type[BaseModel], at: tuple = ()) -> Iterator[tuple[tuple, FieldInfo, type[BaseModel] | None]]:
    """(key path, field, sub-model or None) in declaration order, depth first."""
    for name, field in model.model_fields.items():
        sub = _section(field.annotation) or _optional_section(field.annotation)
        yield (*at, name), field, sub
        if sub is not None:
            yield from _fields(sub, (*at, name))


def _yaml_scalar(value) -> str:
    text = yaml.safe_dump(to_jsonable_python(value), default_flow_style=True, width=1000).strip()
    return text.removesuffix("...").strip()


def defaults_yaml() -> str:
    """A complete, commented run file: every field at its default (placeholders where one is required)."""
    lines = ["# A Sluice run file (docs/configuration.md lists every field). `sluice run THIS_FILE` runs it.", ""]
    off: list[tuple] = []  # optional sections, null by default: their fields are shown commented out
    for key, field, sub in _fields(RunFile):
        indent = "  " * (len(key) - 1)
        inside = next((len(o) for o in off if key[: len(o)] == o), None)
        if inside is not None:  # "#" at the section's own indent, so uncommenting the block gives valid YAML
            indent = "  " * (inside - 1) + "# " + "  " * (len(key) - inside)
        if field.description:
            lines.append(f"{indent}# {field.description}")
        if sub is not None and _default(field) is None:
            lines += [f"{indent}{key[-1]}: null", f"{indent}# {key[-1]}:  (set it: these fields, at their defaults)"]
            off.append(key)
            continue
        if sub is not None:
            lines.append(f"{indent}{key[-1]}:")
            continue
        value = STARTER_OVERRIDES.get(key, _default(field))
        if value is PydanticUndefined:
            value = PLACEHOLDERS[key[-1]]
        lines.append(f"{indent}{key[-1]}: {_yaml_scalar(value)}")
    return "\n".join(lines) + "\n"


def configuration_markdown() -> str:
    """docs/configuration.md: one table per section, every field with its type, default and meaning."""
    out = [DOC_HEADER]
    sections: dict[tuple, list[str]] = {}
    for key, field, sub in _fields(RunFile):
        rows = sections.setdefault(key[:-1], [])
        default = _default(field)
        shown = "required" if default is PydanticUndefined else f"`{_yaml_scalar(default)}`"
        if sub is not None:
            shown = ("`null`: " if default is None else "") + f"see `{'.'.join(key)}` below"
        meaning = (field.description or "").replace("|", "\\|").replace("<", "&lt;").replace("\n", " ")
        limits = _limits(field).replace("|", "\\|")
        kind = _type_name(field.annotation) + (f" ({limits})" if limits else "")
        rows.append(f"| `{key[-1]}` | {kind} | {shown.replace('|', chr(92) + '|')} | {meaning} |")
    for at, rows in sections.items():
        title = "Top level" if not at else f"`{'.'.join(at)}`"
        out += [f"## {title}", "", "| key | type | default | meaning |", "|---|---|---|---|", *rows, ""]
    return "\n".join(out)


if __name__ == "__main__":
    sys.stdout.write(configuration_markdown())
