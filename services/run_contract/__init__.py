"""The run contract every service shares: the run's configuration (`RunConfig`), the partitions and the
fields each role writes in them, and the checkpoint format. Roles and infrastructure both import it; it
imports no role."""
