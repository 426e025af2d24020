"""`python -m gaudi3_scale.train …` (what torchrun launches) is `gaudi3 train …`."""

import sys

from gaudi3_scale.cli.main import main

main(["train", *sys.argv[1:]])
