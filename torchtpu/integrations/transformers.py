"""Hugging Face transformers on "tpu": continuous batching's memory sizing and static shapes.

transformers 5.x already knows the device ("tpu:0" in ``TrainingArguments``, compiling
``generate``'s decode step), but continuous batching (``generate_batch``, ``transformers serve
--continuous-batching``) sizes its KV cache from a memory breakdown that knows only CUDA, XPU and
MPS: for "tpu" it took the host's total RAM less this process's RSS, and 90% of that. Two patches,
applied when "tpu" is the current accelerator:

- ``get_device_and_memory_breakdown`` reports the tpu device's memory
  (``torch.tpu.mem_get_info``: PJRT's figures, or the host's available memory on the CPU
  platform), so the cache takes a fraction of what is free rather than of all RAM;
- on the CPU platform, whose device memory is host memory, the default fraction
  (``max_memory_percent`` when the user set none) is 0.1 rather than transformers' 0.6 for host
  memory ("cpu", "mps"): eager in-place writes into the cache and attention-mask buffers build
  the new array before the old one is released, and the server's peak RSS measured ~3x the
  budget (17 GB for a 5.6 GB budget at 0.3 on a 24 GB host, which it nearly exhausted; 6.4 GB
  at 0.1). Users size the cache with ``--cb-*`` flags / ``ContinuousBatchingConfig`` as usual.

And static shapes: continuous batching pads each batch's query and KV lengths to intervals only
when it captures CUDA graphs or compiles, and only CUDA has graphs. XLA compiles a program per
shape, so without padding every new mix of request lengths compiled hundreds of eager programs
(a round of 4 new chats: 15-18 s, against 2.3 s for a round seen before). On "tpu" the
model's forward is compiled by default (``default_compile_level`` 1, transformers' own
"compile" level: ``torch.compile`` with dynamic shapes, backend "tpu"), which turns the padding
on: a new round then costs ~3 s, its remaining compiles are transformers' per-request mask and
reset writes into views. Set ``TORCHTPU_CB_COMPILE_LEVEL=0`` (or pass compile configs, or a
model ``compile_config``) to choose otherwise.

Static-cache ``generate()`` sizes its cache to prompt + new tokens (never shrinking across
calls), so each longer prompt made a new cache shape and recompiled the decode step. On "tpu"
the length is rounded up to the compile buckets (``torch.tpu.compiler.set_dynamic_buckets``;
powers of two from 8 by default): prompts within a bucket share one cache and one decode
program. The extra positions are masked, as a static cache's unused positions always are. Its
prefill, which transformers runs eagerly, is compiled on "tpu" once per prompt bucket
(``bucketed_prefill``).
"""
from __future__ import annotations

import copy
import functools
import inspect
import os
import warnings

from . import generate_steps
from .hooks import bind, patch, skipped, tpu_is_accelerator, when_imported

CPU_PLATFORM_MEMORY_PERCENT = 0.1
CB_COMPILE_LEVEL = int(os.environ.get("TORCHTPU_CB_COMPILE_LEVEL", "1"))


def _on_cpu_platform() -> bool:
    from ..runtime import devices

    return devices.platform() == "cpu"


def memory_breakdown():
    """(device, total, reserved, allocated) of the current tpu device, as transformers uses them
    (``allocated`` is everything not free, as transformers derives it from CUDA's mem_get_info)."""
    import torch

    dev = torch.device("tpu", torch.tpu.current_device())
    free, total = torch.tpu.mem_get_info(dev)
    return dev, total, torch.tpu.memory_reserved(dev), total - free


def _breakdown(orig):
    @functools.wraps(orig)
    def get_device_and_memory_breakdown(*args, **kwargs):
        import torch

        if not args and not kwargs and not torch.cuda.is_available() and tpu_is_accelerator():
            return memory_breakdown()
        return orig(*args, **kwargs)

    return get_device_and_memory_breakdown


def _patch_breakdown(mod) -> None:
    # continuous_batching/utils.py since 5.24; requests.py before (a deprecated shim there now)
    if hasattr(mod, "get_device_and_memory_breakdown") or mod.__name__.endswith(".utils"):
        patch(mod, "get_device_and_memory_breakdown", _breakdown, rebind=("transformers",))


