"""The forward role: per-token log-probs of the responses under its weights (actor_fwd: the current
policy; reference: the reference policy)."""
