"""Masks that make padding exact for ops that reduce or contract over a dynamic dimension.

``buckets.analyse`` pads a graph's dynamic dimensions to a bucket. Position-wise ops need
nothing; an op that mixes positions along a padded dimension (a sum, a matmul contracting over
the sequence, a softmax over it, a loss averaged over it, a weight gradient summed over batch x
sequence) would see the padding. For the op families here the graph is rewritten so that the
padded positions contribute exactly nothing: before the op, its operands are replaced along
those dimensions by the reduction's identity (0 for sums and contractions, on *both* operands so
that ``0 * inf`` never happens; -inf for max, softmax and logsumexp; ignore_index for loss
targets), and a mean divides by the real count. The real sizes enter the program as 0-d int32
inputs (one per size symbol), so one program serves every size of a bucket; a size the graph
uses as a value (``x / n`` in a mean's backward) becomes the same traced value.

A padded dimension of size ``c * (s + k)`` (a flattened ``(batch, seq)``, a shifted
``seq - 1``) is laid out as ``c`` blocks of ``S + k`` in the padded program (``buckets``
admits only ops that keep that layout), so its real positions are those with
``index % (S + k) < s + k``. Index arguments into a padded dim (gather, scatter) are bounded by
the real size, so that an index valid only in the bucket still fails the op's check.

Every function here is a pure JAX function called from the rewritten FX graph
(``lower.GraphLowering`` calls a plain Python target with the node's arrays); the static parts
(dims, fills, expressions) are node arguments, so they appear in the graph's code and key.
"""
from __future__ import annotations

import operator

import jax.numpy as jnp
import numpy as np
import sympy
import torch
from jax import lax

aten = torch.ops.aten

try:  # a traced size used as a value should promote like the Python int it replaces
    from jax._src.lax.lax import _convert_element_type as _cet

    def _weak(x):
        return _cet(x, weak_type=True)
except ImportError:  # pragma: no cover
    def _weak(x):
        return x


# ---- the rules: which arguments of which ops to mask, and with what ----

class Rule:
    """How to make one op exact under padding.

    ``masks``: {argument position: (the dims of that argument the op mixes, fill)}: the dynamic
    ones among them are masked with ``fill`` ("zero", "one", "low" (-inf / the dtype's min /
    False), "high", or an int such as a loss's ignore_index). ``index``: the op returns positions
    along those dims (argmax), which the padded layout keeps only for a plain size (``s``, not
    ``c * s``). ``replace``: how the op itself changes: ``masked_mean`` stands for a mean
    (masked sum / real count); ``("loss_mean", reduction position, position of the input)``
    makes a loss's mean a sum divided by the input's real element count; ``("tail", dim,
    start)`` puts ``self`` back where slice_scatter wrote src's padding. A "count" fill masks
    nothing (it names the dims that count). ``fixed``: {position: dims} the op mixes but cannot
    mask (a loss's class dim): they must not be dynamic."""

    __slots__ = ("masks", "index", "replace", "fixed", "bounds")

    def __init__(self, masks, index=False, replace=None, fixed=None, bounds=None):
        self.masks = masks
        self.index = index
        self.replace = replace
        self.fixed = fixed or {}
        # {index argument position: (position of the indexed tensor, its dim)}: positions along
        # that dim past its real size are made out of range (so the op's index check raises,
        # as the unpadded op would) instead of reaching the padding
        self.bounds = bounds or {}


def _all(nd):
    return list(range(nd))


def _dims_of(d, nd):
    if d is None:
        return _all(nd)
    d = [d] if isinstance(d, int) else list(d)
    return [x % nd if nd else 0 for x in d] if d else _all(nd)


def _arg(n, pos, name, default=None):
    if len(n.args) > pos:
        return n.args[pos]
    return n.kwargs.get(name, default)


