"""An extend step's token positions built on the host: SGLang's ``compute_position`` on "tpu".

Without Triton SGLang computes an extend batch's positions with ``compute_position_torch``:
one ``torch.arange(prefix, prefix + n)`` per request, iterating the *device* tensors of the
prefix and new-token lengths (two host reads per request, each a host sync), a ``cat`` of the
pieces and a ``cumsum`` for the start offsets. On "tpu" each of those is an eager program
compiled for every new length and request count, inside the time to first token of the
request that meets it. ``compute_position`` (around SGLang's, installed by the plugin) reads
the two length vectors back once each (they were just copied from SGLang's host lists), builds
the positions and start offsets with numpy and copies them to the device: two host reads and
two transfers per extend step, no eager program. Tensors on another device go to SGLang's.
The host arrays stay noted on the device tensors (``remember_host``): the compiled prefill
pads them to its bucket on the host (prefill.py) without reading them back.
"""
from __future__ import annotations

import numpy as np
import torch


def host_positions(prefix_lens, seq_lens) -> tuple[np.ndarray, np.ndarray]:
    """Positions ``prefix .. prefix + n - 1`` of every request, concatenated, and each
    request's first row (SGLang's ``positions, extend_start_loc``), as int64 arrays."""
    prefix = np.asarray(prefix_lens, dtype=np.int64)
    lens = np.asarray(seq_lens, dtype=np.int64)
    starts = np.zeros_like(lens)
    np.cumsum(lens[:-1], out=starts[1:])
    total = int(lens.sum())
    # position of row r of request i: prefix[i] + (r - starts[i])
    owner = np.repeat(np.arange(len(lens)), lens)
    positions = prefix[owner] + (np.arange(total, dtype=np.int64) - starts[owner])
    return positions, starts


def compute_position(original, attn_backend, extend_prefix_lens, extend_seq_lens,
                     extend_seq_lens_sum, *args, **kwargs):
    """Around ``forward_batch_info.compute_position``: on "tpu", the host's arithmetic."""
    if (args or kwargs or not isinstance(extend_seq_lens, torch.Tensor)
            or extend_seq_lens.device.type != "tpu"):
        return original(attn_backend, extend_prefix_lens, extend_seq_lens, extend_seq_lens_sum,
                        *args, **kwargs)
    dev = extend_seq_lens.device
    positions, starts = host_positions(host_values(extend_prefix_lens),
                                       host_values(extend_seq_lens))
    pos = torch.from_numpy(positions).to(dev)
    remember_host(pos, positions)
    start = torch.from_numpy(starts).to(extend_seq_lens.dtype).to(dev)
    remember_host(start, starts)
    return pos, start


_HOST = "_torchtpu_host"


def remember_host(dev: torch.Tensor, host) -> None:
    """Note on device tensor ``dev`` the host values it was copied from (a numpy array or CPU
    tensor), so that padding it reads no device value; void once ``dev`` is written in place
    (its version counter moves)."""
    try:
        setattr(dev, _HOST, (dev._version, host))
    except (AttributeError, RuntimeError):
        pass


def host_values(dev: torch.Tensor, host=None) -> np.ndarray:
    """``dev``'s values on the host: ``host`` (a list, array or CPU tensor of the same values)
    or the copy ``remember_host`` noted, else read back (one transfer, no eager program)."""
    if host is None or len(host) != dev.shape[0]:
        noted = getattr(dev, _HOST, None)
        host = None
        if noted is not None and noted[0] == dev._version and len(noted[1]) == dev.shape[0]:
            host = noted[1]
    if host is None:
        return dev.cpu().numpy()
    return host.numpy() if isinstance(host, torch.Tensor) else np.asarray(host)


def pad_on_host(dev: torch.Tensor, total: int, fill: int = 0, host=None) -> torch.Tensor:
    """``dev`` (1-D, integers) padded with ``fill`` to ``total`` rows as int64, built on the
    host (from ``host_values(dev, host)``) and copied once: no eager program, whatever the
    length (a ``cat`` on the device compiles one for every new length)."""
    arr = np.full((total,), fill, dtype=np.int64)
    arr[:dev.shape[0]] = host_values(dev, host)
    return torch.from_numpy(arr).to(dev.device)
