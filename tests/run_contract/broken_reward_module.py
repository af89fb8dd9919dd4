"""A reward module whose top level raises (test_preflight.py imports it through a reward spec)."""

raise RuntimeError("this module cannot be imported")
