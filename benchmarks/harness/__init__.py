"""The benchmarks' harness, one job per module:

- ``settings``: what one configuration is (the model's shape, each algorithm's settings);
- ``arguments``: the options the side-by-side scripts share, their ``--dry-run``, the choice of sides;
- ``fixtures``: what every side is given alike (the model folder, prompts, DPO's pairs, GRPO's reward);
- ``sides``: what a side does first in its process (threads, seed, loading its models);
- ``processes``: each side in a fresh process, alternating rounds, the result line;
- ``measure``: memory, clocks and the phases our library marks (``rlhf_lightning.utils.timing``);
- ``flops``: analytic FLOPs and this machine's matmul throughput;
- ``tables``: the summaries and tables the scripts print;
- ``profiler``: torch.profiler over one iteration.

The scripts (``benchmarks/*.py``) import it as ``harness`` (their folder is first on ``sys.path`` when run as
``python benchmarks/<script>.py``). Importing it makes the process offline: nothing may come from a model hub.
"""

import os

# Before anything imports the hub clients or wandb, which read these once; every side's process inherits them.
os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="disabled",
                  TOKENIZERS_PARALLELISM="false")
