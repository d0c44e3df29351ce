"""Nothing lost to a crash: the reward server killed mid-fit stops the fit with one line naming the failed
iteration and the checkpoint of the one before (written then, though the config checkpoints far less often); the
server restarted and the same command resumed with ``--ckpt_path last`` continues as the uninterrupted run, bit
for bit."""

from __future__ import annotations

import socket

import pytest
import torch

from tests.helpers.preemption import COMMON, ONLINE, REPO, assert_same_training, drive, run
from tests.helpers.reward_server import start

RARELY = {"class_path": "rlhf_lightning.callbacks.IterationCheckpoint",  # never due in a 4-iteration run
          "init_args": {"every_n_iterations": 100, "save_last": True, "enable_version_counter": False}}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.slow
def test_a_reward_server_killed_mid_fit_loses_nothing(tiny_model_dir, reward_dir, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    arguments = ["--config", str(REPO / "configs" / "grpo.yaml"), f"--model.init_args.base.name_or_path={tiny_model_dir}",
                 f"--model.init_args.reward={{class_path: rlhf_lightning.RemoteReward, init_args: {{url: {url}, "
                 "retries: 0, retry_for: 0}}", "--trainer.limit_train_batches=4", "--trainer.limit_val_batches=0",
                 "--validate_at_start.enabled=false", *COMMON, *ONLINE]
    server, _ = start(tmp_path, tiny_model_dir, reward_dir, port=port)
    try:
        full = drive(tmp_path, "full", [run(tmp_path, "full", arguments, RARELY)])
        assert full.returncode == 0, full.stderr[-4000:]
        stop = {"class_path": "tests.helpers.reward_server.StopServerAt",
                "init_args": {"pid": server.pid, "iteration": 2}}
        crashed = drive(tmp_path, "crashed", [run(tmp_path, "crashed", arguments, RARELY, stop)])
        server.wait(timeout=30)
    finally:
        server.kill()
    assert crashed.returncode == 1, crashed.stderr[-4000:]
    checkpoint = tmp_path / "crashed" / "checkpoints" / "last.ckpt"
    errors = [line for line in crashed.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: RemoteReward {url}/score: connection refused or host unreachable (is the server "
        f"running?) (1 try, timeout 60s each) (iteration 3 failed; the run up to iteration 2 is saved in "
        f"{checkpoint}: fix the cause, then run the same command with --ckpt_path last)"]
    assert torch.load(checkpoint, weights_only=False)["global_step"] == 4  # 2 iterations x 2 optimizer steps
    server, _ = start(tmp_path, tiny_model_dir, reward_dir, port=port)  # the server is back
    try:
        resumed = drive(tmp_path, "resumed", [run(tmp_path, "crashed", arguments, RARELY, resume=True)])
    finally:
        server.kill()
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert_same_training(torch.load(tmp_path / "full.pt"), torch.load(tmp_path / "crashed.pt"), from_batch=3,
                         steps_per_batch=2)
