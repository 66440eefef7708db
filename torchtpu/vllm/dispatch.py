"""A step's compiled program called without Dynamo's guard evaluation, once its bucket is built.

vLLM's own compiled path (``TorchCompileWithNoGuardsWrapper`` with ``VLLM_USE_BYTECODE_HOOK``)
keeps the bytecode Dynamo made for the model's ``forward`` (``register_bytecode_hook``) and
runs it directly afterwards: that code unpacks the frame's inputs and calls the compiled graph,
with no guard check. vLLM holds one such code (it compiles once, shapes dynamic); the runner on
"tpu" builds one program per token bucket (``dynamic=False``), so ``BucketDispatch`` keeps one
per bucket: the first call of a bucket goes through ``torch.compile`` (Dynamo compiles, or
finds, the bucket's entry and its guards hold), the bytecode Dynamo made for it is kept, and
later calls of the bucket run that code as a plain function (``vllm_steps_direct``).

What the direct path skips is what the guards would catch. The code reads the model's
parameters, buffers and KV caches from the module at each call (so in-place weight updates,
``load_weights``, are seen as they are through the guarded path); what would change the
program -- a parameter, buffer, submodule or KV cache tensor replaced, a dtype, shape or
device changed, another grad mode -- makes ``_fingerprint`` differ, and every bucket goes back
through the guarded path (``vllm_steps_guarded``), where Dynamo recompiles as it would have.
``invalidate`` drops the kept code explicitly (a new model, new KV caches).
"""
from __future__ import annotations

import threading
import types
import weakref

import torch

from ..runtime.metrics import count


class BucketDispatch:
    def __init__(self, step: torch.nn.Module, compiled, kv_layers=()):
        self.step = step
        self.compiled = compiled
        self.kv_layers = list(kv_layers)
        self.code = type(step).forward.__code__
        self.fns: dict = {}
        self._print = None
        self._local = threading.local()
        # the hook holds no reference to the runner's model: removed when this object dies
        ref = weakref.ref(self)

        def hook(old_code, new_code):
            me = ref()
            if me is not None:
                me._hook(old_code, new_code)

        self._handle = torch._dynamo.convert_frame.register_bytecode_hook(hook)
        weakref.finalize(self, self._handle.remove)

    def _hook(self, old_code, new_code) -> None:
        # Dynamo made new code for a frame: keep it when it is this step's forward being
        # compiled by a guarded call of ours on this thread
        if old_code is self.code and getattr(self._local, "pending", False):
            self._local.captured = new_code

    def invalidate(self) -> None:
        self.fns.clear()
        self._print = None

    def set_kv_layers(self, layers) -> None:
        self.kv_layers = list(layers)
        self.invalidate()

    def _fingerprint(self):
        """What the programs captured, by identity and metadata: every submodule, parameter,
        buffer and KV cache tensor of the step, and the grad mode."""
        parts = [torch.is_grad_enabled(), torch.is_inference_mode_enabled()]
        for mod in self.step.modules():
            parts.append(id(mod))
            for d in (mod._parameters, mod._buffers):
                for t in d.values():
                    if t is None:
                        parts.append(None)
                    else:
                        parts.append((id(t), t.dtype, t.shape, t.device, t.requires_grad))
        for layer in self.kv_layers:
            for t in getattr(layer, "kv_cache", ()) or ():
                parts.append((id(t), t.dtype, t.shape) if isinstance(t, torch.Tensor) else t)
        return tuple(parts)

    def __call__(self, packed: torch.Tensor, T: int, R: int):
        key = (T, R, tuple(packed.shape), packed.dtype, packed.device)
        fp = self._fingerprint()
        if fp != self._print:
            self.invalidate()
            self._print = fp
        fn = self.fns.get(key)
        if fn is not None:
            count("vllm_steps_direct")
            return fn(self.step, packed, T, R)
        count("vllm_steps_guarded")
        self._local.pending, self._local.captured = True, None
        try:
            out = self.compiled(packed, T, R)
        finally:
            self._local.pending = False
        code, self._local.captured = self._local.captured, None
        if code is not None and self._fingerprint() == fp:
            fwd = type(self.step).forward
            self.fns[key] = types.FunctionType(code, fwd.__globals__, fwd.__name__,
                                               fwd.__defaults__, fwd.__closure__)
        return out
