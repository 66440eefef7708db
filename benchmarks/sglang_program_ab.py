"""Program or process? The decode programs of SGLang and vLLM on "tpu" run side by side in one
plain process, from their XLA executables captured in the engines' own processes.

    # capture vLLM's most-called program (its decode replay), in its in-process engine
    .venv-vllm/bin/python benchmarks/sglang_program_ab.py capture-vllm OUT_V
    # capture SGLang's (the scheduler's decode replay of sglang_step_split.py)
    .venv-sglang/bin/python benchmarks/sglang_step_split.py --rounds 1 --capture OUT_S
    # time them alternately in one process (any venv with torchtpu: the custom calls)
    .venv-sglang/bin/python benchmarks/sglang_program_ab.py ab OUT_S OUT_V

A capture is the executable of the graph called most often by the engine's process (the
replayed decode bucket), as XLA serialized it, with the inputs of its last call: every
non-donated input's values, the donated ones (the KV caches, rewritten by the call) as zeros
of their shape. ``ab`` loads each, puts its inputs on the device once (donated ones again
before every call, outside the timer), and times calls alternately: wall per call and the CPU
of each thread (from /proc) per call, medians over repeats. The load average is printed.
"""
from __future__ import annotations

import argparse
import collections
import os
import pickle
import runpy
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import thread_cpu  # noqa: E402

_SEEN: dict = {}  # id(graph) -> [calls, graph, entry, arrays spec, donated positions]
_ORIG: list = []  # the method install() replaced


def install():
    """Record, per compiled graph, its call count and its last call's inputs."""
    import numpy as np

    from torchtpu.compile import backend

    orig = backend.CompiledGraph._run_entry

    def run_entry(self, args, arrays, slots, statics, whole, key, donate, bucketed, orig_args):
        spec = [("zeros", a.shape, a.dtype) if i in donate else ("value", a)
                for i, a in enumerate(arrays)]
        if self.n_random:
            spec.append(("zeros", (self.n_random, 4), np.uint32))
        out = orig(self, args, arrays, slots, statics, whole, key, donate, bucketed, orig_args)
        rec = _SEEN.setdefault(id(self), [0, self, None, None, ()])
        rec[0] += 1
        rec[2], rec[3], rec[4] = self._last_entry[2], spec, tuple(donate)
        return out

    backend.CompiledGraph._run_entry = run_entry
    _ORIG.append(orig)


def uninstall():
    """Undo ``install``."""
    from torchtpu.compile import backend

    if _ORIG:
        backend.CompiledGraph._run_entry = _ORIG.pop(0)
        _ORIG.clear()


def dump(out: str) -> str:
    """Write the most-called graph's executable and last inputs to ``out`` (a folder)."""
    import numpy as np
    from jax.experimental.serialize_executable import serialize

    from torchtpu.compile import cache

    calls, graph, entry, spec, donate = max(_SEEN.values(), key=lambda r: r[0])
    compiled = entry.compiled
    payload = None
    for k, v in cache._MEMO.items():  # the bytes XLA serialized right after compiling it
        c = v[0] if isinstance(v, tuple) else v
        if c is compiled and k in cache._PAYLOADS:
            payload = cache._PAYLOADS[k]
    if payload is None:
        payload = serialize(compiled)[0]
    args = [("zeros", s[1], np.dtype(s[2]).str) if s[0] == "zeros"
            else ("value", np.asarray(s[1])) for s in spec]
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "program.pkl"), "wb") as f:
        pickle.dump(dict(payload=payload, in_tree=compiled.in_tree, out_tree=compiled.out_tree,
                         args=args, donate=donate, calls=calls, name=graph.name,
                         python=sys.executable,
                         shapes=[(tuple(np.shape(a[1])) if a[0] == "value" else tuple(a[1]),
                                  str(a[1].dtype) if a[0] == "value" else a[2])
                                 for a in args]), f)
    return out


class _Loaded:
    def __init__(self, folder):
        import jax
        import numpy as np
        from jax.experimental.serialize_executable import deserialize_and_load

        from torchtpu.compile.cache import _custom_calls

        with open(os.path.join(folder, "program.pkl"), "rb") as f:
            d = pickle.load(f)
        self.d = d
        targets = ("torchtpu_cpu_paged_attention",)
        reason = _custom_calls.ready(targets)  # its FFI handler registered in this process
        if reason is not None:
            raise RuntimeError(f"custom call not ready: {reason}")
        self.compiled = deserialize_and_load(d["payload"], d["in_tree"], d["out_tree"])
        dev = jax.devices("cpu")[0]
        self.fixed = {}
        self.zeros = {}
        for i, a in enumerate(d["args"]):
            if a[0] == "value":
                self.fixed[i] = jax.device_put(a[1], dev)
            else:
                self.zeros[i] = np.zeros(a[1], np.dtype(a[2]))
        self.dev = dev

    def first(self):
        """The inputs of a first call: the donated ones as device-owned zeros."""
        import jax.numpy as jnp

        self.cur = {i: jnp.zeros(z.shape, z.dtype) for i, z in self.zeros.items()}
        return self.args()

    def args(self):
        n = len(self.d["args"])
        return [self.fixed[i] if i in self.fixed else self.cur[i] for i in range(n)]

    def call(self, args):
        """One call; the donated inputs' new values (the outputs of their shape, in order,
        as the engines pass them back) become the next call's inputs."""
        import jax

        out = self.compiled(*args)
        jax.block_until_ready(out)
        leaves = jax.tree_util.tree_leaves(out)
        for i in sorted(self.zeros):
            z = self.zeros[i]
            for k, leaf in enumerate(leaves):
                if leaf is not None and leaf.shape == z.shape and leaf.dtype == z.dtype:
                    self.cur[i] = leaf
                    leaves[k] = None
                    break
            else:
                raise RuntimeError("no output for a donated input")
        return out


