"""OpenAI's chat and completion API as Sluice speaks it: the request and response bodies (`models`), shared by
the engine's OpenAI-compatible routes and the rollout's per-episode agent endpoint."""
