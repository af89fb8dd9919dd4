"""A reward that fails on some prompts, named by import path in test_reward_failures.py
(import:tests.e2e.failing_rewards:letters_unless_a): the rollout process imports it from the repository root."""

from services.rollout.rewards.builtin import letters


def letters_unless_a(response, fields, prompt):
    """demo:letters' verifier, except that it raises on every prompt whose letters include "a" (about 1 in 4)."""
    if "a" in fields["letters"]:
        raise LookupError(f"no verifier for letters {fields['letters']}")
    return letters(response, fields["letters"])


def fails(fields: dict) -> bool:
    return "a" in fields["letters"]


def flat_when_a(response, fields, prompt):
    """0 for every sample of a prompt whose letters include "a" (a group with no variance, which dynamic sampling
    drops); demo:letters' verifier plus a thousandth per character otherwise (samples of a prompt differ)."""
    if fails(fields):
        return 0.0
    return letters(response, fields["letters"]) + len(response) / 1000
