"""``python -m rlhf_lightning serve-reward`` (``command``): a reward source served over HTTP (FastAPI + uvicorn; ``app``),
concurrent requests scored together (``batching``) by the served source (``scoring``). Its client is
:class:`~rlhf_lightning.rewards.remote.RemoteReward`; what both agree on is
:mod:`rlhf_lightning.rewards.remote_protocol`."""
