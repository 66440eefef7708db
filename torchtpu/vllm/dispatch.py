"""A step's compiled program called without Dynamo's guard evaluation, once its bucket is built.

vLLM's own compiled path (``TorchCompileWithNoGuardsWrapper`` with ``VLLM_USE_BYTECODE_HOOK``)
keeps the bytecode Dynamo made for the model's ``forward`` (``register_bytecode_hook``) and
runs it directly afterwards: that code unpacks the frame's inputs and calls the compiled graph,
with no guard check. vLLM holds one such code (it compiles once, shapes dynamic); the runner on
"tpu" builds one program per token bucket (``dynamic=False``), so ``BucketDispatch`` keeps one
per bucket: the first call of a bucket goes through ``torch.compile`` (Dynamo compiles, or
finds, the bucket's entry and its guards hold), the bytecode Dynamo made for it is kept, and
later calls of the bucket run that code as a plain function (``vllm_steps_direct``). A bucket
whose call found an entry Dynamo had built before (no new code seen) stays on the guarded path.
vLLM's wrapper itself is not used: it needs vLLM's compilation mode, which the platform turns
off, and holds a single code.

What the direct path skips is what the guards would catch. The code reads the model's
parameters, buffers and KV caches from the module at each call (so in-place weight updates,
``load_weights``, are seen as they are through the guarded path). Each call checks, by
identity, every submodule, parameter, buffer and KV cache tensor the programs were built with
(``_holds``, ~0.1 us an object) and the grad mode; when one was replaced (a new parameter, a
LoRA wrapper, new KV caches) every bucket goes back through the guarded path
(``vllm_steps_guarded``), where Dynamo recompiles as it would have. Not checked (it would cost
a tensor-metadata read per parameter per step): a parameter's ``.data`` swapped in place for a
tensor of another dtype or shape -- vLLM does that only while loading, before warm-up.
``invalidate`` drops the kept code explicitly (new KV caches).
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
        self._items = self._mode = None
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
        self._items = self._mode = None

    def set_kv_layers(self, layers) -> None:
        self.kv_layers = list(layers)
        self.invalidate()

    def _capture(self) -> list:
        """What the programs captured, by identity: every submodule, parameter, buffer and KV
        cache tensor of the step, as ``(container, key, object)``."""
        items = []
        for mod in self.step.modules():
            for d in (mod._modules, mod._parameters, mod._buffers):
                items.extend((d, k, v) for k, v in d.items())
        for layer in self.kv_layers:
            kv = getattr(layer, "kv_cache", None)
            items.append((layer.__dict__, "kv_cache", kv))
            if isinstance(kv, list):  # the list's tensors, by position
                items.extend((kv, i, t) for i, t in enumerate(kv))
        return items

    def _holds(self) -> bool:
        """Whether the kept code still applies: same grad mode, and nothing the programs
        captured replaced (one identity check per object, ~0.1 us each)."""
        if self._items is None or self._mode != (torch.is_grad_enabled(),
                                                 torch.is_inference_mode_enabled()):
            return False
        for d, k, v in self._items:
            if type(d) is list:
                if k >= len(d) or d[k] is not v:
                    return False
            elif d.get(k) is not v:
                return False
        return True

    def __call__(self, *args):
        # tensors by shape, dtype and device, the rest (the bucket's ints) by value
        key = tuple((tuple(a.shape), a.dtype, a.device) if isinstance(a, torch.Tensor) else a
                    for a in args)
        if not self._holds():
            self.invalidate()
        fn = self.fns.get(key)
        if fn is not None:
            count("vllm_steps_direct")
            return fn(self.step, *args)
        count("vllm_steps_guarded")
        self._local.pending, self._local.captured = True, None
        try:
            out = self.compiled(*args)
        finally:
            self._local.pending = False
        code, self._local.captured = self._local.captured, None
        if code is not None:
            if self._items is None:
                self._items = self._capture()
                self._mode = (torch.is_grad_enabled(), torch.is_inference_mode_enabled())
            fwd = type(self.step).forward
            self.fns[key] = types.FunctionType(code, fwd.__globals__, fwd.__name__,
                                               fwd.__defaults__, fwd.__closure__)
        return out
