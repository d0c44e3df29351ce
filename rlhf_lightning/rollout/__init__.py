"""Drawing tokens, one job: the sampler (``sampler``: settings ``settings``, seeds ``seeds``, the engine and its caches,
the sharded base's gathering), the engines behind one interface (``engines``: our decoder ``decode``, ``generate``,
vLLM ``vllm_engine``), and the turn loop every rollout runs (``rollouts``; single-turn = one turn without an
environment) with an episode's tokens (``episodes``)."""
