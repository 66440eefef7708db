"""Guessing the next cache key of an op whose static arguments grow with the sequence.

``runtime/prefetch.py`` builds a Program's next signature ahead, but many per-length programs
are new Programs each length: the executor key itself holds the growing size (a view's shape
in its spec, ``view(B, T, nh, hd)``, ``arange(T)``). minGPT-style sampling grows every
activation this way. Here the key is split into its structure with the ints taken out (the
op's *family*) and the ints: when three misses of one family have ints and argument shapes in
arithmetic progression (each int, each dimension, by its own step), the next key, arguments and
signature are extrapolated, its Program is made exactly as the executor would make it for those
arguments (``executor._build``), entered in the executor's cache, and its executable built ahead
(``Program.build_ahead``). When the call comes, the key is found and the executable is ready;
its first use continues the progression.

A key is only guessed from ints the arguments hold (the key's ints mirror them), so the Program
made from the extrapolated arguments is the one the call would make; anything else in the key
must be unchanged. Random ops and the Fused executor are not guessed. A guess whose key never
comes is removed from the executor's cache when the family's next miss shows a different key
(``eager_key_guesses_wasted``); a family whose unused guesses exceed its used ones by
``prefetch.MAX_WASTED`` stops guessing. Counted: ``eager_key_guesses``,
``eager_key_guess_hits``.
"""
from __future__ import annotations

import torch
from jax.core import ShapedArray

from ..runtime import prefetch as _prefetch
from ..runtime.metrics import count

_INT = ("<int>",)  # the family's stand-in for an int of the key
_FAMILIES: dict = {}
_MAX_FAMILIES = 4096


class _NoGuess(Exception):
    pass


def _split(x, ints: list):
    tx = type(x)
    if tx is int:
        ints.append(x)
        return _INT
    if tx is tuple:
        return tuple([_split(e, ints) for e in x])
    return x


def _join(x, it):
    if x is _INT:
        return next(it)
    if type(x) is tuple:
        return tuple([_join(e, it) for e in x])
    return x


def _subst(arg, k_cur, k_new):
    """``arg`` with the ints its key part ``k_cur`` holds replaced by ``k_new``'s."""
    if type(arg) is int and type(k_cur) is int:
        return k_new
    if type(arg) in (list, tuple) and type(k_cur) is tuple and len(arg) == len(k_cur):
        return type(arg)([_subst(a, c, n) for a, c, n in zip(arg, k_cur, k_new)])
    if k_cur != k_new:
        raise _NoGuess  # a key int the argument does not hold as an int
    return arg


def _next_sig(s0, s1, s2):
    out = []
    for a, b, c in zip(s0, s1, s2):
        if type(c) is not ShapedArray:
            if not (a == b == c):
                return None
            out.append(c)
            continue
        if (type(a) is not ShapedArray or type(b) is not ShapedArray
                or not (a.dtype == b.dtype == c.dtype) or not (a.weak_type == b.weak_type
                                                              == c.weak_type)
                or not (len(a.shape) == len(b.shape) == len(c.shape))):
            return None
        shape = []
        for x, y, z in zip(a.shape, b.shape, c.shape):
            if z - y != y - x or z + (z - y) < 0:
                return None
            shape.append(z + (z - y))
        out.append(c.update(shape=tuple(shape)))
    return tuple(out) if len(s0) == len(s1) == len(s2) else None


class _Family:
    __slots__ = ("points", "guesses", "wasted", "hits")

    def __init__(self):
        self.points: list = []  # the latest (key ints, signature), at most prefetch.HISTORY
        self.guesses: dict = {}  # guessed key -> misses of the family since
        self.wasted = self.hits = 0


def _placeholder(x):
    """Arguments kept for the next guess hold no tensor (a tensor is only a slot to the
    program): a meta tensor stands in, so no device memory is kept alive."""
    if isinstance(x, torch.Tensor):
        return torch.empty(0, device="meta")
    if type(x) in (list, tuple):
        return type(x)([_placeholder(e) for e in x])
    return x


