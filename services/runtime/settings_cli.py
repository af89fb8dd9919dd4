"""Build a command line from a pydantic-settings model.

Every field becomes a `--kebab-case` flag; a flag given on the command line wins over the field's
environment variable (`<env_prefix><FIELD_NAME>`), which wins over the default. `--help` lists both.
"""

from __future__ import annotations

import argparse
import types
import typing
from typing import Sequence, TypeVar

from pydantic import ValidationError
from pydantic_settings import BaseSettings

S = TypeVar("S", bound=BaseSettings)


class HelpWithDefaults(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """For hand-written parsers (the front door, init-model, export, report): the description as written,
    and each flag's default after its help."""


def _flag_type(annotation: object):
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _flag_type(args[0]) if len(args) == 1 else str
    if annotation is bool:
        return bool
    if annotation in (int, float, str):
        return annotation
    return str


def build_parser(model: type[S], prog: str, description: str | None) -> argparse.ArgumentParser:
    # no abbreviations: `--auth-token SECRET` must fail, not be taken for --auth-token-file
    parser = argparse.ArgumentParser(prog=prog, description=description, allow_abbrev=False)
    prefix = model.model_config.get("env_prefix", "")
    for name, field in model.model_fields.items():
        flag = "--" + name.replace("_", "-")
        alias = field.validation_alias  # a field with an alias is read from that env var, without the prefix
        env = alias.upper() if isinstance(alias, str) else (prefix + name).upper()
        default = field.get_default(call_default_factory=True)
        help_text = f"{field.description or ''} [env {env}; default {default!r}]"
        kind = _flag_type(field.annotation)
        if kind is bool:
            parser.add_argument(
                flag, dest=name, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=help_text
            )
        else:
            parser.add_argument(flag, dest=name, type=kind, default=argparse.SUPPRESS, help=help_text)
    return parser


def parse_settings(model: type[S], argv: Sequence[str] | None, prog: str, description: str | None) -> S:
    parser = build_parser(model, prog, description)
    given = vars(parser.parse_args(argv))
    try:
        return model(**given)
    except ValidationError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits
