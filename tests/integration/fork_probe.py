"""What a child of the fork server sees, for tests/integration/test_fork_server.py: ``main([OUT, CODE, WAIT])``
writes its facts to OUT as JSON, then exits with CODE (or, when WAIT is "wait", waits for a signal)."""

from __future__ import annotations

import json
import os
import signal
import sys


def main(argv: list[str]) -> None:
    out, code, wait = argv
    preloaded = "transformers" in sys.modules  # before this module imports anything heavy itself
    import torch

    torch.set_num_threads(2)
    product = torch.ones(512, 512) @ torch.ones(512, 512)  # an OpenMP parallel region: hangs in a bad fork
    facts = {"pid": os.getpid(), "ppid": os.getppid(), "preloaded": preloaded, "env": dict(os.environ),
             "rand": torch.rand(4).tolist(), "product": float(product[0, 0]),
             "comm": open("/proc/self/comm").read().strip()}
    with open(out + ".tmp", "w") as f:
        json.dump(facts, f)
    os.rename(out + ".tmp", out)
    if wait == "wait":
        signal.pause()  # the test kills this process
    raise SystemExit(int(code))