def observe(key, sig, ctx, cache: dict, build) -> None:
    """A miss of the executor's cache: ``key`` was just entered and called with ``sig``.
    ``ctx`` (from ``remember``): (lowering, kind, args, kwargs, key_args, key_kwargs,
    n_tensors, write slots, wrapped, flat arguments); ``build(ctx, key)`` makes the cache
    entry for a ctx and key."""
    ints: list = []
    fam = _split(key, ints)
    st = _FAMILIES.get(fam)
    if st is None:
        if len(_FAMILIES) >= _MAX_FAMILIES:
            _FAMILIES.clear()
        st = _FAMILIES[fam] = _Family()
    for k, age in list(st.guesses.items()):  # a guess not called within HISTORY misses
        if age >= _prefetch.HISTORY:
            st.guesses.pop(k, None)
            cache.pop(k, None)
            st.wasted += 1
            count("eager_key_guesses_wasted")
        else:
            st.guesses[k] = age + 1
    _advance(st, fam, ints, sig, ctx, cache, build)


def _progression(points, ints, sig):
    """(the next ints, the next signature) if (ints, sig) continues two earlier points."""
    for i1, s1 in reversed(points):
        if len(i1) != len(ints):
            continue
        step = [c - b for b, c in zip(i1, ints)]
        if not any(step):
            continue
        for i0, s0 in points:
            if len(i0) == len(i1) and [b - a for a, b in zip(i0, i1)] == step:
                nsig = _next_sig(s0, s1, sig)
                if nsig is not None:
                    return [c + d for c, d in zip(ints, step)], nsig
    return None


def _advance(st, fam, ints, sig, ctx, cache, build) -> None:
    pts = st.points
    nxt = None
    if st.wasted <= st.hits + _prefetch.MAX_WASTED:
        nxt = _progression(pts, ints, sig)
    pts.append((ints, sig))
    if len(pts) > _prefetch.HISTORY:
        del pts[0]
    if nxt is None:
        return
    nints, nsig = nxt
    nkey = _join(fam, iter(nints))
    if nkey in cache:
        return
    lowering, kind, args, kwargs, key_args, key_kwargs = ctx[:6]
    try:
        nargs = _subst(tuple(args), key_args, nkey[2])
        nkw = {name: _subst(v, kv[1], nkv[1]) for (name, v), kv, nkv in
               zip(kwargs.items(), key_kwargs, nkey[3])} if kwargs else kwargs
    except _NoGuess:
        return
    nctx = (lowering, kind, nargs, nkw, nkey[2], nkey[3]) + tuple(ctx[6:])
    try:
        entry = build(nctx, nkey)
    except Exception:  # noqa: BLE001 - a guess that cannot be made is not made
        return
    cache[nkey] = entry
    st.guesses[nkey] = 0
    count("eager_key_guesses")

    def first_use():
        if st.guesses.pop(nkey, None) is None:
            return  # already counted wasted (and dropped from the cache)
        st.hits += 1
        count("eager_key_guess_hits")
        _advance(st, fam, nints, nsig, nctx, cache, build)

    entry.jitted.build_ahead(nsig, ctx[9], first_use)


def enabled() -> bool:
    """Whether guessing runs (it needs the prefetch workers)."""
    return _prefetch.THREADS > 0


def debug(e) -> None:
    from ..runtime.metrics import _log

    _log.debug("torchtpu: guessing the next key failed: %r", e)


def remember(ctx):
    """The ctx to keep for later guesses: tensors replaced by placeholders."""
    lowering, kind, args, kwargs = ctx[:4]
    flat = [_shape_only(a) for a in ctx[9]]
    return (lowering, kind, _placeholder(tuple(args)),
            {k: _placeholder(v) for k, v in kwargs.items()} if kwargs else kwargs) + tuple(
                ctx[4:9]) + (flat,)


def _shape_only(a):
    """A flat argument kept for its sharding only (not its device buffer)."""
    sh = getattr(a, "sharding", None)
    return _Sharded(sh) if sh is not None else a


class _Sharded:
    __slots__ = ("sharding",)

    def __init__(self, sharding):
        self.sharding = sharding
