import sys

from rlhf_lightning.cli.early import answer_early

status = answer_early(sys.argv[1:])  # a bad config file, plot: answered without the training stack
if status is not None:
    sys.exit(status)
from rlhf_lightning.cli import main  # noqa: E402 - the training stack, only where it is needed

main()
