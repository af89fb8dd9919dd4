"""One YAML file for a run: the RunConfig every service reads from the coordinator, plus a `stack:` section
for what `sluice run` starts on this machine. Loading validates with pydantic; every problem names the key
path and its place in the file, e.g. `run.yaml:12:5: rollout.max_new_tokens: Input should be greater than
or equal to 1`. Relative paths (model, prompts, directories) are relative to the file's own directory."""

from __future__ import annotations

import os
from typing import Any, Literal, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from services.run_contract.run_config import RunConfig

Scalar = Union[bool, int, float, str]
ROLE_NAMES = ("trainer", "rollout", "advantage", "critic", "actor_fwd", "reference")
# flags `sluice run` sets on every engine itself
_ENGINE_FLAGS_SET_BY_STACK = ("model", "host", "port")


def check_builtin_engine_flags(flags: dict[str, Scalar]) -> dict[str, Scalar]:
    """flags, if each is a `sluice engine` flag the stack does not set itself and takes its value; else
    ValueError naming what is wrong."""
    from services.engine.config import EngineConfig  # the engine is infrastructure, not a role

    for name in flags:
        if name not in EngineConfig.model_fields or name in _ENGINE_FLAGS_SET_BY_STACK:
            known = sorted(set(EngineConfig.model_fields) - set(_ENGINE_FLAGS_SET_BY_STACK))
            raise ValueError(f"{name!r} is not an engine flag one can set here; one of: {', '.join(known)}")
    try:
        EngineConfig(model="-", **flags)  # type: ignore[arg-type]  # each flag's own type is what is checked here
    except ValidationError as exc:
        raise ValueError("; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())) from None
    return flags


class JudgeEngineSettings(BaseModel):
    """A built-in engine that `sluice run` starts as the judge of rollout.reward model:judge: its own service,
    never one of the run's engines, so the trainer never updates its weights."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(
        None,
        min_length=1,
        max_length=1024,
        description=(
            "the judge's model directory: a built-in engine serving it starts as the service `judge` "
            "(<log_dir>/judge.log) and rollout.reward must be model:judge; null = no judge engine"
        ),
    )
    engine_flags: dict[str, Scalar] = Field(
        default_factory=dict,
        description=(
            "its `sluice engine` flags by field name, as engine_flags for a built-in engine, e.g. {device: cuda}"
        ),
    )

    @field_validator("engine_flags")
    @classmethod
    def _flags(cls, flags: dict[str, Scalar]) -> dict[str, Scalar]:
        return check_builtin_engine_flags(flags)


class StackSettings(BaseModel):
    """What `sluice run` starts on this machine (not part of the run the coordinator stores)."""

    model_config = ConfigDict(extra="forbid")

    engine: Literal["builtin", "sglang"] = Field(
        "builtin",
        description=(
            "builtin: `sluice engine` processes; sglang: real SGLang servers (`python -m sglang.launch_server`, "
            "SGLang installed in the Python that runs `sluice run`; docs/gpu.md)"
        ),
    )
    engines: int = Field(
        1,
        ge=1,
        le=64,
        description=(
            "engine processes: built-in engines, or SGLang servers (server i on GPUs from base_gpu_id + i x tp_size)"
        ),
    )
    engine_flags: dict[str, Scalar] = Field(
        default_factory=dict,
        description=(
            "extra engine flags by field name: `sluice engine`'s, e.g. {max_total_tokens: 8192, device: cuda}; "
            "with engine: sglang, SGLang's server flags, e.g. {dtype: bfloat16, mem_fraction_static: 0.5} "
            "(SGLang checks them when it starts)"
        ),
    )
    # Literal of the names' tuple: pydantic reads it, mypy does not
    role_flags: dict[Literal[ROLE_NAMES], dict[str, Scalar]] = Field(  # type: ignore[valid-type]
        default_factory=dict, description="extra flags per role service, e.g. {trainer: {pause_mode: abort}}"
    )
    trainer_ranks: int = Field(1, ge=1, le=64, description="data-parallel trainer processes")
    redis_url: str | None = Field(
        None,
        max_length=1024,
        description=(
            "an existing Redis to keep the run's state in (a password it requires: env SLUICE_REDIS_PASSWORD_FILE or "
            "SLUICE_REDIS_PASSWORD, never in the URL); null = start a private redis-server with an append-only file "
            "under <run dir>/redis and a password made for the run, in <run dir>/redis-password"
        ),
    )
    coordinator_port: int = Field(
        7300,
        ge=0,
        le=65535,
        description=(
            "the coordinator's HTTP port on 127.0.0.1 (where `sluice status|pause|stop` look by default); "
            "0 = any free port (printed at start, and in <run dir>/stack.json)"
        ),
    )
    output_dir: str = Field(
        "runs",
        min_length=1,
        max_length=1024,
        description=(
            "the run's files go to <output_dir>/<name> (its run dir): logs, checkpoints, stack.json, and the "
            "trainer's steps.jsonl and tracking files (the input of `sluice report`)"
        ),
    )
    log_dir: str = Field("", max_length=1024, description="every service's log file; empty = <run dir>/logs")
    checkpoint_dir: str = Field(
        "",
        max_length=1024,
        description=(
            "trainer checkpoints (written every checkpoint.interval steps, continued by --resume); "
            "empty = <run dir>/checkpoints"
        ),
    )
    init_model: Literal["tiny", "small"] | None = Field(
        None,
        description=(
            "write a random model of this preset at `model` when that directory does not exist yet "
            "(demos, smoke tests); null = `model` must exist"
        ),
    )

    judge: JudgeEngineSettings = Field(
        default_factory=JudgeEngineSettings,
        description=("a judge engine for rollout.reward model:judge (docs/rewards.md)"),
    )

    @field_validator("engine_flags")
    @classmethod
    def _engine_flags_exist(cls, flags: dict[str, Scalar], info: ValidationInfo) -> dict[str, Scalar]:
        if info.data.get("engine") == "sglang":  # SGLang's own flags: named here, checked by SGLang at start
            from services.launch.sglang_flags import check_sglang_flags

            check_sglang_flags(flags)
            return flags
        return check_builtin_engine_flags(flags)


class RunFile(RunConfig):
    """A run file: every RunConfig field at the top level, and `stack:`."""

    stack: StackSettings = Field(default_factory=StackSettings, description="what `sluice run` starts locally")

    @model_validator(mode="after")
    def _judge_used(self) -> "RunFile":
        named = "judge_urls" in self.stack.role_flags.get("rollout", {})  # the operator names judges himself
        if self.stack.judge.model is not None and self.rollout.reward != "model:judge":
            raise ValueError(
                f"stack.judge.model starts a judge engine, which only rollout.reward model:judge uses "
                f"(rollout.reward is {self.rollout.reward!r})"
            )
        if self.rollout.reward == "model:judge" and self.stack.judge.model is None and not named:
            raise ValueError(
                "rollout.reward model:judge needs the stack's judge engine: set stack.judge.model to "
                "the judge's model directory"
            )
        return self

    def judge_argv(self) -> tuple[str, ...]:
        return tuple(a for name, value in self.stack.judge.engine_flags.items() for a in _flag(name, value))

    @model_validator(mode="after")
    def _lora_fits_the_engines(self) -> "RunFile":
        if self.trainer.lora is not None and self.stack.engine == "sglang":
            from services.launch.sglang_flags import lora_problem  # the launcher's own refusal, named once

            problem = lora_problem(self.trainer.lora.target_modules)
            if problem:
                raise ValueError(f"stack.engine sglang: {problem}")
        return self

    def run_config(self) -> RunConfig:
        return RunConfig.model_validate(self.model_dump(exclude={"stack"}))

    def directories(self) -> dict[str, str]:
        """run, log and checkpoint directories, absolute."""
        run_dir = os.path.abspath(os.path.join(self.stack.output_dir, self.name))
        return {
            "run": run_dir,
            "logs": os.path.abspath(self.stack.log_dir or os.path.join(run_dir, "logs")),
            "checkpoints": os.path.abspath(self.stack.checkpoint_dir or os.path.join(run_dir, "checkpoints")),
        }

    def engine_argv(self) -> tuple[str, ...]:
        if self.stack.engine == "sglang":  # SGLang's bools are store_true flags, with no --no-x form
            from services.launch.sglang_flags import render

            return tuple(render(self.stack.engine_flags))
        return tuple(a for name, value in self.stack.engine_flags.items() for a in _flag(name, value))

    def role_argv(self) -> dict[str, list[str]]:
        """Each role's extra flags; the trainer writes its run files (steps.jsonl, tracking) to the run dir."""
        argv = {
            role: [a for name, value in flags.items() for a in _flag(name, value)]
            for role, flags in self.stack.role_flags.items()
        }
        argv["trainer"] = ["--output-dir", os.path.abspath(self.stack.output_dir), *argv.get("trainer", [])]
        return argv


def _flag(name: str, value: Scalar) -> list[str]:
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):  # the services' bool flags are --x / --no-x
        return [flag if value else "--no-" + name.replace("_", "-")]
    return [flag, str(value)]


