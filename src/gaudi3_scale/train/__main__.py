"""`python -m gaudi3_scale.train …` (what torchrun and `gaudi3 train --nproc-per-node N` start in every rank): one
training process, `train.worker`."""

import sys

from gaudi3_scale.distributed.launch import stop_with_launcher
from gaudi3_scale.process_exit import skip_exit_collection

# First, before the slow imports: a launcher that dies from here on takes this rank with it (SIGTERM); and the
# exit skips the final garbage collections, after every atexit hook the imports below register.
stop_with_launcher()
skip_exit_collection()

from gaudi3_scale.train.worker import main  # noqa: E402

main(sys.argv[1:])