_IDENTITY = {
    aten.sum.dim_IntList: "zero", aten.sum.default: "zero",
    aten.prod.dim_int: "one", aten.prod.default: "one",
    aten.any.dim: "low", aten.any.dims: "low", aten.any.default: "low",
    aten.all.dim: "high", aten.all.dims: "high", aten.all.default: "high",
    aten.amax.default: "low", aten.amin.default: "high", aten.logsumexp.default: "low",
}
_INDEXED = {aten.argmax.default: "low", aten.argmin.default: "high",
            aten.max.dim: "low", aten.min.dim: "high"}
_SOFTMAX = {aten._softmax.default, aten._log_softmax.default}
# elementwise losses whose value at (input 0, target 0) is exactly 0: op -> (position of
# reduction, position of weight or None); their backward the same with grad_output first
_LOSSES = {aten.mse_loss.default: (2, None), aten.smooth_l1_loss.default: (2, None),
           aten.huber_loss.default: (2, None), aten.binary_cross_entropy.default: (3, 2)}
_LOSS_BW = {aten.mse_loss_backward.default: (3, None),
            aten.smooth_l1_loss_backward.default: (3, None),
            aten.huber_loss_backward.default: (3, None),
            aten.soft_margin_loss_backward.default: (3, None),
            aten.binary_cross_entropy_backward.default: (4, 3)}
_NLL = {aten.nll_loss_forward.default, aten.nll_loss2d_forward.default}
_NLL_BW = {aten.nll_loss_backward.default, aten.nll_loss2d_backward.default}