def time_programs(folders, calls=20, repeats=9):
    """Each captured program loaded in this process and timed, alternately: per folder, the
    median wall per call, its minimum, and the median CPU per call of each thread name; also
    the CPU the other processes of this process's parent used meanwhile (per second of wall)."""
    import torch

    import torchtpu  # noqa: F401 - registers the custom calls the programs name

    torch.zeros(1, device="tpu")  # the backend up, as in the engines
    progs = [_Loaded(f) for f in folders]
    for p in progs:  # warm
        p.first()
        for _ in range(3):
            p.call(p.args())
    wall = collections.defaultdict(list)
    cpu = collections.defaultdict(lambda: collections.defaultdict(list))
    others0, t_all = _others_cpu(), time.perf_counter()
    for _ in range(repeats):
        for j, p in enumerate(progs):
            t0, th0 = time.perf_counter(), thread_cpu()
            for _ in range(calls):
                p.call(p.args())
            dt = (time.perf_counter() - t0) / calls
            th1 = thread_cpu()
            per = collections.Counter()
            for tid, (name, c1) in th1.items():
                per[name] += (c1 - th0.get(tid, (name, 0.0))[1]) / calls
            wall[j].append(dt)
            for name, v in per.items():
                cpu[j][name].append(v)
    span = time.perf_counter() - t_all
    others1 = _others_cpu()
    res = []
    for j, (f, p) in enumerate(zip(folders, progs)):
        d = p.d
        res.append(dict(
            folder=f, python=d["python"], calls=d["calls"], inputs=len(d["args"]),
            donate=list(d["donate"]),
            largest=sorted(d["shapes"], key=lambda s: -_size(s[0]))[:3],
            wall_s=statistics.median(wall[j]), min_s=min(wall[j]),
            cpu_s={k: statistics.median(v) for k, v in cpu[j].items()
                   if statistics.median(v) > 0}))
    return dict(programs=res, load=os.getloadavg(),
                others_cpu_per_s={k: (others1[k][1] - others0.get(k, (None, 0))[1]) / span
                                  for k in others1
                                  if others1[k][1] - others0.get(k, (None, 0))[1] > 0})


def _others_cpu() -> dict:
    """CPU seconds of this process's parent and its other children: {pid: (name, s)}."""
    tick = os.sysconf("SC_CLK_TCK")
    me, parent = os.getpid(), os.getppid()
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == me:
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(pid) == parent or int(fields[1]) == parent:
            name = stat[stat.index("(") + 1:stat.rindex(")")]
            out[f"{pid} {name}"] = (name, (int(fields[11]) + int(fields[12])) / tick)
    return out


def report(r, title):
    print(f"\n## {title}; load {r['load']}\n")
    for p in r["programs"]:
        print(f"{p['folder']}: captured under {p['python']} ({p['calls']} calls there), "
              f"{p['inputs']} inputs, donated {p['donate']}, largest inputs {p['largest']}")
        print(f"  wall {p['wall_s'] * 1e3:.2f} ms per call (min {p['min_s'] * 1e3:.2f}); CPU ms "
              "per call by thread: " + ", ".join(
                  f"{k} {v * 1e3:.2f}" for k, v in sorted(p["cpu_s"].items(),
                                                         key=lambda kv: -kv[1])))
    if r["others_cpu_per_s"]:
        print("  the parent and sibling processes meanwhile, CPU s per s: " + ", ".join(
            f"{k} {v:.2f}" for k, v in r["others_cpu_per_s"].items()))


def ab(folders, calls=20, repeats=9):
    print(f"load: {os.getloadavg()}", flush=True)
    r = time_programs(folders, calls, repeats)
    report(r, f"decode programs side by side in one process ({sys.executable}), {calls} calls "
           f"x {repeats} repeats, alternating")


def _size(shape):
    n = 1
    for s in shape:
        n *= s
    return n


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("capture-vllm")
    c.add_argument("out")
    c.add_argument("--requests", type=int, default=16)
    a2 = sub.add_parser("ab")
    a2.add_argument("folders", nargs="+")
    a2.add_argument("--calls", type=int, default=20)
    a2.add_argument("--repeats", type=int, default=9)
    a = ap.parse_args()
    if a.cmd == "ab":
        ab(a.folders, a.calls, a.repeats)
        return
    os.environ["VLLM_TARGET_DEVICE"] = "tpu"
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.pop("XLA_FLAGS", None)
    install()
    sys.argv = [os.path.join(HERE, "vllm_step_split.py"), "--child", "tpu-compiled",
                str(a.requests), "1", "0", "sglang", "decode"]
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    finally:
        print("captured:", dump(a.out), flush=True)


if __name__ == "__main__":
    main()
