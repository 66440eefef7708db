"""Run a dist_scripts script on N ranks with torch.multiprocessing.spawn (no torchrun).

Usage: spawn_launch.py NPROCS PORT SCRIPT [ARGS...]. Each rank sets the env:// variables and
calls SCRIPT's main() with ARGS as its command line.
"""
from __future__ import annotations

import importlib.util
import os
import sys

import torch.multiprocessing as mp


def worker(rank, nprocs, port, script, args):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nprocs),
                      LOCAL_WORLD_SIZE=str(nprocs), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    spec = importlib.util.spec_from_file_location("dist_script", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    sys.argv = [script] + list(args)
    mod.main()


if __name__ == "__main__":
    n, port, script = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    mp.spawn(worker, args=(n, port, script, sys.argv[4:]), nprocs=n, join=True)
