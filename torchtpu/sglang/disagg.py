"""Prefill/decode disaggregation for SGLang on "tpu" without RDMA: the ``torchtpu`` transfer
backend (``--disaggregation-transfer-backend torchtpu``).

SGLang's transfer backends (mooncake, nixl, mori) register the KV pool's ``data_ptr()``
ranges with a transfer engine that reads and writes device memory by address; a "tpu"
tensor's data pointer is not an address, so none of them can move its pages. This backend
moves the KV cache through host memory and shared storage instead, the way vLLM's
shared-storage connector does:

- prefill (``HostKVSender``): when the request's last chunk is sent, its pages are gathered
  from every layer's ``kv_pages`` (kv_pool.py) in one device-to-host copy, and written with
  the request's metadata row (the first output token and its logprobs: SGLang's
  ``MetadataBuffers``, host tensors) to ``<dir>/<bootstrap_room>.npz`` (written to a temporary
  name, then renamed: a reader never sees half a file);
- decode (``HostKVReceiver``): once SGLang has allocated the request's pages and told the
  receiver where they are (``send_metadata``), each poll looks for the room's file; when it is
  there, the pages are copied into the pool's ``kv_pages`` at those indices (past any prefix
  the decode instance already holds), the metadata row into its ``MetadataBuffers``, and the
  file is removed.

``<dir>`` is ``$TORCHTPU_SGLANG_KV_DIR`` (default ``<tmp>/torchtpu-sglang-kv``): a folder
both instances see (one host, or shared storage). There is no handshake: the request's
``bootstrap_room`` (the router gives both instances the same) names the file. One prefill
data-parallel rank, tensor parallelism equal on both sides (each rank moves its own heads:
the file name carries the rank).

SGLang selects transfer backends from a closed enum; ``install`` (called by the platform's
plugin in every SGLang process) extends it with ``TORCHTPU`` and answers ``get_kv_class`` for
it, through SGLang's plugin hook registry.
"""
from __future__ import annotations

import ctypes
import os
import tempfile
import time
from enum import Enum
from types import SimpleNamespace
from typing import Optional

import numpy as np
import torch
from sglang.srt.disaggregation.base.conn import (
    BaseKVBootstrapServer,
    BaseKVManager,
    BaseKVReceiver,
    BaseKVSender,
    KVPoll,
    KVTransferMetric,
)

NAME = "torchtpu"


def kv_dir() -> str:
    d = os.environ.get("TORCHTPU_SGLANG_KV_DIR") or os.path.join(tempfile.gettempdir(),
                                                                  "torchtpu-sglang-kv")
    os.makedirs(d, exist_ok=True)
    return d


def _path(room: int, rank: int) -> str:
    return os.path.join(kv_dir(), f"{int(room)}.rank{rank}.npz")


class _PrefillInfo(dict):
    """``prefill_info_table``: every prefill address is one data-parallel rank, known."""

    def get(self, key, default=None):
        return SimpleNamespace(dp_size=1, follow_bootstrap_room=True)


