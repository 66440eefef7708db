"""Warm starts skip aot_autograd: PyTorch's AOTAutogradCache, holding our graphs.

A warm start that hits every XLA cache entry still spends most of its time in aot_autograd
(functionalising and tracing the joint forward+backward graph, then partitioning it). PyTorch
caches aot_autograd's result (the partitioned graphs plus the metadata its runtime wrappers need)
in AOTAutogradCache, keyed by Dynamo's graph and the example inputs' metadata, but only for
backends whose compiled graphs are ``OutputCode`` objects it can pickle. ``GraphCode`` is ours:
it pickles the aten graph (``GraphPickler``, with the FakeTensor metadata the lowering reads)
and rebuilds a ``CompiledGraph`` from it on load; that graph then finds its XLA executable
through the graph-level entry of ``cache.py``, so a warm start neither traces nor compiles.

The entries live in ``<cache dir>/aot/<fingerprint>``: the fingerprint covers torchtpu's own
source (the decompositions and lowerings that shaped the cached graphs) and the backend
options, so a changed torchtpu or option set never reads an older entry. PyTorch's cache
checks what else matters (torch version, the graph, input metadata, configs).
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.machinery
import os
import sys
from unittest import mock

import torch
from torch._inductor.output_code import OutputCode

from ..runtime.metrics import count
from . import cache as _cache


# backend.py's CompiledGraph, which a GraphCode builds; backend.py registers it (it imports this
# module, so this one cannot import it)
_graph_type: list = [None]


def register_graph_type(cls) -> None:
    _graph_type[0] = cls


def _source_fingerprint() -> str:
    from ..runtime.program_cache import source_fingerprint

    return source_fingerprint()[:16]


def entry_dir(opts: dict) -> str | None:
    """Where AOTAutogradCache keeps this option set's entries; None when caching is off."""
    base = _cache.cache_dir()
    if not base or opts.get("persistent_cache", True) is False:
        return None
    h = hashlib.sha256(_source_fingerprint().encode())
    h.update(repr(sorted((str(k), repr(v)) for k, v in opts.items())).encode())
    return os.path.join(base, "aot", h.hexdigest()[:16])


class GraphCode(OutputCode):
    """One forward/backward/inference graph as AOTAutogradCache stores it."""

    def __init__(self, gm: torch.fx.GraphModule, name: str, opts: dict):
        super().__init__()
        self._graph = _graph_type[0](gm, None, name, opts)
        self._name = name
        self._opts = opts
        self._pickled_gm: bytes | None = None
        self._boxed_call = True

    def __call__(self, inputs):
        return self._graph(inputs)

    def prepare_for_serialization(self) -> None:
        # called on a shallow copy that is about to be pickled: keep the graph, drop the rest
        if self._graph is not None:
            self._pickled_gm = _dump_graph(self._graph.low.gm)
            self._graph = None

    def post_compile(self, example_inputs, constants, graph_kwargs) -> None:
        if self._graph is not None:
            return
        from torch._guards import detect_fake_mode
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx._graph_pickler import GraphPickler

        fake_mode = detect_fake_mode(example_inputs) or FakeTensorMode()
        gm = GraphPickler.loads(self._pickled_gm, fake_mode)
        gm.recompile()
        self._graph = _graph_type[0](gm, None, self._name, self._opts)
        count("aot_cache_loads")

    def set_triton_bundle(self, triton_bundle) -> None:
        pass


