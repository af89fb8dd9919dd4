"""Starting a whole Sluice run on one machine as real processes (tests, the demo, benchmarks)."""