def rule(n, ndim):
    """A ``Rule`` for node ``n`` (``ndim(x)``: the rank of an argument), a string saying why
    its op cannot be masked, or None (not an op this module knows)."""
    t = n.target
    a = n.args
    if t in _IDENTITY:
        nd = ndim(a[0])
        if t in (aten.sum.default, aten.prod.default, aten.any.default, aten.all.default):
            return Rule({0: (_all(nd), _IDENTITY[t])})
        return Rule({0: (_dims_of(_arg(n, 1, "dim"), nd), _IDENTITY[t])})
    if t in _INDEXED:
        nd = ndim(a[0])
        d = _arg(n, 1, "dim")
        if d is None and nd > 1:
            return "a flat index over several dimensions"
        return Rule({0: (_dims_of(d, nd), _INDEXED[t])}, index=True)
    if t in (aten.mean.dim, aten.mean.default):
        nd = ndim(a[0])
        d = _arg(n, 1, "dim") if t is aten.mean.dim else None
        return Rule({0: (_dims_of(d, nd), "zero")}, replace=masked_mean)
    if t in _SOFTMAX:
        return Rule({0: (_dims_of(a[1], ndim(a[0])), "low")})
    if t is aten._softmax_backward_data.default:
        d = _dims_of(a[2], ndim(a[0]))
        return Rule({0: (d, "zero"), 1: (d, "zero")})
    if t is aten._log_softmax_backward_data.default:
        # grad - exp(out) * sum(grad): only the sum mixes positions
        return Rule({0: (_dims_of(a[2], ndim(a[0])), "zero")})
    if t is aten.mm.default:
        return Rule({0: ([1], "zero"), 1: ([0], "zero")})
    if t is aten.addmm.default:
        return Rule({1: ([1], "zero"), 2: ([0], "zero")})
    if t is aten.bmm.default:
        return Rule({0: ([2], "zero"), 1: ([1], "zero")})
    if t in _NLL or t in _NLL_BW:
        bw = t in _NLL_BW
        s, tgt = (a[1], a[2]) if bw else (a[0], a[1])
        weight = a[3] if bw else a[2]
        ignore = a[5] if bw else a[4]
        nds, ndt = ndim(s), ndim(tgt)
        cdim = 1 if nds >= 2 else 0
        sp, tp, wp = (1, 2, 3) if bw else (0, 1, 2)
        fixed = {sp: [cdim]}  # the class dim: picked by the targets
        if weight is not None:
            fixed[wp] = [0]
        # target dim k is self's dim k, or k + 1 past the class dim
        tdims = _all(ndt)
        sdims = [k if k < cdim else k + 1 for k in tdims]
        if bw:  # position-wise; padded targets made valid so that its index check holds
            return Rule({tp: (tdims, int(ignore))}, fixed=fixed)
        # padded rows: an ignored target (not counted in a mean's total weight) and a finite
        # log-probability (the lowering multiplies an ignored one by a zero weight)
        return Rule({sp: (sdims, "zero"), tp: (tdims, int(ignore))}, fixed=fixed)
    if t is aten.native_layer_norm_backward.default:
        # grad_input: row by row; grad_weight/grad_bias: sums over the leading dims, of
        # grad_out * (x - mean) * rstd: all four zero in padded rows (a finite 0)
        nd = ndim(a[1])
        lead, norm = _all(nd - len(a[2])), list(range(nd - len(a[2]), nd))
        return Rule({0: (lead, "zero"), 1: (lead, "zero"), 3: (lead, "zero"),
                     4: (lead, "zero")}, fixed={0: norm, 1: norm})
    if t is aten.embedding_dense_backward.default:
        if a[4]:
            return "scale_grad_by_freq counts the padding's indices"
        nd = ndim(a[1])
        # padded positions: index 0 (always a valid row) with a zero gradient
        return Rule({0: (_all(nd), "zero"), 1: (_all(nd), 0)})
    if t in _LOSSES or t in _LOSS_BW:
        bw = t in _LOSS_BW
        off = 1 if bw else 0
        red_pos, weight_pos = (_LOSSES.get(t) or _LOSS_BW.get(t))
        red = _arg(n, red_pos, "reduction", 1)
        if weight_pos is not None and _arg(n, weight_pos, "weight") is not None:
            return None
        nd = ndim(a[off])
        if ndim(a[off + 1]) != nd:
            return None  # a broadcast target
        if red == 0:  # none: position-wise; inputs masked all the same, so that an input
            # check (binary_cross_entropy's probabilities) never sees the padding
            return Rule({} if bw else {0: (_all(nd), "zero"), 1: (_all(nd), "zero")})
        if bw:  # sum: position-wise; mean: the sum's gradient over the real count
            return Rule({off: (_all(nd), "count")}, replace=("loss_mean", red_pos, off)) \
                if red == 1 else Rule({})
        # padded positions: both inputs 0, whose loss is exactly 0
        masks = {0: (_all(nd), "zero"), 1: (_all(nd), "zero")}
        return Rule(masks, replace=("loss_mean", red_pos, 0) if red == 1 else None)
    if t is aten.slice_scatter.default:  # buckets._mixed_dims: a src that stops before the end
        d = (_arg(n, 2, "dim", 0)) % max(ndim(a[0]), 1)
        start = _arg(n, 3, "start", 0) or 0
        return Rule({1: ([d], "count")}, replace=("tail", d, start))
    if t is aten.slice.Tensor:  # buckets._mixed_dims: not a prefix; from the end?
        d = _arg(n, 1, "dim", 0) % max(ndim(a[0]), 1)
        start, end, step = _arg(n, 2, "start"), _arg(n, 3, "end"), _arg(n, 4, "step", 1)
        if isinstance(start, int) and start < 0 and step == 1 and (
                end is None or (isinstance(end, int) and end >= 1 << 62)):
            # x[.., -k:]: the last k real positions (a model's logits for its last token)
            return Rule({0: ([d], "count")}, index=True, replace=("from_end", d, start))
        return None
    if t in _SDPA_OPS:
        return _sdpa_rule(n, ndim)
    if t is aten.gather.default:
        # out[.., j, ..] = self[.., index[.., j, ..], ..]: position-wise along index's dims
        d = a[1] % max(ndim(a[0]), 1)
        return Rule({2: (_all(ndim(a[2])), 0)}, bounds={2: (0, d)})
    if t in (aten.scatter.src, aten.scatter.value):
        # self[.., index[.., j, ..], ..] = src[.., j, ..]: index's own scatter dim must not be
        # padded (its padded entries would write into real positions)
        d = a[1] % max(ndim(a[0]), 1)
        nd = ndim(a[2])
        masks = {2: ([k for k in range(nd) if k != d], 0)}
        return Rule(masks, fixed={2: [d]}, bounds={2: (0, d)})
    if t is aten.index_copy.default:
        # self.index_copy(dim, index, source): entry j of index writes source's slice j along
        # dim. Padded entries (of index, and of source along dim) become copies of the first
        # real entry: they write what it writes where it writes, so the result is the unpadded
        # op's (a static KV cache written at a prompt's positions)
        d = a[1] % max(ndim(a[0]), 1)
        return Rule({2: ([0], "first"), 3: ([d], "first")}, bounds={2: (0, d)})
    if t is aten.embedding.default:
        if isinstance(a[1], torch.fx.Node) and a[1].op == "placeholder":
            return None  # zero-padded input indices: already exact (buckets._mixed_dims)
        # computed indices may hold anything in the padding: index 0 there (a valid row)
        return Rule({1: (_all(ndim(a[1])), 0)}, fixed={0: _all(ndim(a[0]))})
    return None