class HostKVManager(BaseKVManager):
    supports_host_destination = False

    def __init__(self, args, disaggregation_mode, server_args, is_mla_backend=False, **kw):
        from .kv_pool import TpuPagedKVPool

        self.kv_args = args
        self.disaggregation_mode = disaggregation_mode
        self.server_args = server_args
        self.is_mla_backend = is_mla_backend
        self.pool = TpuPagedKVPool.current()
        if self.pool is None:
            raise RuntimeError("the torchtpu transfer backend moves the pages of SGLang's KV "
                               "pool on 'tpu' (TpuPagedKVPool); this process has none")
        self.rank = int(getattr(args, "engine_rank", 0) or 0)
        self.prefill_info_table = _PrefillInfo()

    def register_to_bootstrap(self):
        pass

    def try_ensure_parallel_info(self, bootstrap_addr) -> bool:
        return True

    def should_verify_kv_checksum(self, bootstrap_addr) -> bool:
        return False

    def is_abort_release_safe(self, *args, **kwargs) -> bool:
        return True

    # ---- metadata rows (host tensors: their pointers are host addresses) ----

    def read_aux(self, index: int) -> list[np.ndarray]:
        a = self.kv_args
        out = []
        for ptr, item in zip(a.aux_data_ptrs, a.aux_item_lens):
            buf = (ctypes.c_uint8 * item).from_address(ptr + index * item)
            out.append(np.frombuffer(buf, dtype=np.uint8).copy())
        return out

    def write_aux(self, index: int, rows: list[np.ndarray]) -> None:
        a = self.kv_args
        if len(rows) != len(a.aux_data_ptrs):
            raise RuntimeError(f"torchtpu KV transfer: {len(rows)} metadata buffers received, "
                               f"{len(a.aux_data_ptrs)} expected")
        for ptr, item, row in zip(a.aux_data_ptrs, a.aux_item_lens, rows):
            if row.nbytes != item:
                raise RuntimeError("torchtpu KV transfer: metadata row sizes differ between "
                                   "the prefill and the decode instance")
            ctypes.memmove(ptr + index * item, row.ctypes.data, item)

    # ---- KV pages ----

    def gather(self, pages: np.ndarray) -> np.ndarray:
        idx = torch.from_numpy(pages.astype(np.int64)).to(self.pool.kv_pages[0].device)
        stacked = torch.stack([kv.index_select(0, idx) for kv in self.pool.kv_pages])
        return stacked.cpu().numpy()  # [layers, pages, page_size, 2 * heads, head_dim]

    def scatter(self, pages: np.ndarray, data: np.ndarray) -> None:
        kvs = self.pool.kv_pages
        if data.shape[0] != len(kvs) or data.shape[2:] != tuple(kvs[0].shape[1:]):
            raise RuntimeError(
                f"torchtpu KV transfer: received pages {list(data.shape)} do not fit this "
                f"instance's pool ({len(kvs)} layers of {list(kvs[0].shape)})")
        dev = kvs[0].device
        idx = torch.from_numpy(pages.astype(np.int64)).to(dev)
        src = torch.from_numpy(np.ascontiguousarray(data)).to(dev)
        for layer, kv in enumerate(kvs):
            kv.index_copy_(0, idx, src[layer].to(kv.dtype))


class HostKVSender(BaseKVSender):
    def __init__(self, mgr, bootstrap_addr, bootstrap_room, req_has_disagg_prefill_dp_rank=False):
        self.kv_mgr = mgr
        self.bootstrap_room = bootstrap_room
        self.num_pages = None
        self.aux_index = None
        self.pages: list[np.ndarray] = []
        self.state = KVPoll.WaitingForInput
        self.metric = KVTransferMetric()
        self.error = None

    def init(self, num_kv_indices: int, aux_index: Optional[int] = None):
        self.num_pages, self.aux_index = int(num_kv_indices), aux_index

    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
        return num_pages > 0 or last_chunk

    def send(self, kv_indices, state_indices=None, num_kv_tokens=None, **kwargs):
        if state_indices is not None and any(s is not None for s in state_indices):
            self._fail("state (Mamba/SWA) transfer is not supported by the torchtpu backend")
            return
        self.pages.append(np.asarray(kv_indices, dtype=np.int64).reshape(-1))
        sent = sum(len(p) for p in self.pages)
        if self.num_pages is None or sent < self.num_pages:
            return
        t0 = time.perf_counter()
        try:
            pages = np.concatenate(self.pages)
            kv = self.kv_mgr.gather(pages)
            aux = self.kv_mgr.read_aux(self.aux_index)
            final = _path(self.bootstrap_room, self.kv_mgr.rank)
            tmp = final + ".part.npz"
            np.savez(tmp, kv=kv, **{f"aux{i}": a for i, a in enumerate(aux)})
            os.replace(tmp, final)
        except Exception as e:  # the request fails, the server goes on
            self._fail(f"{type(e).__name__}: {e}")
            return
        self.metric = KVTransferMetric(transfer_latency_s=time.perf_counter() - t0,
                                       transfer_total_bytes=int(kv.nbytes))
        self.state = KVPoll.Success

    def _fail(self, msg):
        self.error = msg
        self.state = KVPoll.Failed

    def mark_prefill_complete(self) -> None:
        pass

    def get_transfer_metric(self) -> KVTransferMetric:
        return self.metric

    def poll(self) -> KVPoll:
        return self.state

    def failure_exception(self):
        raise RuntimeError(f"torchtpu KV transfer (room {self.bootstrap_room}) failed: "
                           f"{self.error}")

    def abort(self):
        self.state = KVPoll.Failed