class RunFileError(ValueError):
    """A run file that cannot be used; `problems` are `file:line:col: key.path: message` lines."""

    def __init__(self, problems: list[str]):
        super().__init__("\n".join(problems))
        self.problems = problems


def load_run_file(path: str) -> RunFile:
    """Parse and validate a run file; relative paths become relative to the file's directory."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise RunFileError([f"{path}: cannot read the run file: {exc.strerror or exc}"]) from exc
    return parse_run_file(text, path)


def parse_run_file(text: str, path: str = "run.yaml") -> RunFile:
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else path
        raise RunFileError([f"{where}: not valid YAML: {getattr(exc, 'problem', None) or exc}"]) from exc
    if not isinstance(data, dict):
        raise RunFileError([f"{path}:1:1: the run file must be a mapping of settings (name: ..., model: ...)"])
    duplicates = list(_duplicate_keys(root, path, ()))
    if duplicates:
        raise RunFileError(duplicates)
    try:
        run_file = RunFile.model_validate(data)
    except ValidationError as exc:
        raise RunFileError(_problems(exc, root, path)) from exc
    return _resolved(run_file, os.path.dirname(os.path.abspath(path)))


def _resolved(run_file: RunFile, base: str) -> RunFile:
    def rel(p: str) -> str:
        return p if not p or os.path.isabs(p) else os.path.normpath(os.path.join(base, p))

    update: dict[str, Any] = {"model": rel(run_file.model)}
    for section in ("rollout", "eval"):  # prompt files; demo:<task> stays as it is
        settings = getattr(run_file, section, None)
        prompts = getattr(settings, "prompts", None)
        if prompts and not prompts.startswith("demo:") and settings is not None:
            update[section] = settings.model_copy(update={"prompts": rel(prompts)})
    stack = run_file.stack
    judge = stack.judge.model_copy(update={"model": stack.judge.model and rel(stack.judge.model)})
    update["stack"] = stack.model_copy(
        update={
            "output_dir": rel(stack.output_dir),
            "log_dir": rel(stack.log_dir),
            "checkpoint_dir": rel(stack.checkpoint_dir),
            "judge": judge,
        }
    )
    return run_file.model_copy(update=update)


def _duplicate_keys(node, path: str, at: tuple):
    if isinstance(node, yaml.MappingNode):
        seen = set()
        for key, value in node.value:
            name = key.value if isinstance(key, yaml.ScalarNode) else None
            if name in seen:
                yield f"{_where(path, key)}: {_dotted((*at, name))}: duplicate key (it is given twice)"
            seen.add(name)
            yield from _duplicate_keys(value, path, (*at, name))
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            yield from _duplicate_keys(item, path, (*at, i))


def _problems(exc: ValidationError, root, path: str) -> list[str]:
    problems = []
    for error in exc.errors(include_url=False):
        node, loc = _locate(root, error["loc"], error["type"])
        message = "unknown key" if error["type"] == "extra_forbidden" else error["msg"]
        line = f"{_where(path, node)}: {_dotted(loc) or '(top level)'}: {message}"
        if line not in problems:
            problems.append(line)
    return problems


def _locate(node, loc: tuple, error_type: str):
    """The YAML node of a pydantic error location (the key's node, or the enclosing mapping for a missing
    key), and the key path (union member tags such as 'int' are left out)."""
    found: list = []
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            match = next(
                ((k, v) for k, v in node.value if isinstance(k, yaml.ScalarNode) and k.value == str(part)), None
            )
            if match is None:
                if error_type == "missing":
                    found.append(part)
                break
            found.append(part)
            node = match[0] if len(found) == len(loc) else match[1]  # a problem's key, or the way down
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            found.append(part)
            node = node.value[part]
        else:
            break
    return node, tuple(found)


def _where(path: str, node) -> str:
    mark = node.start_mark
    return f"{path}:{mark.line + 1}:{mark.column + 1}"


def _dotted(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def position_of(path: str, dotted_key: str) -> str:
    """`file:line:col` of a dotted key (the nearest enclosing key that is in the file), for problems found
    after loading (the preflight checks); just the file when it cannot be read."""
    try:
        with open(path, encoding="utf-8") as f:
            root = yaml.compose(f.read(), Loader=yaml.SafeLoader)
    except (OSError, yaml.YAMLError):
        return path
    if root is None:
        return path
    node, _ = _locate(root, tuple(dotted_key.split(".")), "")
    return _where(path, node)
