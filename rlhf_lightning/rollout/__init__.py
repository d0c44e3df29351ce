"""Drawing tokens and running episodes: the sampler (``sampler``: its settings ``settings``, seeds ``seeds``, the
engine and its caches, the sharded base's gathering, which DPO's precomputed reference uses too), the engines behind
one interface (``engines``: our decoder ``decode``, ``generate``, vLLM ``vllm_engine``, with what vLLM's engines
share in ``vllm_support``), and the rollouts (``rollouts``): one draw per prompt without an environment, or
episodes, whose turns go through an environment's tools and answers (``episodes``: an episode's tokens)."""