class HostKVReceiver(BaseKVReceiver):
    def __init__(self, mgr, bootstrap_addr, bootstrap_room=None):
        self.kv_mgr = mgr
        self.bootstrap_room = bootstrap_room
        self.abort_notified = False
        self.bootstrap_infos = []
        self.require_staging = False
        self.conclude_state: Optional[int] = None
        self.ready = False
        self.dest = None
        self.error = None

    def init(self, prefill_dp_rank: int):
        if prefill_dp_rank not in (0, None):
            self._fail(f"prefill data-parallel rank {prefill_dp_rank}: the torchtpu backend "
                       "serves one")
        self.ready = True

    def send_metadata(self, kv_indices, aux_index=None, state_indices=None,
                      decode_prefix_len=None, destination=None):
        if state_indices is not None and any(s is not None for s in state_indices):
            self._fail("state (Mamba/SWA) transfer is not supported by the torchtpu backend")
            return
        self.dest = (np.asarray(kv_indices, dtype=np.int64).reshape(-1), aux_index,
                     int(decode_prefix_len or 0))

    def poll(self) -> int:
        if self.conclude_state is not None:
            return self.conclude_state
        if not self.ready:
            return KVPoll.Bootstrapping
        if self.dest is None:
            return KVPoll.WaitingForInput
        path = _path(self.bootstrap_room, self.kv_mgr.rank)
        if not os.path.exists(path):
            return KVPoll.Transferring
        pages, aux_index, prefix = self.dest
        try:
            with np.load(path) as f:
                kv = f["kv"]
                aux = [f[f"aux{i}"] for i in range(len(f.files) - 1)]
            # the prefill sends every page of the prompt; the decode instance asked for the
            # pages past the prefix it already holds
            page_size = kv.shape[2]
            skip = prefix // page_size
            if kv.shape[1] - skip != len(pages):
                raise RuntimeError(f"{kv.shape[1]} pages received past a {skip}-page prefix, "
                                   f"{len(pages)} expected")
            self.kv_mgr.scatter(pages, kv[:, skip:])
            self.kv_mgr.write_aux(aux_index, aux)
            os.remove(path)
        except Exception as e:
            self._fail(f"{type(e).__name__}: {e}")
            return self.conclude_state
        self.conclude_state = KVPoll.Success
        return self.conclude_state

    def _fail(self, msg):
        self.error = msg
        self.conclude_state = KVPoll.Failed

    def failure_exception(self):
        raise RuntimeError(f"torchtpu KV transfer (room {self.bootstrap_room}) failed: "
                           f"{self.error}")

    def abort(self):
        self.conclude_state = KVPoll.Failed

    def ensure_abort_notified(self, *, force_arm: bool = False) -> None:
        pass

    def is_abort_release_safe(self) -> bool:
        return True


class HostKVBootstrapServer(BaseKVBootstrapServer):
    """Nothing to bootstrap (the room names the file); SGLang starts one on a prefill."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port

    def close(self):
        pass


# ---- registration with SGLang ----

CLASSES = {"manager": HostKVManager, "sender": HostKVSender, "receiver": HostKVReceiver,
           "bootstrap_server": HostKVBootstrapServer}


def register_choice() -> None:
    from sglang.srt.arg_groups import choices

    if NAME not in choices.DISAGG_TRANSFER_BACKEND_CHOICES:
        choices.add_disagg_transfer_backend_choices([NAME])


def install() -> None:
    """Register the hooks that make ``torchtpu`` one of SGLang's transfer backends."""
    from sglang.srt.disaggregation import utils as du
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    register_choice()
    if "TORCHTPU" not in du.TransferBackend.__members__:
        members = {m.name: m.value for m in du.TransferBackend}
        members["TORCHTPU"] = NAME
        extended = Enum("TransferBackend", members, module=du.__name__)
        HookRegistry.register("sglang.srt.disaggregation.utils.TransferBackend", extended,
                              HookType.REPLACE)

    def get_kv_class(original, transfer_backend, class_type):
        if getattr(transfer_backend, "value", transfer_backend) == NAME:
            from sglang.srt.disaggregation.base import KVArgs

            if class_type.value == "kvargs":
                return KVArgs
            return CLASSES.get(class_type.value)
        return original(transfer_backend, class_type)

    HookRegistry.register("sglang.srt.disaggregation.utils.get_kv_class", get_kv_class,
                          HookType.AROUND)
