"""`python -m gaudi3_scale.cli` is the `gaudi3` command."""

from gaudi3_scale.cli.main import main

main()
