"""An example reward for deploy/run.yaml (`reward: import:my_reward:score`): the deployments mount this folder at
/rewards and put it on the rollout's PYTHONPATH. Replace it with your own verifier."""


def score(response: str, fields: dict, prompt) -> float:
    """1.0 when the row's label appears in the response, else 0.0."""
    return 1.0 if str(fields.get("label", "")).strip() in response else 0.0
