"""A run file made ready for `sluice run`: loaded and validated, --redis-url applied, its model written when
stack.init_model asks, and checked before anything starts (the preflight: model, prompts, reward, engine, judge
model; a checkpoint of an earlier run is continued only with --resume, which needs one)."""

from __future__ import annotations

import os
import sys

from services.front_door.run_file import RunFile, RunFileError, load_run_file, position_of
from services.run_contract.checkpoint import latest_checkpoint


def prepare(args) -> RunFile:
    """The validated run file, its model written if asked, checked before anything starts."""
    run_file = load_run_file(args.run_file)
    if args.redis_url:
        run_file = run_file.model_copy(
            update={"stack": run_file.stack.model_copy(update={"redis_url": args.redis_url})}
        )
    if run_file.stack.init_model and not os.path.exists(run_file.model):
        from services.model.init_model import init_model  # torch and transformers: only when needed

        init_model(run_file.model, preset=run_file.stack.init_model)
    sys.path.insert(0, run_file_directory(args.run_file))  # the preflight imports an import: reward from there
    problems = [f"{position_of(args.run_file, p.key)}: {p.key}: {p.message}" for p in preflight(run_file)]
    problems += resume_problems(run_file, args)
    if problems:
        raise RunFileError(problems)
    return run_file


def run_file_directory(path: str) -> str:
    """Where a run file's `import:` reward module may be, beside the file (the services get it on PYTHONPATH)."""
    return os.path.dirname(os.path.abspath(path))


def preflight(run_file: RunFile) -> list:
    from services.launch.sglang_flags import sglang_missing
    from services.run_contract.preflight import Problem, check_run  # imports the model loader: only when running

    from services.model.loading import ModelDirError, check_model_dir

    missing = sglang_missing() if run_file.stack.engine == "sglang" else None
    problems = check_run(run_file.run_config()) + ([Problem("stack.engine", missing)] if missing else [])
    if run_file.stack.judge.model is not None:
        try:
            check_model_dir(run_file.stack.judge.model, weights=True, tokenizer=True)
        except ModelDirError as exc:
            problems.append(Problem("stack.judge.model", str(exc)))
    return problems


def resume_problems(run_file: RunFile, args) -> list[str]:
    """A checkpoint is continued only when asked (--resume), and --resume needs one."""
    directory = run_file.directories()["checkpoints"]
    ckpt = latest_checkpoint(directory, "actor") if os.path.isdir(directory) else None
    where = position_of(args.run_file, "stack.checkpoint_dir")
    if ckpt is not None and not args.resume:
        return [
            f"{where}: stack.checkpoint_dir: {directory} holds a checkpoint of an earlier run (next step "
            f"{ckpt.next_step}): add --resume to continue it, or give this run another name or stack.output_dir"
        ]
    if ckpt is None and args.resume:
        return [f"{where}: stack.checkpoint_dir: --resume, but {directory} holds no checkpoint to continue from"]
    return []