_SDPA_OPS = {aten._scaled_dot_product_fused_attention_overrideable.default,
             aten._scaled_dot_product_flash_attention_for_cpu.default,
             aten._scaled_dot_product_efficient_attention.default,
             aten._scaled_dot_product_flash_attention.default,
             aten.scaled_dot_product_attention.default}


def sdpa_bias_position(n):
    """Position of an attention op's mask/bias argument (it may be past the given args), or
    None when it is passed by keyword (not analysed)."""
    names = [a.name for a in n.target._schema.arguments]
    for name in ("attn_bias", "attn_mask"):
        if name in names:
            if n.kwargs.get(name) is not None:
                return None
            return names.index(name)
    return len(names)


def _size_expr(x):
    return x.node.expr if isinstance(x, torch.SymInt) else sympy.Integer(int(x))


def _plain_size(e) -> bool:
    """``s + k``: one size symbol, positions real up to it, then padding."""
    syms = e.free_symbols if isinstance(e, sympy.Basic) else ()
    return len(syms) == 1 and sympy.simplify(e - next(iter(syms))).is_Integer


def sdpa_mask_fits(n, i) -> bool:
    """Whether the mask (argument ``i``) broadcasts against (.., queries, keys) with each of
    its last two dims 1 or the query's / key's own size: a mask whose query dim is static
    while the queries are dynamic (the attention op's meta does not check it) would not
    broadcast once padded. Two plain sizes of different symbols (a prompt's ids and its
    4-d mask, marked dynamic apart) fit when equal: recorded in the node's meta
    (``EQUAL_SIZES``) for the plan to check at each call."""
    q, k = n.args[0].meta["val"].shape, n.args[1].meta["val"].shape
    b = n.args[i].meta["val"].shape
    equal = []
    for x, ref in ((b[-2], q[-2]), (b[-1], k[-2])):
        e, r = _size_expr(x), _size_expr(ref)
        if e == 1 or sympy.simplify(e - r) == 0:
            continue
        if not (_plain_size(e) and _plain_size(r)):
            return False
        equal.append((e, r))
    n.meta[EQUAL_SIZES] = equal
    return True


EQUAL_SIZES = "torchtpu_equal_sizes"


