"""The trainer role: the actor (policy updates, weight publishing, checkpoints) and, for PPO, the critic."""