def _memory_percent(orig):
    """On the CPU platform, default the cache fraction to ``CPU_PLATFORM_MEMORY_PERCENT`` for
    a cache on "tpu". Releases before 5.22 pass no device: their cache is sized from the
    no-argument memory breakdown, which reports the tpu device when it is the accelerator."""
    takes_device = "device" in inspect.signature(orig).parameters

    @functools.wraps(orig)
    def resolve_max_memory_percent(*args, **kwargs):
        import torch

        ba = bind(orig, args, kwargs)
        if ba is not None and _on_cpu_platform():
            cb_config = ba.arguments["cb_config"]
            device = ba.arguments.get("device")
            if takes_device:
                on_tpu = getattr(device, "type", None) == "tpu"
            else:
                on_tpu = not torch.cuda.is_available() and tpu_is_accelerator()
            if on_tpu and getattr(cb_config, "max_memory_percent", 0) is None:
                cb_config.max_memory_percent = CPU_PLATFORM_MEMORY_PERCENT
        return orig(*args, **kwargs)

    return resolve_max_memory_percent


def _compile_level(orig):
    @functools.wraps(orig)
    def resolve_continuous_batching_config(*args, **kwargs):
        ba = bind(orig, args, kwargs)
        if ba is None:
            return orig(*args, **kwargs)
        config, cb_config = ba.arguments["config"], ba.arguments["cb_config"]
        if (getattr(ba.arguments.get("device"), "type", None) == "tpu" and CB_COMPILE_LEVEL > 0
                and getattr(cb_config, "default_compile_level", None) == 0
                and cb_config.varlen_compile_config is None
                and cb_config.decode_compile_config is None
                and getattr(config, "compile_config", None) is None):
            cb_config = copy.copy(cb_config)  # the caller's config stays as it was
            cb_config.default_compile_level = CB_COMPILE_LEVEL
            ba.arguments["cb_config"] = cb_config
        return orig(*ba.args, **ba.kwargs)

    return resolve_continuous_batching_config


def _patch_cb_init(mod) -> None:
    patch(mod, "resolve_max_memory_percent", _memory_percent, params=("cb_config",),
          rebind=("transformers",))
    # the compile level needs the device, which resolve_* take since 5.22
    patch(mod, "resolve_continuous_batching_config", _compile_level,
          params=("config", "cb_config", "device"), rebind=("transformers",))


def static_cache_length(n: int) -> int:
    """The static KV cache length for ``n`` positions on "tpu": ``n`` rounded up to a bucket."""
    from ..compile import buckets, options

    opts = options.dynamic_bucket_defaults()
    return buckets.bucket(n, opts) if buckets.enabled(opts) else n


# The prompt's inputs to a causal LM's forward, and the dim of each that is the prompt length
# (a 4-d attention mask, which generate() builds for a static cache, is (batch, 1, prompt,
# cache): its keys dim is the cache's, static).
_PROMPT_DIMS = (("input_ids", -1), ("position_ids", -1), ("attention_mask", -1),
                ("cache_position", -1), ("inputs_embeds", -2), ("token_type_ids", -1))
PREFILL_BUCKETS = os.environ.get("TORCHTPU_PREFILL_BUCKETS", "1") != "0"


def _prompt_dynamic(kwargs) -> None:
    """Mark the prompt-length dim of the forward's prompt inputs dynamic (a length of 1 is
    left static: Dynamo specializes it)."""
    import torch

    for name, d in _PROMPT_DIMS:
        t = kwargs.get(name)
        if isinstance(t, torch.Tensor) and t.dim():
            if name == "attention_mask" and t.dim() == 4:
                d = -2
            if t.shape[d] > 1:
                torch._dynamo.mark_dynamic(t, d % t.dim())


