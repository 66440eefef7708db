"""VeRL's weight sync to its SGLang rollout server on "tpu": host shared memory, inside SGLang's
weight-update session.

VeRL 0.9.1's hybrid engine syncs the actor's weights to the rollout server every step
(``ServerAdapter.update_weights``, ``verl.workers.rollout.sglang_rollout.sglang_rollout``): each
bucket of full tensors goes to SGLang's ``weight_sync.utils.update_weights``, which serialises
device tensors as CUDA IPC handles (SGLang's patch of torch's tensor reduction, which fails on a
non-CUDA tensor), gathers every TP rank's handles at the leader and posts them to the server's
``/update_weights_from_tensor``. Since SGLang 0.5.2x that endpoint also refuses to run outside a
weight-update session (``/begin_weight_update`` ... ``/end_weight_update``), which VeRL 0.9.1 does
not open. On "tpu" (each shim checks its target and warns where it moved, see ``sglang_server``):

- ``sgl_update_weights`` (VeRL's name for SGLang's function) is ``update_weights`` below: each
  tensor is copied once from the device into host shared memory and pickled as torch's
  shared-memory handle (``file_system`` sharing: a file name, valid in any process of the host,
  kept alive by torch's reference count until the server has mapped it); SGLang's own
  ``MultiprocessingSerializer.deserialize`` (its restricted unpickler) reads it in the server's
  scheduler, which copies it onto its "tpu" parameters. Every TP rank serialises its own copy
  and the leader posts one payload per SGLang TP rank, as SGLang's function does.
- ``ServerAdapter.update_weights`` runs inside one weight-update session on the TP leader;
  VeRL's HTTP clients (``HttpServerAdapter``, ``AsyncHttpServerAdapter``) get the session
  methods SGLang's ``EngineBase`` declares abstract (without them neither can be created).
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import io
import threading

from ..integrations import STATUS, patch, skipped, when_imported
from .sglang_server import _on_tpu, not_patched

SYNC = "verl.workers.rollout.sglang_rollout.sglang_rollout"
SGLANG_SYNC = "sglang.srt.weight_sync.utils"
HTTP = "verl.workers.rollout.sglang_rollout.http_server_engine"
PARAMS = ("engine", "params_batch", "device_mesh_key", "device_mesh")

_sharing = threading.Lock()


@contextlib.contextmanager
def _file_system_sharing():
    """torch's ``file_system`` sharing strategy for the tensors pickled inside: a named
    shared-memory file, which an unrelated process (the SGLang server's scheduler) can open; the
    default ``file_descriptor`` strategy passes descriptors only to processes of the same
    multiprocessing family."""
    import torch.multiprocessing as mp

    with _sharing:
        prev = mp.get_sharing_strategy()
        mp.set_sharing_strategy("file_system")
        try:
            yield
        finally:
            mp.set_sharing_strategy(prev)


def host_copy(tensor):
    """``tensor``'s values (a DTensor's full value) in a new host shared-memory tensor: one
    device-to-host copy."""
    import torch
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        tensor = tensor.full_tensor()
    tensor = tensor.detach()
    with _file_system_sharing():
        out = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu").share_memory_()
    out.copy_(tensor)
    return out


def serialize(obj) -> bytes:
    """``obj`` pickled for SGLang's ``MultiprocessingSerializer.deserialize``, its CPU tensors as
    shared-memory handles, by torch's own tensor reduction (also where SGLang's CUDA-IPC patch of
    it is installed in this process)."""
    import torch
    from multiprocessing.reduction import ForkingPickler
    from torch.multiprocessing import reductions

    buf = io.BytesIO()
    pickler = ForkingPickler(buf)
    pickler.dispatch_table[torch.Tensor] = getattr(reductions, "_reduce_tensor_original",
                                                   reductions.reduce_tensor)
    with _file_system_sharing():
        pickler.dump(obj)
    return buf.getvalue()


async def _update_weights(engine, params_batch, device_mesh_key, device_mesh, load_format=None):
    """SPMD over the rollout's TP group: every rank hands its copy of the bucket to its SGLang TP
    rank through host shared memory; the leader posts the request."""
    import torch.distributed as dist
    from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput

    mesh = device_mesh[device_mesh_key]
    size, rank = mesh.mesh.size()[0], mesh.get_local_rank()
    # each SGLang TP rank deserialises its own entry: a list of (name, tensor)
    mine = serialize([(name, host_copy(t)) for name, t in params_batch])
    if size == 1:
        payloads = [mine]
    else:
        payloads = [None] * size if rank == 0 else None
        dist.gather_object(mine, payloads, dst=mesh.mesh.tolist()[0], group=mesh.get_group())
    if rank != 0:
        return None
    req = UpdateWeightsFromTensorReqInput(serialized_named_tensors=payloads,
                                          load_format=load_format)
    return await engine.update_weights_from_tensor(req)


def _wrap_sync(orig):
    @functools.wraps(orig)
    async def update_weights(*args, **kwargs):
        if not _on_tpu():
            return await orig(*args, **kwargs)
        return await _update_weights(*args, **kwargs)

    return update_weights


def _wrap_session(orig):
    @functools.wraps(orig)
    async def update_weights(self, *args, **kwargs):
        if not _on_tpu():
            return await orig(self, *args, **kwargs)
        await self._init_server_adapter()
        leader = self._engine is not None and self._is_server_tp_leader()
        if leader:
            await self._engine.begin_weight_update()
        try:
            return await orig(self, *args, **kwargs)
        finally:
            if leader:
                await self._engine.end_weight_update()

    return update_weights


# VeRL's HTTP clients of the SGLang server (``http_server_engine``) subclass SGLang's
# ``EngineBase``, whose session methods are abstract since SGLang 0.5.2x: without them neither
# client can be created. They post to the server's endpoints of the same names.
def _begin(self, selector: str = "all"):
    return self._make_request("begin_weight_update", {"selector": selector})


def _end(self):
    return self._make_request("end_weight_update", {})


async def _begin_async(self, selector: str = "all"):
    return await self._make_async_request("begin_weight_update", {"selector": selector})


async def _end_async(self):
    return await self._make_async_request("end_weight_update", {})


SESSION = {"HttpServerAdapter": ("_make_request", _begin, _end),
           "AsyncHttpServerAdapter": ("_make_async_request", _begin_async, _end_async)}


def _install_http(module) -> None:
    import abc

    for name, (request, begin, end) in SESSION.items():
        cls = getattr(module, name, None)
        target = f"{HTTP}.{name}"
        if cls is None or not hasattr(cls, request):
            return not_patched(target, f"not found, or without {request}")
        abstract = getattr(cls, "__abstractmethods__", frozenset())
        if not {"begin_weight_update", "end_weight_update"} & abstract:
            continue  # VeRL has them, or SGLang does not ask for them
        for attr, fn in (("begin_weight_update", begin), ("end_weight_update", end)):
            if attr in abstract:
                setattr(cls, attr, fn)
        STATUS[target] = "applied"
    for name in SESSION:  # base class first
        abc.update_abstractmethods(getattr(module, name))


def _install(module) -> None:
    target = f"{SYNC}.sgl_update_weights"
    fn = getattr(module, "sgl_update_weights", None)
    if fn is None or getattr(fn, "__module__", None) not in (SGLANG_SYNC, __name__):
        return not_patched(target, "VeRL no longer syncs through SGLang's update_weights")
    if not getattr(fn, "_torchtpu", False):
        missing = set(PARAMS) - set(inspect.signature(fn).parameters)
        if missing:
            return not_patched(target, f"its signature has no {', '.join(sorted(missing))}")
        patch(module, "sgl_update_weights", _wrap_sync)
    _install_session(module)


def _install_session(module) -> None:
    target = f"{SYNC}.ServerAdapter.update_weights"
    import sglang.srt.managers.io_struct as io_struct

    if not hasattr(io_struct, "BeginWeightUpdateReqInput"):
        skipped(target, "this SGLang has no weight-update session: nothing to open")
        return
    adapter = getattr(module, "ServerAdapter", None)
    http = getattr(module, "AsyncHttpServerAdapter", None)
    need = [f"ServerAdapter.{a}" for a in ("update_weights", "_init_server_adapter",
                                           "_is_server_tp_leader")
            if not hasattr(adapter, a)]
    need += [] if hasattr(http, "begin_weight_update") else ["AsyncHttpServerAdapter."
                                                             "begin_weight_update"]
    if need:
        return not_patched(target, f"{', '.join(need)} not found")
    if not patch(module, "ServerAdapter.update_weights", _wrap_session):
        not_patched(target, STATUS.get(target, "not applied"))


def install() -> None:
    when_imported(HTTP, _install_http)
    when_imported(SYNC, _install)
