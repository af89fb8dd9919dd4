"""User functions named by import path in a run config (`import:package.module:function`): a reward, an agent."""

from __future__ import annotations

import importlib
import inspect
from typing import Callable


def import_function(path: str, what: str, example_args: tuple, takes: str) -> Callable:
    """'package.module:function' (or 'package.module:Class.method') -> the callable, checked to accept
    `example_args` (`takes` names them in the error). ValueError naming `what` when it cannot be had."""
    module_name, sep, attr_path = path.partition(":")
    if not sep or not module_name or not attr_path:
        raise ValueError(f"{what} import path must look like module.path:function, got {path!r}")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{what} import:{path}: cannot import module {module_name!r}: {e}") from e
    for attr in attr_path.split("."):
        if not hasattr(obj, attr):
            raise ValueError(f"{what} import:{path}: {module_name!r} has no attribute {attr_path!r}")
        obj = getattr(obj, attr)
    if not callable(obj):
        raise ValueError(f"{what} import:{path}: {attr_path!r} is a {type(obj).__name__}, not a function")
    try:
        inspect.signature(obj).bind(*example_args)
    except TypeError as e:
        raise ValueError(f"{what} import:{path}: the function must take {takes}: {e}") from None
    except ValueError:
        pass  # no signature to inspect (some builtins): find out at the first call
    return obj


def check_import(spec: str, what: str, load: Callable[[str], Callable]) -> str | None:
    """What is wrong with an `import:` spec, or None. Importing it runs its module's top level."""
    try:
        load(spec[len("import:") :])
    except ValueError as e:
        return str(e)
    except Exception as e:  # the module's own top level raised
        return f"{what} {spec}: importing it raised {type(e).__name__}: {e}"
    return None
