from rlhf_lightning.cli import main

main()
