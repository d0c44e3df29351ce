from rlhf_lightning.cli.entry import run

run()
