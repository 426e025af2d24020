"""`python -m gaudi3_scale.train …` (what torchrun launches) is `gaudi3 train …`."""

import sys

from gaudi3_scale.distributed.launch import stop_with_launcher

# First, before the slow imports: a launcher that dies from here on takes this rank with it (SIGTERM).
stop_with_launcher()

from gaudi3_scale.cli.main import main  # noqa: E402

main(["train", *sys.argv[1:]])
