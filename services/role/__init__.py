"""The role kit: what every role service (rollout, forward, advantage, trainer) runs inside. The host
(role_service.py: settings, the status endpoint, preflight, the bridge from SIGTERM and the run's end to the
loop's stop flag), the run's lifecycle watch (run_watch.py), and the role's session with the run (session.py),
which the host opens and the role's loop is given. It sits above the coordinator's client and the run state,
below the roles (docs/architecture.md, the tiers)."""
