"""``torch._assert_async``: an assertion on a device value without a host sync.

On CUDA the kernel raises a device-side assert that surfaces at a later call; here the
assertion is a device check (``check`` in registry.py, ``eager/checks.py``), raised as a
RuntimeError at the next host sync (at once in Debug mode). TorchTitan's RoPE asserts its
positions this way every forward; without a lowering each call was a CPU fallback (a sync).
The message of ``_assert_async.msg`` is not carried (checks have one message per op, as
CUDA's device-side assert reports none either).
"""
from __future__ import annotations

import jax.numpy as jnp

from .registry import aten, register


def _single(self):
    if self.size == 0:
        raise RuntimeError("Boolean value of Tensor with no values is ambiguous")
    if self.size != 1:
        raise RuntimeError("Boolean value of Tensor with more than one value is ambiguous")


def _nonzero(self, *args, **kwargs):
    return jnp.reshape(self, ()) != 0


_MSG = "Expected Tensor with single nonzero value, but got zero (torch._assert_async)"


@register(aten._assert_async.default, aten._assert_async.msg,
          check=(_nonzero, RuntimeError, _MSG))
def _assert_async(self, assert_msg=None):
    _single(self)
    return None