def _dump_graph(gm: torch.fx.GraphModule) -> bytes:
    """The graph with only the node metadata our lowering reads: every placeholder's "val",
    "val" of nodes that hold no device tensor (host-side values, which ``host_plan`` looks
    for; a node without "val" counts as a device node), and "val" of each value a ``copy_``
    writes back into an input (``lower._mutation_views`` compares it with the input's: without
    it a later process's lowering found no mutation views while the program it loaded from the
    disk cache returned them, and the call failed). Recreating the FakeTensor of every device
    node would cost more than the rest of a warm start's load."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.fx._graph_pickler import GraphPickler, Options

    saved = {}
    # a graph with symbolic sizes keeps every "val": buckets.analyse reads them (padding to
    # buckets, masking.py); without them a warm start would compile it once per size
    dynamic = any(isinstance(s, torch.SymInt) or (isinstance(s, torch.Tensor) and any(
        isinstance(d, torch.SymInt) for d in s.shape))
        for n in gm.graph.nodes if n.op == "placeholder" for s in [n.meta.get("val")])
    written = {n.args[1] for n in gm.graph.nodes
               if n.op == "call_function" and n.target is torch.ops.aten.copy_.default
               and len(n.args) > 1 and isinstance(n.args[0], torch.fx.Node)
               and n.args[0].op == "placeholder"}
    for n in gm.graph.nodes:
        saved[n] = n.meta
        v = n.meta.get("val")
        keep = "val" in n.meta and (dynamic or n.op == "placeholder" or n in written
                                    or not _holds_device_tensor(v))
        n.meta = {"val": v} if keep else {}
    try:
        # every op: graphs may hold prims and custom ops (an op missing when an entry is loaded
        # fails the load, which PyTorch counts as a bypass and recompiles). Constants (get_attr
        # tensors on "tpu") are saved by value, read outside aot_autograd's fake mode.
        with unset_fake_temporarily():
            return GraphPickler.dumps(gm, options=Options(ops_filter=None,
                                                          node_metadata_key_filter=None))
    finally:
        for n, m in saved.items():
            n.meta = m


def _holds_device_tensor(v) -> bool:
    return any(isinstance(x, torch.Tensor) and x.device.type != "cpu"
               for x in torch.utils._pytree.tree_leaves(v))


def _counters():
    from torch._dynamo.utils import counters

    c = counters["aot_autograd"]
    return c["autograd_cache_hit"], c["autograd_cache_miss"], c["autograd_cache_bypass"]


@contextlib.contextmanager
def _no_inductor_backends():
    """AOTAutogradCache's key (``FxGraphHashDetails``) first registers every Inductor codegen
    backend (``init_backend_registration``: imports of the C++/Triton/Halide/Pallas/... code
    generators, ~1 s of a warm start) to hash the custom passes and configs those backends
    registered. They shape Inductor's code only, never a graph of ours: around our key they
    read as none, so the key neither pays the imports nor depends on whether this process used
    Inductor before (with Inductor's registrations it would differ, a needless miss)."""
    from torch._inductor import codecache

    with mock.patch.object(codecache, "init_backend_registration", lambda: None), \
            mock.patch.object(codecache, "custom_backend_passes", {}), \
            mock.patch.object(codecache, "custom_backend_codegen_configs", {}):
        yield


# ---- PyTorch's source hash (``torch_key``), kept across processes ----
# AOTAutogradCache's key includes ``torch_key()``: a SHA-256 of every module file of the torch
# package (``build_code_hash`` reads them all, ~0.19 s, once per process, at a warm start's
# first graph). It is kept in the cache folder under a *stamp* of those files: the torch
# version, the interpreter, and the path, size and modification time (ns) of every file whose
# name an import could load (``importlib.machinery.all_suffixes()``) in the torch folder and in
# each folder below it that is a package (holds an ``__init__`` module of any suffix), plus the
# two extra files it hashes. That is a superset of what ``build_code_hash`` reads: it lists
# modules with ``pkgutil.iter_modules`` and descends into packages only, so a folder that is no
# package (``include/``'s ~9,300 C++ headers, ``__pycache__``) holds nothing it reads, and is not
# walked (that took the walk from ~0.11 s to ~0.03 s of CPU a warm process). A changed, added or
# removed file, or a folder that becomes or stops being a package, gives another stamp, so the
# hash is computed again (Python's own .pyc check trusts the same size and mtime). The stored hash
# is handed to ``torch_key.set`` (``prefetchable_cache``'s way to prepopulate it); a process
# that computed it already keeps its own. Counted ``aot_torch_key_loads`` / ``_stores``.
_TORCH_KEY_MAGIC = b"TORCHTPU-XLA-TORCHKEY-1\n"
_torch_key_primed = [False]


def _torch_stamp(root: str, extra: list[str]) -> str:
    h = hashlib.sha256()
    import torch as _torch

    h.update(repr((_torch.__version__, sys.version, sys.implementation.cache_tag,
                   os.path.realpath(root))).encode())
    suffixes = tuple(importlib.machinery.all_suffixes())
    seen = set()

    def walk(folder: str, rel: str) -> None:
        try:
            st = os.stat(folder)
            if (st.st_dev, st.st_ino) in seen:  # a link back up the tree
                return
            seen.add((st.st_dev, st.st_ino))
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError:
            h.update(f"{rel}\0unreadable\n".encode())
            return
        # pkgutil.iter_modules counts a folder as a package when a name in it is ``__init__``
        # plus an import suffix (a looser test here only walks more); the root is one
        if rel and not any(e.name.startswith("__init__.") for e in entries):
            return
        h.update(f"{rel}\n".encode())
        for e in entries:
            if e.is_dir():
                walk(e.path, f"{rel}{e.name}/")
            elif e.name.endswith(suffixes):
                try:
                    st = e.stat()
                    h.update(f"{rel}{e.name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
                except OSError:  # a dangling link
                    h.update(f"{rel}{e.name}\0missing\n".encode())

    walk(root, "")
    for path in extra:
        try:
            st = os.stat(path)
            h.update(f"{path}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        except OSError:
            h.update(f"{path}\0missing\n".encode())
    return h.hexdigest()


def _prime_torch_key() -> None:
    """Hand ``torch_key`` its value from the cache folder when the torch files are unchanged;
    otherwise compute it and store it. Once per process; never an error."""
    if _torch_key_primed[0]:
        return
    _torch_key_primed[0] = True
    try:
        from torch._inductor import codecache
        from torch._inductor import config as inductor_config

        from ..runtime import disk_cache

        root = getattr(codecache, "_TORCH_PATH", None)
        tk = codecache.torch_key
        if not root or inductor_config.is_fbcode() or not hasattr(tk, "set"):
            return
        here = os.path.dirname(codecache.__file__)
        extra = [os.path.join(here, "codegen/aoti_runtime/interface.cpp"),
                 os.path.join(here, "script.ld")]
        key = "torchkey-" + _torch_stamp(root, extra)
        val = disk_cache._read(key, _TORCH_KEY_MAGIC, kind="aot_torch_key")
        if val is not None and len(val) == 32:
            try:
                tk.set(val)
                count("aot_torch_key_loads")
            except RuntimeError:  # computed in this process already
                pass
            return
        val = tk()
        if isinstance(val, bytes) and len(val) == 32:
            disk_cache._write(key, _TORCH_KEY_MAGIC, val, kind="aot_torch_key")
            count("aot_torch_key_stores")
    except Exception:  # noqa: BLE001 - PyTorch computes it itself
        pass


@contextlib.contextmanager
def enabled(opts: dict):
    """Around one aot_autograd call: PyTorch's cache in bundled mode, in our folder."""
    d = entry_dir(opts)
    if d is None:
        yield False
        return
    from torch._functorch import config as functorch_config
    from torch._functorch._aot_autograd.autograd_cache import AOTAutogradCache

    _prime_torch_key()
    before = _counters()
    with functorch_config.patch(enable_autograd_cache=True, bundled_autograd_cache=True,
                                force_non_lazy_backward_lowering=True), \
            mock.patch.object(AOTAutogradCache, "_get_tmp_dir", classmethod(lambda cls: d)), \
            _no_inductor_backends():
        yield True
    after = _counters()
    for name, b, a in zip(("aot_cache_hits", "aot_cache_misses", "aot_cache_bypasses"),
                          before, after):
        if a > b:
            count(name, a - b)