def bucketed_prefill(model, generation_config, model_kwargs):
    """The forward to run a static-cache ``generate()``'s prefill with on "tpu", or None.

    transformers compiles only the decode step (the prefill runs eagerly: a program per op
    and prompt length). On "tpu" the prefill is compiled too, with the prompt length dynamic:
    the compile backend pads it to a bucket, writes into the cache only at the real positions
    and takes the logits of the last real one (compile/buckets.py, masking.py), so every
    prompt length in a bucket runs one program. Taken when transformers would compile the
    decode step with its default config; ``TORCHTPU_PREFILL_BUCKETS=0`` turns it off."""
    import torch

    if not PREFILL_BUCKETS or getattr(getattr(model, "device", None), "type", None) != "tpu":
        return None
    if (generation_config.prefill_chunk_size is not None
            or generation_config.compile_config is not None
            or "forward" in model.__dict__  # a hooked forward (accelerate's offloading)
            or not model._valid_auto_compile_criteria(model_kwargs, generation_config)):
        return None
    from ..compile import buckets, options

    if not buckets.enabled(options.dynamic_bucket_defaults()):
        return None
    compiled = model.__dict__.get("_torchtpu_prefill")
    if compiled is False:  # it failed to compile for this model: eager, as transformers runs it
        return None
    forward = type(model).forward
    if compiled is None:
        def prefill(*args, **kwargs):
            return forward(model, *args, **kwargs)

        compiled = model.__dict__["_torchtpu_prefill"] = _compile(prefill)

    def run(*args, **kwargs):
        from ..compile.lower import Unsupported

        _prompt_dynamic(kwargs)
        try:
            return compiled(*args, **kwargs)
        except (torch._dynamo.exc.BackendCompilerFailed, Unsupported) as e:
            # a forward the compiler cannot take (transformers' default keeps it eager):
            # say so once and run it eagerly from now on
            warnings.warn(f"torchtpu: the prefill of {type(model).__name__} could not be "
                          f"compiled ({str(e).splitlines()[0]}); it runs eagerly",
                          stacklevel=2)
            model.__dict__["_torchtpu_prefill"] = False
            return forward(model, *args, **kwargs)

    return run


def _compile(fn):
    import torch

    return torch.compile(fn, backend="tpu")


def _prefill(orig):
    @functools.wraps(orig)
    def _prefill(self, *args, **kwargs):
        ba = bind(orig, (self,) + args, kwargs)
        fwd = None if ba is None else bucketed_prefill(
            self, ba.arguments["generation_config"], ba.arguments["model_kwargs"])
        if fwd is None:
            return orig(self, *args, **kwargs)
        # transformers' prefill calls self(...): its forward is ours for that call
        self.__dict__["forward"] = fwd
        try:
            return orig(self, *args, **kwargs)
        finally:
            self.__dict__.pop("forward", None)

    return _prefill


def _static_cache(orig):
    @functools.wraps(orig)
    def _prepare_static_cache(self, *args, **kwargs):
        if getattr(getattr(self, "device", None), "type", None) == "tpu":
            ba = bind(orig, (self,) + args, kwargs)
            if ba is not None:
                ba.arguments["max_cache_len"] = static_cache_length(ba.arguments["max_cache_len"])
                return orig(*ba.args, **ba.kwargs)
        return orig(self, *args, **kwargs)

    return _prepare_static_cache


# ---- generate() without a host sync per token ----
# transformers' greedy/sampling loop asks ``bool(unfinished_sequences.max() == 0)`` after every
# token: the host waits for the device each step and, in Fused mode, every recorded graph ends
# at a token. Its ``DeferredStopCheck`` (enabled for "mps" only) reads that flag one step late
# instead and undoes the one extra step it ran (``finish``; the returned cache is cropped). On
# "tpu" the flag stays a device tensor until the next step reads it: in Strict mode the host
# queues step t's programs before waiting for step t-1's flag; in Fused mode step t-1's flag was
# sent to the device with the graph of the step before, so one graph spans two tokens. The tokens
# are the same (the extra step is undone); streamed tokens arrive one step late, as on "mps".

def _tpu_stop_check(self) -> bool:
    return getattr(self, "_torchtpu_flag", False) is not False


def _deferred_supported(orig):
    fn = orig.__func__ if isinstance(orig, staticmethod) else orig

    @functools.wraps(fn)
    def is_supported(device, cache, cache_is_returned, is_assistant):
        if getattr(device, "type", device) == "tpu" and DEFER_STOP_CHECK:
            if is_assistant:
                return False
            return cache is None or cache.is_croppable or not cache_is_returned
        return fn(device, cache, cache_is_returned, is_assistant)

    return staticmethod(is_supported)


