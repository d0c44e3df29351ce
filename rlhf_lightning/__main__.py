from rlhf_lightning.cli.early import run

run()
