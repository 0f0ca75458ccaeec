"""A reward module that fails as it is imported (tests/corpus/scenarios/byo_reward_fn_import_fails.yaml)."""

raise RuntimeError("no reward service reachable")