def _sdpa_rule(n, ndim):
    """Attention over a dynamic key length: the padded keys and values are zeroed (so that
    ``0 * inf`` never happens), and either a causal mask over one dynamic length keeps every
    real query off them (query i sees keys j <= i), or the mask's padded key positions are
    filled with -inf / False. Anything else would give padded keys weight."""
    a = n.args
    nd = ndim(a[0])
    names = [x.name for x in n.target._schema.arguments]
    i = names.index("is_causal") if "is_causal" in names else None
    causal = i is not None and (a[i] if i < len(a) else n.kwargs.get("is_causal", False))
    b = sdpa_bias_position(n)
    bias = a[b] if b is not None and b < len(a) else None
    kv = {1: ([nd - 2], "zero"), 2: ([nd - 2], "zero")}
    if bias is not None and not causal:
        bv = bias.meta.get("val") if isinstance(bias, torch.fx.Node) else None
        if isinstance(bv, torch.Tensor) and isinstance(bv.shape[-1], torch.SymInt) \
                and sdpa_mask_fits(n, b):
            kv[b] = ([ndim(bias) - 1], "low")
            return Rule(kv)
    if causal is True and bias is None:
        qs = a[0].meta["val"].shape[nd - 2]
        ks = a[1].meta["val"].shape[nd - 2]
        if isinstance(qs, torch.SymInt) and isinstance(ks, torch.SymInt) \
                and sympy.simplify(qs.node.expr - ks.node.expr) == 0:
            return Rule(kv)
    return "attention whose mask or causality does not keep real queries off the padded keys"


# ---- values in the padded program ----

def _fill_value(fill, dtype):
    dtype = jnp.dtype(dtype)
    if not isinstance(fill, str):
        return jnp.asarray(fill, dtype)
    if dtype == jnp.bool_:
        return jnp.asarray(fill in ("one", "high"), dtype)
    if fill == "zero":
        return jnp.zeros((), dtype)
    if fill == "one":
        return jnp.ones((), dtype)
    if jnp.issubdtype(dtype, jnp.floating):
        return jnp.asarray(-np.inf if fill == "low" else np.inf, dtype)
    if jnp.issubdtype(dtype, jnp.integer):
        info = jnp.iinfo(dtype)
        return jnp.asarray(info.min if fill == "low" else info.max, dtype)
    raise TypeError(f"no {fill} fill for {dtype}")


