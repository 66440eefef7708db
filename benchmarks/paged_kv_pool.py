"""A paged-attention decode step's time against the size of the KV pool (issue 37).

    python benchmarks/paged_kv_pool.py [--pools 4096,32768] [--pages 1,16] [--batch 16]

One decode step of one layer as SGLang's and vLLM's backends run it on "tpu": the step's keys
and values written into the pool (``torch.tpu.ops.kv_cache_update_``) and
``torch.tpu.ops.ragged_paged_attention`` over it, for ``--batch`` sequences of ~300 tokens
(a page table of 512 positions), heads 8/4, head dim 32, float32 (the tiny Llama of
benchmarks/sglang_serving.py). Pools of 4096 and 32768 slots, in pages of 1 (SGLang's page
size) and 16 (vLLM's block size); eager (two programs) and compiled (``torch.compile``, the
pool donated). Median ms per step (each timed repeat ends with ``torch.tpu.synchronize()``)
and the ratio largest / smallest pool: the work is the same, so the target is ~1.0x. (Before
the KV write scattered into the 4-D pool itself, a page size of 1 made XLA copy the whole
pool at every write: 1.0x -> ~8x here, SGLang's decode step 15 ms -> 81 ms.)
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Table, Timer, environment  # noqa: E402

import torchtpu  # noqa: E402,F401

HQ, HKV, D, WIDTH = 8, 4, 32, 512


def _inputs(slots_n, page, batch, seed=0):
    g = torch.Generator().manual_seed(seed)
    pages = slots_n // page + 1
    kv = torch.randn(pages, page, 2 * HKV, D, generator=g)
    q = torch.randn(batch, HQ, D, generator=g)
    k, v = torch.randn(batch, HKV, D, generator=g), torch.randn(batch, HKV, D, generator=g)
    pps = WIDTH // page
    table = torch.randint(0, pages, (batch, pps), generator=g, dtype=torch.int32)
    lens = torch.full((batch,), 300, dtype=torch.int32)
    last = lens - 1
    slots = table[torch.arange(batch), last // page] * page + last % page
    cu = torch.arange(batch + 1, dtype=torch.int32)
    ns = torch.tensor([batch], dtype=torch.int32)
    return [t.to("tpu") for t in (kv, q, k, v, slots, lens, table, cu, ns)]


def step(kv, q, k, v, slots, lens, table, cu, ns):
    torch.tpu.ops.kv_cache_update_(kv, k, v, slots)
    return torch.tpu.ops.ragged_paged_attention(q, kv, lens, table, cu, ns, sm_scale=D ** -0.5)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pools", default="4096,32768")
    ap.add_argument("--pages", default="1,16")
    ap.add_argument("--batch", type=int, default=16)
    a = ap.parse_args()
    pools = [int(x) for x in a.pools.split(",")]
    timer = Timer(warmup=3, repeats=7, min_repeat_s=0.05)
    compiled = torch.compile(step, backend="tpu", fullgraph=True)
    cols = [f"pool {p}" for p in pools]
    table = Table(f"paged decode step, one layer, batch {a.batch}: ms per step "
                  f"(load {os.getloadavg()[0]:.1f})", cols, unit="ms")
    for page in (int(x) for x in a.pages.split(",")):
        for name, fn in (("eager", step), ("compiled", compiled)):
            row = {}
            for pool, col in zip(pools, cols):
                args = _inputs(pool, page, a.batch)
                row[col] = timer.measure(lambda: fn(*args), sync=torch.tpu.synchronize).us / 1e3
            table.add(f"page {page}, {name}", row)
    table.notes.append(timer.noise_note())
    table.notes.append(environment())
    table.notes.append(f"load after: {os.getloadavg()}")
    table.print(ratios=[(cols[-1], cols[0])])


if __name__ == "__main__":
    main()
