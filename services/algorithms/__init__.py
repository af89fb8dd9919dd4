"""RL algorithms as pure torch functions: advantage estimators (`advantages`) and loss terms (`policy_loss`)."""
