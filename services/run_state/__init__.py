"""Run state that roles keep in Redis beside the data plane: the rollout's prompt ledger and the
trainer's progress. Keys live under `sluice:<run_id>:` (the namespace is the run contract's:
services/run_contract/run_keys.py)."""

from services.run_contract.run_keys import run_key as run_key
