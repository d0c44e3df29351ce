"""Drawing tokens, one job: the sampler (settings, seeds, the engine and its caches, the sharded base's gathering),
the engines behind one interface, and the turn loop every rollout runs (single-turn = one turn without an
environment)."""
