"""The advantage role (CPU): advantages and returns for whole prompt groups."""