def _deferred_init(orig):
    @functools.wraps(orig)
    def __init__(self, input_ids, *args, **kwargs):
        orig(self, input_ids, *args, **kwargs)
        if input_ids.device.type == "tpu":
            self._torchtpu_flag = None  # the last step's stop flag, on the device
            self._torchtpu_tokens = None  # the last step's tokens (streamed one step late)

    return __init__


def _deferred_call(orig):
    @functools.wraps(orig)
    def __call__(self, unfinished_sequences, tokens, length):
        if not _tpu_stop_check(self):
            return orig(self, unfinished_sequences, tokens, length)
        # "some sequence unfinished", one program (``max() == 0`` is two): the loop's mask
        # holds 0 and 1 only (``ones & ~done``), so "stop" is its negation, read below
        flag = unfinished_sequences.any()
        prev, self._torchtpu_flag = self._torchtpu_flag, flag
        prev_tokens = self._torchtpu_tokens
        if self.streamer is not None:
            self._torchtpu_tokens = tokens.clone()
        if prev is not None:
            if self.streamer is not None:
                self.streamer.put(prev_tokens.cpu())
            self.stop_reported = not bool(prev)
        self.is_first_step = False
        stopping = self.stop_reported or (self.max_length is not None
                                          and length >= self.max_length)
        if not stopping and self.cache is not None:
            self.cache.crop(0)
        return stopping

    return __call__


def _deferred_finish(orig):
    @functools.wraps(orig)
    def finish(self):
        if not _tpu_stop_check(self):
            return orig(self)
        streamer, tokens = self.streamer, self._torchtpu_tokens
        if streamer is not None and not self.stop_reported and tokens is not None:
            streamer.put(tokens.cpu())  # the last token, not yet streamed
        self.streamer = None  # transformers' own finish: the cache's rollback
        try:
            return orig(self)
        finally:
            self.streamer = streamer
            self._torchtpu_flag = self._torchtpu_tokens = None

    return finish


DEFER_STOP_CHECK = os.environ.get("TORCHTPU_DEFER_STOP_CHECK", "1") != "0"


def _patch_stop_check(mod) -> None:
    cls = getattr(mod, "DeferredStopCheck", None)
    if cls is None:
        skipped(f"{mod.__name__}.DeferredStopCheck", "not found")
        return
    # the four methods are one change: all applied, or none
    need = {"__init__": ("input_ids", "max_length", "cache", "cache_is_returned"),
            "__call__": ("unfinished_sequences", "tokens", "length"), "finish": ()}
    for name, params in need.items():
        fn = inspect.getattr_static(cls, name, None)
        have = set(inspect.signature(fn).parameters) if callable(fn) else set()
        if fn is None or not set(params) <= have:
            skipped(f"{mod.__name__}.DeferredStopCheck.{name}", "its signature changed")
            return
    for attr in ("stop_reported", "is_first_step", "max_length", "cache", "streamer"):
        if attr not in inspect.getsource(cls):
            skipped(f"{mod.__name__}.DeferredStopCheck", f"no {attr}")
            return
    patch(mod, "DeferredStopCheck.__init__", _deferred_init)
    patch(mod, "DeferredStopCheck.__call__", _deferred_call)
    patch(mod, "DeferredStopCheck.finish", _deferred_finish)
    patch(mod, "DeferredStopCheck.is_supported", _deferred_supported,
          params=("device", "cache", "cache_is_returned", "is_assistant"))


def _patch_generation(mod) -> None:
    _patch_stop_check(mod)
    if not hasattr(getattr(mod, "GenerationMixin", None), "_valid_auto_compile_criteria"):
        # bucketed_prefill asks it whether transformers would compile the decode step
        skipped(f"{mod.__name__}.GenerationMixin._prefill", "no _valid_auto_compile_criteria")
    else:
        patch(mod, "GenerationMixin._prefill", _prefill,
              params=("generation_config", "model_kwargs"))
    patch(mod, "GenerationMixin._prepare_static_cache", _static_cache,
          params=("max_cache_len",))


def install() -> None:
    generate_steps.install()
    when_imported("transformers.generation.continuous_batching.utils", _patch_breakdown)
    when_imported("transformers.generation.continuous_batching.requests", _patch_breakdown)
    when_imported("transformers.generation.continuous_batching.initialization", _patch_cb_init)
    when_imported("transformers.generation.utils", _patch_generation)
