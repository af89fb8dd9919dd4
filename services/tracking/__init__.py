"""Experiment tracking (TensorBoard, W&B offline, MLflow local) and the run report (`sluice report`)."""
