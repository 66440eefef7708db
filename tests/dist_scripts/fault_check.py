"""Fault behaviour of "tpu_dist" (one scenario per launch, 2 ranks).

  dead      rank 1 exits after the first collective; rank 0's next all_reduce must raise a
            RuntimeError naming the group and the collective (prints "RAISED <message>").
  hang      rank 1 stops issuing collectives; rank 0's all_reduce must be reported by the
            watchdog after the group timeout (2 s) and the process exit with code 6.
  mismatch  with TORCHTPU_DIST_CHECK=1, rank 0 calls all_reduce and rank 1 all_gather: both
            must raise a RuntimeError saying the collectives differ (prints "RAISED ...").
  loop      collectives until killed (prints "READY" first): torchrun's SIGTERM must end it.
"""
from __future__ import annotations

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist


def main():
    scenario = sys.argv[1]
    timeout = datetime.timedelta(seconds=float(os.environ.get("FAULT_TIMEOUT", "60")))
    dist.init_process_group("tpu_dist", timeout=timeout)
    rank = dist.get_rank()
    x = torch.ones(4, device="tpu")
    dist.all_reduce(x)
    assert x.cpu().tolist() == [2.0] * 4
    if scenario == "dead":
        if rank == 1:
            os._exit(0)  # no shutdown, no goodbye: as a crashed process
        time.sleep(1)
        t0 = time.monotonic()
        try:
            for _ in range(3):
                dist.all_reduce(x)
                x.cpu()
        except RuntimeError as e:
            print(f"RAISED after {time.monotonic() - t0:.1f}s: {e}", flush=True)
            sys.exit(0)  # a normal exit: must not wait for the dead peer at shutdown
        print("NO ERROR", flush=True)
        os._exit(1)
    if scenario == "hang":
        if rank == 1:
            time.sleep(120)
            os._exit(0)
        print("WAITING", flush=True)
        dist.all_reduce(x)
        x.cpu()
        print("NO TIMEOUT", flush=True)
        os._exit(1)
    if scenario == "mismatch":
        try:
            if rank == 0:
                dist.all_reduce(x)
            else:
                dist.all_gather([torch.empty(4, device="tpu") for _ in range(2)], x)
        except RuntimeError as e:
            print(f"RAISED rank {rank}: {e}", flush=True)
            # rank 0 hosts JAX's coordination service: its exit aborts a peer still running
            # (see docs/ARCHITECTURE.md, a dead peer), so it leaves after both have raised
            store = dist.distributed_c10d._get_default_store()
            if store.add("mismatch_raised", 1) < 2 and rank == 0:
                deadline = time.monotonic() + 60
                while store.add("mismatch_raised", 0) < 2 and time.monotonic() < deadline:
                    time.sleep(0.05)
            os._exit(0)
        print("NO ERROR", flush=True)
        os._exit(1)
    if scenario == "loop":
        print("READY", flush=True)
        while True:
            dist.all_reduce(x)
            x.cpu()
    raise SystemExit(f"unknown scenario {scenario}")


if __name__ == "__main__":
    main()
