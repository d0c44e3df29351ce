"""Drawing tokens and running episodes: the sampler (settings, seeds, the engine and its caches, the sharded base's
gathering, which DPO's precomputed reference uses too), the engines behind one interface, and the rollouts: one draw
per prompt without an environment, or episodes, whose turns go through an environment's tools and answers
(``rollouts.py``, ``episodes.py``)."""
