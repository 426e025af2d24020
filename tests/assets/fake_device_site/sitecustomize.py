"""Loaded by every Python process started with this directory on PYTHONPATH (tests/integration/test_tune.py): the
process trains on a fake asynchronous device (tests/fake_device.py semantics, re-stated here because this file
must stand alone). A training forward of our Transformer queues device work that only a synchronise waits for:
FAKE_DEVICE_S_BY_BATCH maps the micro-batch size to seconds, e.g. "4:0.15,2:0.005,1:0.005"."""

import os
import queue
import threading
import time

import torch

import gaudi3_scale.device.sync as device_sync

_SECONDS = {
    int(size): float(seconds)
    for size, seconds in (item.split(":") for item in os.environ["FAKE_DEVICE_S_BY_BATCH"].split(","))
}
_work: "queue.Queue[float]" = queue.Queue()


def _run() -> None:
    while True:
        seconds = _work.get()
        time.sleep(seconds)
        _work.task_done()


def _launch(module, args, output):
    if type(module).__name__ == "Transformer" and module.training:
        _work.put(_SECONDS.get(int(args[0].shape[0]), 0.0))


threading.Thread(target=_run, daemon=True).start()
torch.nn.modules.module.register_module_forward_hook(_launch)
device_sync.SYNCHRONIZERS["cpu"] = lambda device: _work.join()
