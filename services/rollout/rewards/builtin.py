"""Built-in rewards, computed in-process:

exact_match   1.0 when the stripped response equals the stripped label, else 0.0
math_answer   1.0 when the final answer equals the label as a number, else 0.0. The final answer is
              the content of the LAST balanced \\boxed{...}, or else the last number in the response.
              Numbers: 42, -3, 3.50, .5, 1,000 (thousands separators), $3.50, 7/2, \\frac{7}{2}.
arith         the verifier of demo:arith: math_answer against the row's "label"
letters       the verifier of demo:letters: the fraction of the response's letters that are in the
              row's "letters" (continuous, so even a random model's samples differ in reward)"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Callable

from services.run_contract.prompt_source import PromptRecord
from services.rollout.rewards.errors import RewardError
from services.rollout.rewards.reward_function import RewardFunction, finite_reward

_NUMBER = re.compile(
    r"""
    (?<![\w./])                                  # starts a token: not inside a word or another number
    (?P<sign>[-+])?\$?
    (?P<num>\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)
    (?:/(?P<den>\d+))?                           # a simple fraction a/b
    (?!\d)
""",
    re.X,
)
_FRAC = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")
_BOXED = re.compile(r"\\boxed\s*\{")


def normalise_latex(text: str) -> str:
    """The LaTeX spellings of numbers, in plain form: \\frac{a}{b} -> a/b, \\$ -> $, 1{,}000 -> 1,000,
    and thin spaces (1\\,000) dropped."""
    text = text.replace("\\$", "$").replace("{,}", ",")
    for space in ("\\!", "\\,", "\\;"):
        text = text.replace(space, "")
    return _FRAC.sub(lambda m: f"{m.group(1).strip()}/{m.group(2).strip()}", text)


def _value(match: re.Match) -> Fraction | None:
    value = Fraction(match.group("num").replace(",", ""))  # Fraction("3.50") is exact: 7/2
    if match.group("den") is not None:
        den = Fraction(match.group("den"))
        if den == 0:
            return None
        value /= den
    return -value if match.group("sign") == "-" else value


def parse_number(text: str) -> Fraction | None:
    """text as an exact number if all of it is one number (see the module doc), else None."""
    match = _NUMBER.fullmatch(normalise_latex(text).strip().rstrip("."))
    return _value(match) if match else None


def last_number(text: str) -> Fraction | None:
    for match in reversed(list(_NUMBER.finditer(normalise_latex(text)))):
        value = _value(match)
        if value is not None:
            return value
    return None


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} whose braces balance (a generation cut off inside the
    last box falls back to an earlier one)."""
    for match in reversed(list(_BOXED.finditer(text))):
        depth, start = 1, match.end()
        for i in range(start, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i]
    return None


def final_answer(response: str) -> Fraction | None:
    boxed = last_boxed(response)
    if boxed is not None:
        value = parse_number(boxed)
        return value if value is not None else last_number(boxed)  # e.g. \boxed{x = 5}
    return last_number(response)


def exact_match(response: str, label: str) -> float:
    return 1.0 if response.strip() == str(label).strip() else 0.0


def math_answer(response: str, label) -> float:
    expected = parse_number(str(label)) if not isinstance(label, bool) else None
    if expected is None:
        raise RewardError(f"math_answer: the label {label!r} is not a number")
    return 1.0 if final_answer(response) == expected else 0.0


def letters(response: str, allowed: str) -> float:
    allowed_set = set(allowed.lower())
    used = [c for c in response.lower() if c.isalpha()]
    if not used:
        return 0.0
    return sum(c in allowed_set for c in used) / len(used)


def field(fields: dict, name: str, reward: str):
    if name not in fields or fields[name] is None:
        raise RewardError(f"reward {reward} needs the field {name!r}; the row has {sorted(fields)}")
    return fields[name]


def _letters_field(fields: dict) -> str:
    value = field(fields, "letters", "letters")
    if not isinstance(value, str) or not value:
        raise RewardError(f"reward letters: the field 'letters' must be a non-empty string, got {value!r}")
    return value


# name -> scorer(response, fields, label_field); the demo verifiers read their task's own fields
BUILTIN_REWARDS: dict[str, Callable[[str, dict, str], float]] = {
    "exact_match": lambda response, fields, label_field: exact_match(
        response, field(fields, label_field, "exact_match")
    ),
    "math_answer": lambda response, fields, label_field: math_answer(
        response, field(fields, label_field, "math_answer")
    ),
    "arith": lambda response, fields, label_field: math_answer(response, field(fields, "label", "arith")),
    "letters": lambda response, fields, label_field: letters(response, _letters_field(fields)),
}


class BuiltinReward(RewardFunction):
    """A BUILTIN_REWARDS scorer; cheap, so it runs inline on the event loop."""

    def __init__(self, name: str, label_field: str = "label"):
        if name not in BUILTIN_REWARDS:
            raise ValueError(f"unknown built-in reward {name!r}; known: {', '.join(sorted(BUILTIN_REWARDS))}")
        self.name = name
        self.label_field = label_field
        self._scorer = BUILTIN_REWARDS[name]

    async def score(self, record: PromptRecord, response: str) -> float:
        return finite_reward(self._scorer(response, record.fields, self.label_field), f"reward {self.name}")
