"""``python -m rlhf_lightning serve-reward``: a reward source served over HTTP (FastAPI + uvicorn), and what its
client :class:`~rlhf_lightning.rewards.remote.RemoteReward` and it agree on (:mod:`rlhf_lightning.rewards.remote_protocol`)."""
