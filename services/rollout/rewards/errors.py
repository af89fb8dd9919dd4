"""The one error a reward function raises, so the rollout loop has one thing to catch."""


class RewardError(RuntimeError):
    """A reward could not be computed for a sample: the function failed, returned something that is
    not a finite number, or the remote endpoint refused or kept failing."""
