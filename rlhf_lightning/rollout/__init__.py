"""Drawing tokens and running episodes: the sampler (``sampler``: its settings ``settings``, seeds ``seeds``, the
engine and its caches, the sharded base's gathering, which DPO's precomputed reference uses too), the engines behind
one interface (``engines``: our decoder ``decode``, ``generate``, vLLM in this process ``vllm_engine``, vLLM's own
server ``vllm_server`` with the server process it may start ``vllm_process``, and what vLLM's engines share
``vllm_support``), drawing ahead: the fixed-lag schedule of rollouts drawn by the policy of
``asynchronous.max_staleness`` iterations ago (``ahead``) and the producer that draws them on a thread of its own
while the policy trains (``producer``), and the rollouts (``rollouts``): one draw per prompt without an environment,
or episodes, whose turns go through an environment's tools and answers (``episodes``: an episode's tokens)."""
