"""The front door: `sluice run run.yaml` (one YAML for a whole run on this machine), the live view, and the
thin REST subcommands (`sluice submit|status|pause|resume|stop|logs`). Infrastructure: it starts roles as
processes (services/launch) and talks to the coordinator through its client, never importing a role."""
