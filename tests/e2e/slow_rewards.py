"""A reward that takes its time, named by import path in test_elastic_engines.py
(import:tests.e2e.slow_rewards:letters_slowly): a tiny model's steps take tens of milliseconds, too few for a test
to act between two of them; a reward call of SLEEP_S makes each step last long enough to pause the run at it."""

import time

from services.rollout.rewards.builtin import letters

SLEEP_S = 0.5


def letters_slowly(response, fields, prompt):
    """demo:letters' verifier, after SLEEP_S."""
    time.sleep(SLEEP_S)
    return letters(response, fields["letters"])
