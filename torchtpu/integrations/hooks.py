"""The post-import hooks and patch helpers every integration module uses (see the package's
docstring): ``when_imported``, ``patch``, ``skipped``, ``bind``, ``STATUS``."""
from __future__ import annotations

import importlib.abc
import inspect
import logging
import os
import sys
import threading

_hooks: dict = {}
_lock = threading.Lock()
_log = logging.getLogger("torchtpu.integrations")

# What happened to each patch target ("module.attr"): "applied", or "skipped: <why>".
STATUS: dict = {}


def _flag(name: str, default: str) -> bool:
    return os.environ.get(name, default).strip().lower() not in ("", "0", "false", "no")


if _flag("TORCHTPU_DEBUG_INTEGRATIONS", "0"):
    _log.setLevel(logging.DEBUG)
    if not _log.handlers:
        _log.addHandler(logging.StreamHandler())


def skipped(target: str, why: str) -> None:
    """Record that the patch of ``target`` was not applied: the library runs unpatched there.
    Said once, at debug level (``TORCHTPU_DEBUG_INTEGRATIONS=1`` shows it), and counted
    (``integration_patches_skipped`` in ``torch.tpu.metrics()``)."""
    from ..runtime import metrics

    if STATUS.get(target, "").startswith("skipped"):
        return
    STATUS[target] = f"skipped: {why}"
    metrics.count("integration_patches_skipped")
    _log.debug("torchtpu: not patching %s (%s); it runs unpatched", target, why)


def _call(name: str, fn, module) -> None:
    try:
        fn(module)
    except Exception as e:  # a patch never breaks the library it patches
        skipped(f"{name} ({getattr(fn, '__qualname__', fn)})", f"{type(e).__name__}: {e}")


def _run(name: str, module) -> None:
    with _lock:
        hooks = _hooks.pop(name, ())
    for fn in hooks:
        _call(name, fn, module)


def _initializing(module) -> bool:
    """True while ``module`` is still executing (its import has not finished)."""
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


_watched_classes: dict = {}


def _watched(spec_cls):
    """A subclass of ``spec_cls`` (ModuleSpec) that runs the hooks of its module when the import
    system marks the module initialised: ``importlib._bootstrap._load_unlocked`` sets
    ``spec._initializing = False`` after the module executed and sits in ``sys.modules`` (also
    when it raised: then it is no longer in ``sys.modules`` and the hooks wait for a retry)."""
    cls = _watched_classes.get(spec_cls)
    if cls is None:
        def __setattr__(self, key, value):
            spec_cls.__setattr__(self, key, value)
            if key == "_initializing" and not value:
                object.__setattr__(self, "__class__", spec_cls)
                mod = sys.modules.get(self.name)
                if mod is not None and getattr(mod, "__spec__", None) is self:
                    _run(self.name, mod)

        cls = _watched_classes[spec_cls] = type(
            "TorchtpuWatchedSpec", (spec_cls,), {"__setattr__": __setattr__})
    return cls


def _watch(spec) -> bool:
    """Run the hooks of ``spec``'s module once it has finished executing. False if it can't."""
    if type(spec) in _watched_classes.values():
        return True
    try:
        spec.__class__ = _watched(type(spec))
    except TypeError:
        return False
    return True


class _Finder(importlib.abc.MetaPathFinder):
    """Watches the spec of each module that has hooks (it finds nothing itself)."""

    def find_spec(self, name, path, target=None):
        if name not in _hooks:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        _watch(spec)
        return spec


_finder = _Finder()


def when_imported(name: str, fn) -> None:
    """Call ``fn(module)`` once module ``name`` has finished executing: now if it has, at the
    end of its import if it has not been imported yet or is being imported right now (torch's
    backend autoload imports torchtpu from inside the first ``import torch``, which may sit in
    the middle of that module)."""
    with _lock:
        mod = sys.modules.get(name)
        if mod is None or _initializing(mod):
            _hooks.setdefault(name, []).append(fn)
            if _finder not in sys.meta_path:
                sys.meta_path.insert(0, _finder)
            if mod is None or _watch(mod.__spec__):
                return
            _hooks[name].remove(fn)
    _call(name, fn, mod)


def patch(module, qualname: str, make, *, params=(), rebind=()) -> bool:
    """Replace ``module.<qualname>`` (``"f"`` or ``"Class.f"``) by ``make(original)``.

    Skipped (``skipped``: said once under ``TORCHTPU_DEBUG_INTEGRATIONS=1``, counted) when the
    target is missing, or when its signature lacks one of ``params`` (the library moved or
    changed it): the library then runs unpatched. Already patched: nothing to do. After
    patching a function, modules under the ``rebind`` package prefixes that imported the
    original by name (``from .x import f``, before this ran) are pointed at the new one.
    """
    target = f"{module.__name__}.{qualname}"
    *path, attr = qualname.split(".")
    owner = module
    for part in path:
        owner = getattr(owner, part, None)
        if owner is None:
            skipped(target, f"{module.__name__} has no {part}")
            return False
    orig = inspect.getattr_static(owner, attr, None)
    if orig is None:
        skipped(target, "not found")
        return False
    if getattr(getattr(orig, "fget", orig), "_torchtpu", False):
        return True
    if params:
        fn = orig.fget if isinstance(orig, property) else orig
        try:
            have = inspect.signature(fn).parameters
        except (TypeError, ValueError):
            have = {}
        missing = [p for p in params if p not in have]
        if missing:
            skipped(target, f"its signature has no {', '.join(missing)}")
            return False
    new = make(orig)
    getattr(new, "fget", new)._torchtpu = True
    setattr(owner, attr, new)
    STATUS[target] = "applied"
    if rebind and not isinstance(orig, property):
        _rebind(orig, new, rebind)
    return True


def _rebind(orig, new, prefixes) -> None:
    for name, mod in list(sys.modules.items()):
        if not any(name == p or name.startswith(p + ".") for p in prefixes):
            continue
        d = getattr(mod, "__dict__", None)
        if not isinstance(d, dict):
            continue
        for key, value in list(d.items()):
            if value is orig:
                d[key] = new


def bind(fn, args, kwargs):
    """``fn``'s arguments by name for this call (``inspect.BoundArguments``), or None when the
    call does not fit the signature (the original then raises its own error)."""
    try:
        return inspect.signature(fn).bind(*args, **kwargs)
    except TypeError:
        return None


def tpu_is_accelerator() -> bool:
    """True when "tpu" is PyTorch's current accelerator (it is whenever torchtpu is loaded)."""
    import torch

    acc = torch.accelerator.current_accelerator()
    return acc is not None and acc.type == "tpu"
