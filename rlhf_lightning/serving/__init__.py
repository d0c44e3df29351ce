"""``python -m rlhf_lightning serve-reward``: a reward source served over HTTP (FastAPI + uvicorn): the command
(``command``), the HTTP face (``app``) behind its token, body and load limits (``guard``), the scoring of checked
rows (``scoring``) and concurrent requests scored together (``batching``). Its client is
:class:`~rlhf_lightning.rewards.remote.RemoteReward`; what both agree on is
:mod:`rlhf_lightning.rewards.remote_protocol`."""