def real_mask(shape, spec, reals):
    """Boolean array broadcastable to ``shape``: True at the real positions along ``spec``'s
    dims ((dim, c, size index k, offset o): the dim is ``c`` blocks of the padded size plus
    ``o``, whose first ``reals[k] + o`` positions are real)."""
    keep = None
    for d, c, k, o in spec:
        size = shape[d]
        idx = lax.iota(jnp.int32, size) % (size // c)
        m = (idx < reals[k] + o).reshape([size if i == d else 1 for i in range(len(shape))])
        keep = m if keep is None else keep & m
    return keep


def restore_tail(out, self, d, start, spec, *reals):
    """slice_scatter's result where src's padded positions landed on ``self``'s positions:
    ``self`` there (the unpadded op leaves them as they were)."""
    (_, _, k, o), = spec
    p = lax.iota(jnp.int32, out.shape[d]) - start
    padded_src = (p >= reals[k] + o) & (p >= 0)  # past src's real end (and past its padded
    # end the op did not write: self's value either way)
    keep = padded_src.reshape([out.shape[d] if i == d else 1 for i in range(out.ndim)])
    return jnp.where(keep, self, out)


def slice_from_end(x, d, start, spec, *reals):
    """``x[.., start:]`` along dim ``d`` for a ``start < 0``: counted from the real end."""
    (_, _, k, o), = spec
    n = -start
    begin = jnp.maximum(reals[k] + o - n, 0).astype(jnp.int32)
    return lax.dynamic_slice_in_dim(x, begin, min(n, x.shape[d]), axis=d)


def bound_index(x, bound, *reals):
    """Indices ``x`` into a dim padded from the real size ``reals[k] + o`` (``bound = (k, o)``):
    those past it (valid only in the padded program) made out of range for every size, so that
    the op's index check raises as the unpadded op's would."""
    k, o = bound
    return jnp.where(x >= reals[k] + o, jnp.asarray(jnp.iinfo(x.dtype).max, x.dtype), x)


def fill_padding(x, spec, fill, *reals):
    """``x`` with its padded positions along ``spec``'s dims replaced by ``fill`` ("first": by
    the first position along those dims, which is always real)."""
    if not spec:
        return x
    if fill == "first":
        first = x
        for d, _, _, _ in spec:
            first = lax.slice_in_dim(first, 0, 1, axis=d)
        return jnp.where(real_mask(x.shape, spec, reals), x, first)
    return jnp.where(real_mask(x.shape, spec, reals), x, _fill_value(fill, x.dtype))


def _real_count(shape, dims, spec, reals):
    by_dim = {d: (c, k, o) for d, c, k, o in spec}
    n = jnp.ones((), jnp.int32)
    for d in dims:
        if d in by_dim:
            c, k, o = by_dim[d]
            n = n * (c * (reals[k] + o))
        else:
            n = n * shape[d]
    return n


def over_real_count(y, x, spec, *reals):
    """``y`` divided by the real number of elements of ``x`` (a loss's mean: ``y`` is the sum,
    or the sum's gradient)."""
    n = _real_count(x.shape, range(x.ndim), spec, reals)
    acc = jnp.float32 if y.dtype in (jnp.float16, jnp.bfloat16) else y.dtype
    return (y.astype(acc) / n.astype(acc)).astype(y.dtype)


def masked_mean(x, dim, keepdim, dtype, spec, *reals):
    """aten.mean.dim / mean.default on a padded ``x``: the sum of its real positions divided by
    their real count (a traced value), computed as the eager lowering computes a mean."""
    from ..lowering import reductions as _red

    od = _red._mean_dtype(x, dtype)
    xs = _red._acc(fill_padding(x, spec, "zero", *reals).astype(od))
    dims = _red._dims(dim, x.ndim)
    n = _real_count(x.shape, dims, spec, reals)
    s = jnp.sum(xs, axis=dims, keepdims=keepdim)
    return (s / n.astype(s.dtype)).astype(od)


def mean_args(n):
    """(x, dim, keepdim, dtype) of a mean node, whichever overload."""
    if n.target is aten.mean.default:
        return (n.args[0], None, False, n.kwargs.get("dtype"))
    a = n.args
    return (a[0], a[1] if len(a) > 1 else n.kwargs.get("dim"),
            a[2] if len(a) > 2 else n.kwargs.get("keepdim", False), n.kwargs.get("dtype"))


# ---- sizes used as values ----

_VALUE_OPS = {aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar,
              aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar,
              aten.true_divide.Tensor, aten.true_divide.Scalar}


def expression_code(e, syms):
    """A static, printable form of a sympy size expression over ``syms`` (their order gives
    the index of their real size), or None when it uses anything but + * and integer
    powers."""
    if isinstance(e, sympy.Symbol):
        return ("s", syms.index(e)) if e in syms else None
    if e.is_Integer:
        return ("i", int(e))
    if isinstance(e, (sympy.Add, sympy.Mul)):
        parts = [expression_code(x, syms) for x in e.args]
        if any(p is None for p in parts):
            return None
        return ("+" if isinstance(e, sympy.Add) else "*", tuple(parts))
    if isinstance(e, sympy.Pow) and e.exp.is_Integer and int(e.exp) >= 0:
        base = expression_code(e.base, syms)
        return None if base is None else ("^", base, int(e.exp))
    return None


def _eval_code(code, reals):
    kind = code[0]
    if kind == "s":
        return reals[code[1]]
    if kind == "i":
        return code[1]
    if kind == "^":
        b = _eval_code(code[1], reals)
        r = 1
        for _ in range(code[2]):
            r = r * b
        return r
    vals = [_eval_code(c, reals) for c in code[1]]
    op = operator.add if kind == "+" else operator.mul
    r = vals[0]
    for v in vals[1:]:
        r = op(r, v)
    return r


def size_value(code, *reals):
    """The real value of a size expression: a traced 0-d int32, weakly typed so that it promotes
    like the Python int the unpadded graph had there."""
    return _weak(jnp.asarray(_eval_code(code, reals), jnp.int32))


def value_positions(n, is_size):
    """Argument positions of node ``n`` where a size is used as a value that can be replaced by
    its traced real value, or None when some size use cannot (``is_size(x)``: x is a size)."""
    if n.target not in _VALUE_OPS:
        return None
    if any(is_size(v) for v in n.kwargs.values()):
        return None  # alpha
    pos = [i for i, x in enumerate(n.args) if is_size(x)]
    if pos != [1] or not isinstance(n.args[0], torch.fx.Node) \
            or not isinstance(n.args[0].meta.get("val"), torch.Tensor):
        return None
    return pos


# ---- the rewrite ----

def rewrite(gm, syms, masks, values):
    """A copy of ``gm`` with one more placeholder per symbol of ``syms`` (its real size, a 0-d
    int32), each node of ``masks`` ((node, {pos: (spec, fill)}, replace, {pos: (size index,
    offset)})) given masked operands (or replaced, see ``Rule``), and each size used as a value
    in ``values`` ((node, positions, {position: expression code})) replaced by its real
    value."""
    g = torch.fx.Graph()
    env: dict = {}
    out = g.graph_copy(gm.graph, env)
    g.output(out)
    at = [n for n in g.nodes if n.op == "placeholder"][-1]
    reals = []
    for k, s in enumerate(syms):
        with g.inserting_after(at):
            at = g.placeholder(f"real_size_{k}_{s}")
        reals.append(at)
    for node, spec, replace, bounds in masks:
        m = env[node]
        args = list(m.args)
        with g.inserting_before(m):
            if replace is not None and replace is not masked_mean and replace[0] == "from_end":
                _, d, start = replace
                new = g.call_function(slice_from_end, (args[0], d, start, spec[0][0], *reals))
                new.meta.update(m.meta)
                m.replace_all_uses_with(new)
                g.erase_node(m)
                continue
            if replace is not None and replace is not masked_mean and replace[0] == "tail":
                _, d, start = replace
                with g.inserting_after(m):
                    new = g.call_function(restore_tail, (m, args[0], d, start, spec[1][0],
                                                         *reals))
                m.replace_all_uses_with(new, delete_user_cb=lambda u: u is not new)
                new.meta.update(m.meta)
                continue
            if replace is not None and replace is not masked_mean:
                _, red_pos, count_pos = replace
                count_spec = spec.get(count_pos, ((), None))[0]
                count_x = args[count_pos]
            if replace is masked_mean:
                x, dim, keepdim, dtype = mean_args(m)
                sp = spec.get(0, ((), None))[0]
                new = g.call_function(replace, (x, dim, keepdim, dtype, sp, *reals))
                new.meta.update(m.meta)
                m.replace_all_uses_with(new)
                g.erase_node(m)
                continue
            for pos, (sp, fill) in spec.items():
                if fill == "count":
                    continue
                x = args[pos]
                new = g.call_function(fill_padding, (x, sp, fill, *reals))
                if isinstance(x, torch.fx.Node) and "val" in x.meta:
                    new.meta["val"] = x.meta["val"]
                args[pos] = new
            for pos, k in bounds.items():
                args[pos] = g.call_function(bound_index, (args[pos], k, *reals))
            if replace is not None:  # a loss's mean: its sum, over the real count
                kwargs = dict(m.kwargs)
                if red_pos < len(args):
                    args[red_pos] = 2
                else:
                    kwargs["reduction"] = 2
                m.args, m.kwargs = tuple(args), kwargs
        if replace is not None:
            with g.inserting_after(m):
                new = g.call_function(over_real_count, (m, count_x, count_spec, *reals))
            m.replace_all_uses_with(new, delete_user_cb=lambda u: u is not new)
            new.meta.update(m.meta)
            continue
        m.args = tuple(args)
    for node, pos, code in values:
        m = env[node]
        args = list(m.args)
        with g.inserting_before(m):
            for p in pos:
                args[p] = g.call_function(size_value, (code[p], *reals))
        m.args = tuple(args)
    g.lint()
    return torch.fx.GraphModule(gm, g, class_name=type(gm).__name__)
