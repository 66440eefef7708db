"""Dynamic dimensions padded to buckets, where padding provably cannot change a result.

A graph Dynamo traced with symbolic sizes (``dynamic=True``, ``mark_dynamic``, automatic
dynamic shapes) is compiled once per *bucket* instead of once per size when ``analyse`` proves
that running it at the bucket size on padded inputs and cutting the padding off the outputs
gives the unpadded results. The proof is structural. Most ops treat each dimension that carries
a dynamic size position by position (elementwise ops, views that keep the dynamic factor
innermost in its group, matmuls, reductions, softmax and norms over *other* dimensions,
embeddings, slices whose real positions stay a prefix: ``ids[:, 1:]``); the ops that mix
positions along a dynamic dimension (sums, means, max/argmax, softmax, logsumexp, contractions,
nll_loss and elementwise losses, embedding_dense_backward, gather/scatter, and their backwards)
are *masked* (masking.py): their operands' padded positions replaced by the reduction's identity,
a mean divided by the real count, so that the padding contributes exactly nothing; the real
sizes are inputs of the program, as are sizes the graph uses as values. No random op, no input
mutated along a dynamic dimension, and every dynamic size must be ``c * (s + k)`` (one symbol).
Anything else (var/std, cumsum, sort, scaled_dot_product_attention's fused op, which is
registered random) is compiled per size, with a one-time warning naming the op.

Layout: a dim of size ``c * (s + k)`` has ``c`` blocks of ``S + k`` positions in the padded
program (S: the bucket of s), the first ``s + k`` of each real. ``analyse`` only admits ops that
keep that layout.

Buckets (options ``bucket_size`` and ``num_dynamic_buckets``, through ``torch.compile(...,
options=...)`` or ``torch.tpu.compiler.set_dynamic_buckets``): with ``bucket_size=b`` only,
sizes round up to a multiple of ``b``; otherwise to a power of two of at least ``bucket_size``
(default 8), and ``num_dynamic_buckets`` (default unlimited) caps how many such powers are used:
sizes above the largest round up to a multiple of it. ``bucket_size=0`` turns bucketing off.
"""
from __future__ import annotations

import operator

import sympy
import torch
from torch._ops import OpOverload

from . import masking as _masking

aten = torch.ops.aten

# tests only: the value padding a floating-point input gets instead of 0 (NaN shows whether any
# padded position reaches a result)
DEBUG_PAD_VALUE = None

# ops that act on the dims given by their arguments and treat every other dim position-wise:
# op -> function(node, ndim of its first input) -> the dims it mixes, or None if not handled
_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default,
          aten._reshape_alias.default, aten.view_copy.default}
_SAME = {aten.clone.default, aten.alias.default, aten.detach.default, aten.lift_fresh_copy.default,
         aten._to_copy.default, torch.ops.prims.convert_element_type.default,
         aten.contiguous.default}

_FACTORIES = {aten.full.default, aten.zeros.default, aten.ones.default, aten.empty.memory_format,
              aten.empty_strided.default, aten.new_zeros.default, aten.new_ones.default,
              aten.new_empty.default, aten.new_full.default, aten.full_like.default,
              aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default,
              aten.scalar_tensor.default}


def _dims(d, ndim):
    if d is None:
        return list(range(ndim))
    d = [d] if isinstance(d, int) else list(d)
    return [x % ndim if ndim else 0 for x in d] if d else list(range(ndim))


def _mixed_dims(node):
    """{input position: dims of that input the op mixes}, or None (op not understood)."""
    t = node.target
    a = node.args
    kw = node.kwargs
    nd = [_ndim(x) for x in a]
    if t in (aten.mm.default,):
        return {0: [1], 1: [0]}
    if t in _masking._SDPA_OPS:
        return _sdpa_mixed(node)
    if t is aten.copy_.default or t is aten.copy.default:
        # self's values replaced by src's (broadcast): position-wise when src's dims are
        # self's trailing ones (or 1), the write-back of an input a graph mutates
        dst, src = _sizes(a[0].meta["val"]), _sizes(a[1].meta["val"])
        if len(src) <= len(dst) and all(e == 1 or sympy.simplify(e - f) == 0
                                        for e, f in zip(src, dst[len(dst) - len(src):])):
            return {}
        return None
    if t is aten.addmm.default:
        return {1: [1], 2: [0]}
    if t is aten.bmm.default:
        return {0: [2], 1: [1]}
    if t in (aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.amin.default,
             aten.any.dim, aten.any.dims, aten.all.dim, aten.prod.dim_int, aten.argmax.default,
             aten.argmin.default, aten.var.correction, aten.std.correction,
             aten.logsumexp.default):
        d = a[1] if len(a) > 1 else kw.get("dim")
        return {0: _dims(d, nd[0])}
    if t in (aten.sum.default, aten.mean.default, aten.amax.default, aten.any.default,
             aten.all.default, aten.prod.default):
        return {0: list(range(nd[0]))}
    if t in (aten._softmax.default, aten._log_softmax.default, aten.cumsum.default):
        return {0: _dims(a[1], nd[0])}
    if t in (aten._softmax_backward_data.default, aten._log_softmax_backward_data.default):
        return {0: _dims(a[2], nd[0]), 1: _dims(a[2], nd[1])}
    if t is aten.native_layer_norm.default:
        k = len(a[1])
        return {0: list(range(nd[0] - k, nd[0])), 2: list(range(nd[2] or 0)),
                3: list(range(nd[3] or 0))}
    if t is aten.embedding.default:
        # the table: every row may be read; indices computed in the graph could hold anything
        # in the padding (an index check would fail), so only an input's zero padding is safe
        if not (isinstance(a[1], torch.fx.Node) and a[1].op == "placeholder"):
            return None
        return {0: list(range(nd[0]))}
    if t in (aten.cat.default,):
        d = a[1] if len(a) > 1 else 0
        return {0: ("list", d)}
    if t is aten.slice.Tensor and _slice_keeps_prefix(node):
        return {}
    if t is aten.select.int and _select_keeps_prefix(node):
        return {}
    if t is aten.select_scatter.default and _select_keeps_prefix(node, scatter=True):
        return {}
    if t is aten.slice_scatter.default:  # the slice's backward: the same positions, written
        # position-wise when src reaches self's end (or has a static size): otherwise src's
        # padding would land on self's last real positions (masking.py restores them)
        if not _slice_keeps_prefix(node, scatter=True):
            return None
        d = (a[2] if len(a) > 2 else 0) % nd[0]
        start = (a[3] if len(a) > 3 else 0) or 0
        ss, sd = _sizes(a[0].meta["val"])[d], _sizes(a[1].meta["val"])[d]
        return {} if not _syms(sd) or sympy.simplify(start + sd - ss) == 0 else None
    if t in (aten.slice.Tensor, aten.select.int, aten.narrow.default, aten.split.Tensor,
             aten.split_with_sizes.default):
        d = a[1] if len(a) > 1 else 0
        return {0: _dims(d, nd[0])}
    if t in (aten.tril.default, aten.triu.default):
        # keeps (i, j) by its positions: the same in the padded layout for plain sizes
        sz = _sizes(a[0].meta["val"])[-2:]
        return {} if all(isinstance(e, sympy.Symbol) or not _syms(e) for e in sz) else None
    if t in _FACTORIES:  # one value everywhere (or none): the padding is a copy of it
        return {}
    if t in (aten.arange.default, aten.arange.start, aten.arange.start_step):
        # arange(S) starts with arange(s); a start that is a size would shift every value
        return None if t is not aten.arange.default and _is_size_node(a[0]) else {}
    if t in (aten.permute.default, aten.t.default, aten.transpose.int, aten.unsqueeze.default,
             aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.expand.default):
        return {}
    return None


def _no_dropout(n) -> bool:
    """An attention op tagged random that draws nothing: its ``dropout_p`` is 0."""
    if n.target not in _masking._SDPA_OPS:
        return False
    names = [a.name for a in n.target._schema.arguments]
    i = names.index("dropout_p")
    p = n.args[i] if i < len(n.args) else n.kwargs.get("dropout_p", 0.0)
    return isinstance(p, (int, float)) and p == 0


def _sdpa_mixed(n):
    """Attention mixes the key/value positions (masking.py masks them) and contracts the head
    dim; each query position is computed on its own."""
    nd = _ndim(n.args[0])
    if nd is None:
        return None
    mixed = {0: [nd - 1], 1: [nd - 2, nd - 1], 2: [nd - 2, nd - 1]}
    i = _masking.sdpa_bias_position(n)
    if i is None:
        return None
    if i < len(n.args) and n.args[i] is not None:
        if not _masking.sdpa_mask_fits(n, i):
            return None
        mixed[i] = [_ndim(n.args[i]) - 1]
    return mixed


def _slice_keeps_prefix(n, scatter=False) -> bool:
    """``x[.., start:end]`` with a static start >= 0 and step 1 along a one-block dynamic dim:
    output position j is input position start + j, so real positions stay a prefix (``ids[:,
    1:]``, ``logits[:, :-1]``); an end that is a size takes the bucket's value, which is the
    padded size of the output."""
    a = n.args[1:] if scatter else n.args  # slice_scatter(self, src, dim, start, end, step)
    d = a[1] if len(a) > 1 else 0
    start = a[2] if len(a) > 2 else 0
    step = a[4] if len(a) > 4 else 1
    xv = n.args[0].meta.get("val")
    ov = (n.args[1] if scatter else n).meta.get("val")
    if not isinstance(xv, torch.Tensor) or not isinstance(ov, torch.Tensor):
        return False
    d %= xv.dim()
    if not (start is None or (isinstance(start, int) and start >= 0)) or step != 1:
        return False
    return _plain(_sizes(xv)[d]) and _plain(_sizes(ov)[d])


def _select_keeps_prefix(n, scatter=False) -> bool:
    """``x[.., i]`` (or its select_scatter) with a static i >= 0 along a one-block dynamic dim:
    a real position."""
    xv = n.args[0].meta.get("val")
    d, i = n.args[2:4] if scatter else n.args[1:3]
    return isinstance(xv, torch.Tensor) and isinstance(i, int) and i >= 0 \
        and _plain(_sizes(xv)[d % xv.dim()])


def _ndim(x):
    v = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
    return v.dim() if isinstance(v, torch.Tensor) else None


def _sizes(v):
    return [s.node.expr if isinstance(s, torch.SymInt) else sympy.Integer(int(s))
            for s in v.shape]


def _syms(e) -> set:
    return set(e.free_symbols) if isinstance(e, sympy.Basic) else set()


def _block(e):
    """``(c, s, k)`` for a dynamic size ``c * (s + k)`` (c > 0 and k integers), else None. Its
    padded size is ``c * (S + k)``: c blocks whose first ``s + k`` positions are real."""
    syms = _syms(e)
    if len(syms) != 1:
        return None
    s = next(iter(syms))
    e = sympy.expand(e)
    c = e.coeff(s)
    r = sympy.simplify(e - c * s)
    if not (c.is_Integer and c > 0 and r.is_Integer) or int(r) % int(c):
        return None
    return int(c), s, int(r) // int(c)


def _monomial_ok(e) -> bool:
    """A dynamic size we can cut the padding off: ``c * (s + k)`` (see ``_block``)."""
    return not _syms(e) or _block(e) is not None


def _plain(e) -> bool:
    """A size whose padded positions all follow its real ones (one block, ``s + k``)."""
    b = _block(e) if _syms(e) else (1, None, 0)
    return b is not None and b[0] == 1


def _view_ok(src, dst) -> bool:
    """A reshape keeps each dynamic factor innermost in its group of merged/split dims (so the
    padded layout maps onto itself: ``(b, s, h) -> (b*s, h) -> (b, s, h)``)."""
    src = [e for e in src if e != 1]
    dst = [e for e in dst if e != 1]
    i = j = 0
    while i < len(src) and j < len(dst):
        gi, gj = [i], [j]
        pi, pj = src[i], dst[j]
        while sympy.simplify(pi - pj) != 0:
            num, den = sympy.simplify(pj / pi).as_numer_denom()
            if den == 1 and i + 1 < len(src):  # the destination group is the larger one
                i += 1
                gi.append(i)
                pi = pi * src[i]
            elif num == 1 or (num.is_number and den.is_number and num < den) or den != 1:
                if j + 1 >= len(dst):
                    return False
                j += 1
                gj.append(j)
                pj = pj * dst[j]
            else:
                return False
        dyn_i = [k for k in gi if _syms(src[k])]
        dyn_j = [k for k in gj if _syms(dst[k])]
        if dyn_i or dyn_j:
            if len(dyn_i) != 1 or len(dyn_j) != 1 or dyn_i[0] != gi[-1] or dyn_j[0] != gj[-1]:
                return False
            if _syms(src[dyn_i[0]]) != _syms(dst[dyn_j[0]]):
                return False
        i += 1
        j += 1
    return i == len(src) and j == len(dst)


def analyse(gm: torch.fx.GraphModule, mutated=()):
    """A ``Plan`` when padding the graph's dynamic dims is provably exact, else the reason (a
    string naming the op) why not, or None when the graph has no dynamic size at all."""
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    dynamic = False
    inputs = []
    for i, p in enumerate(phs):
        v = p.meta.get("val")
        if isinstance(v, torch.SymInt):
            e = v.node.expr
            if not _syms(e):
                inputs.append(("other", None))
                continue
            if not _monomial_ok(e):
                return "a size input that is not a multiple of one size"
            inputs.append(("sym", e))
            dynamic = True
        elif isinstance(v, torch.Tensor):
            dims = []
            for d, e in enumerate(_sizes(v)):
                if _syms(e):
                    if not _monomial_ok(e):
                        return "an input whose size is not a multiple of one size"
                    dims.append((d, e))
                    if i in mutated:
                        return "an input mutated along a dynamic dimension"
            inputs.append(("tensor", dims))
            dynamic = dynamic or bool(dims)
        else:
            inputs.append(("other", None))
    if not dynamic:
        return None
    syms = sorted({x for kind, info in inputs if kind != "other"
                   for x in (_syms(info) if kind == "sym" else
                             set().union(*[_syms(e) for _, e in info]))}, key=str)
    masks = []  # (node, {arg position: (((dim, c, symbol), ...), fill)}, replacement)
    values = []  # (node, [arg positions], {position: expression code})
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        t = n.target
        v = n.meta.get("val")
        if t is operator.getitem or not isinstance(t, OpOverload):
            if t in (operator.mul, operator.add, operator.sub, operator.floordiv,
                     operator.getitem) or getattr(t, "__name__", "") == "sym_size":
                continue
            if isinstance(t, OpOverload) and t is aten.sym_size.int:
                continue
            return f"{getattr(t, '__name__', t)}"
        if t is aten.sym_size.int or t is aten.sym_numel.default:
            continue
        name = str(t)
        if torch.Tag.nondeterministic_seeded in t.tags and not _no_dropout(n):
            return f"{name} (random: padding would change its numbers)"
        # a dynamic size used as a value (not a shape) would take the bucket's value: its real
        # value, traced, where the op takes one (masking.py)
        if _size_as_value(n):
            pos = _masking.value_positions(n, _is_size_node)
            codes = {p: _masking.expression_code(n.args[p].meta["val"].node.expr, syms)
                     for p in pos or ()}
            if pos is None or any(c is None for c in codes.values()):
                return f"{name} (a dynamic size used as a value)"
            values.append((n, pos, codes))
        outs = v if isinstance(v, (list, tuple)) else [v]
        for o in outs:
            if isinstance(o, torch.Tensor) and not all(_monomial_ok(e) for e in _sizes(o)):
                return f"{name} (a dynamic size that is not a multiple of one size)"
        if t in _VIEWS:
            src = _sizes(n.args[0].meta["val"])
            if not _view_ok(src, _sizes(v)):
                return f"{name} (a reshape that moves a dynamic size)"
            continue
        if t in _SAME or torch.Tag.pointwise in t.tags:
            continue
        mixed = _mixed_dims(n)
        if mixed is None or _mixes_dynamic(n, mixed):
            masked = _mask_plan(n, name)
            if isinstance(masked, str):
                return masked
            if masked is not None:
                if masked[0] or masked[2]:
                    masks.append((n,) + masked)
                continue
        if mixed is None:
            return f"{name} (not known to keep dynamic dimensions position-wise)"
        for pos, dims in mixed.items():
            if pos >= len(n.args):
                continue
            arg = n.args[pos]
            if isinstance(dims, tuple) and dims[0] == "list":  # cat: every list element
                for x in arg:
                    xv = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
                    if isinstance(xv, torch.Tensor) and _syms(_sizes(xv)[dims[1] % xv.dim()]):
                        return f"{name} (along a dynamic dimension)"
                continue
            av = arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None
            if not isinstance(av, torch.Tensor):
                continue
            sz = _sizes(av)
            if any(_syms(sz[d]) for d in dims if d < len(sz)):
                return f"{name} (mixes positions along a dynamic dimension)"
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    outs = []
    for o in (out if isinstance(out, (list, tuple)) else [out]):
        v = o.meta.get("val") if isinstance(o, torch.fx.Node) else o
        if isinstance(v, torch.SymInt) and isinstance(v.node.expr, sympy.Expr):
            # a size saved for the backward: returned as its real value, not the bucket's
            outs.append(("sym", v.node.expr))
            continue
        if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return "a dynamic size returned as a value"
        if isinstance(v, torch.Tensor):
            outs.append([(d, e) for d, e in enumerate(_sizes(v)) if _syms(e)])
        else:
            outs.append([])
    equal = [pair for n in gm.graph.nodes for pair in n.meta.get(_masking.EQUAL_SIZES, ())]
    if masks or values:
        return Plan(inputs, outs, syms, masks, values, equal)
    return Plan(inputs, outs, equal=equal)


def _mixes_dynamic(n, mixed) -> bool:
    for pos, dims in mixed.items():
        if pos >= len(n.args) or isinstance(dims, tuple):
            continue
        av = n.args[pos].meta.get("val") if isinstance(n.args[pos], torch.fx.Node) else None
        if isinstance(av, torch.Tensor):
            sz = _sizes(av)
            if any(_syms(sz[d]) for d in dims if d < len(sz)):
                return True
    return False


def _mask_plan(n, name):
    """For an op that mixes positions along a dynamic dim: ({position: (spec, fill)},
    replacement) that masks it exactly (masking.py), a reason why not, or None (no rule)."""
    r = _masking.rule(n, _ndim)
    if r is None:
        return None
    if isinstance(r, str):
        return f"{name} ({r} along a dynamic dimension)"
    spec = {}
    bounds = {}
    for pos, (src, d) in r.bounds.items():
        sv = n.args[src].meta.get("val") if isinstance(n.args[src], torch.fx.Node) else None
        if isinstance(sv, torch.Tensor) and _syms(_sizes(sv)[d]):
            c, sym, k = _block(_sizes(sv)[d])
            if c != 1:
                return f"{name} (indices into a flattened dynamic dimension)"
            bounds[pos] = (sym, k)
    for pos, dims in list(r.masks.items()) + [(p, (d, None)) for p, d in r.fixed.items()]:
        dims, fill = dims
        arg = n.args[pos] if pos < len(n.args) else None
        av = arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None
        if not isinstance(av, torch.Tensor):
            continue
        sz = _sizes(av)
        dyn = []
        for d in dims:
            if d < len(sz) and _syms(sz[d]):
                if fill is None:
                    return f"{name} (mixes positions along a dynamic dimension)"
                c, sym, k = _block(sz[d])
                if (r.index or fill == "first") and c != 1:
                    return f"{name} (an index along a flattened dynamic dimension)"
                dyn.append((d, c, sym, k))
        if dyn:
            spec[pos] = (tuple(dyn), fill)
    return spec, r.replace, bounds


def _is_size_node(x) -> bool:
    return isinstance(x, torch.fx.Node) and isinstance(x.meta.get("val"), torch.SymInt) \
        and bool(_syms(x.meta["val"].node.expr))


_SHAPE_USERS = _VIEWS | {aten.expand.default, aten.full.default, aten.zeros.default,
                         aten.ones.default, aten.empty.memory_format, aten.new_zeros.default,
                         aten.new_ones.default, aten.new_empty.default, aten.new_full.default,
                         aten.empty_strided.default, aten.arange.default, aten.arange.start,
                         aten.arange.start_step, aten.slice.Tensor,
                         aten.slice_scatter.default}


def _sym_nodes(x) -> bool:
    if isinstance(x, (list, tuple)):
        return any(_sym_nodes(e) for e in x)
    return isinstance(x, torch.fx.Node) and isinstance(
        x.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool))


def _size_as_value(n) -> bool:
    """Whether a symbolic size reaches an argument that is a value, not a shape: anywhere
    for ops outside ``_SHAPE_USERS``; their ``Scalar`` arguments (a fill value) otherwise,
    except ``arange``'s bounds (positions stay positions)."""
    t = n.target
    schema = t._schema.arguments
    named = dict(zip([a.name for a in schema], n.args))
    named.update(n.kwargs)
    for arg in schema:
        x = named.get(arg.name)
        if x is None or not _sym_nodes(x):
            continue
        if t not in _SHAPE_USERS:
            return True
        if str(arg.type) in ("Scalar", "float", "bool") and "arange" not in str(t):
            return True
    return False


class Plan:
    """Which inputs/outputs carry which dynamic sizes (symbols), and for a masked graph
    (``masked``) the ops to mask and the sizes used as values (masking.py)."""

    def __init__(self, inputs, outputs, syms=(), masks=(), values=(), equal=()):
        # per placeholder: ("sym", c * s) | ("tensor", [(dim, c * s)]) | ("other", None)
        self.inputs = inputs
        self.outputs = outputs  # per output: [(dim, size expression)], or ("sym", expression)
        self.syms = list(syms)  # the real sizes a masked graph takes, in this order
        self.masks = list(masks)
        self.values = list(values)
        self.masked = bool(self.masks or self.values)
        # sizes of different symbols that an op needs equal (masking.sdpa_mask_fits): the
        # unpadded op would raise otherwise, while their buckets could still agree
        self.equal = list(equal)

    def symbol_values(self, args) -> dict:
        """The actual value of each dynamic size in this call."""
        vals = {}
        for (kind, info), a in zip(self.inputs, args):
            if kind == "sym":
                exprs = [(info, int(a))]
            elif kind == "tensor" and isinstance(a, torch.Tensor):
                exprs = [(e, a.shape[d]) for d, e in info]
            else:
                continue
            for e, v in exprs:
                c, s, k = _block(e)
                vals.setdefault(s, v // c - k)
        for a, b in self.equal:
            va, vb = int(a.subs(vals)), int(b.subs(vals))
            if va != vb:
                raise RuntimeError(f"The size of tensor a ({va}) must match the size of tensor "
                                   f"b ({vb}) at an attention's mask (torchtpu.compile: sizes "
                                   f"{a} and {b})")
        return vals

    def masked_graph(self, gm):
        """The graph rewritten with its masks (one more input per size: its real value)."""
        masks = [(n, {p: (tuple((d, c, self.syms.index(s), k) for d, c, s, k in sp), fill)
                      for p, (sp, fill) in spec.items()}, rep,
                  {p: (self.syms.index(s), k) for p, (s, k) in bounds.items()})
                 for n, spec, rep, bounds in self.masks]
        return _masking.rewrite(gm, self.syms, masks, self.values)

    def mask_summary(self) -> str:
        ops = sorted({str(n.target) for n, *_ in self.masks}
                     | {f"{n.target} (size as value)" for n, _, _ in self.values})
        return ", ".join(ops)


def bucket(n: int, opts: dict) -> int:
    """The padded size for a dynamic size ``n`` (see the module doc)."""
    size = opts.get("bucket_size")
    count = opts.get("num_dynamic_buckets")
    if count is None and size is not None:
        return -(-n // size) * size
    base = size or 8
    b = base
    k = 1
    while b < n:
        if count is not None and k >= count:
            return -(-n // b) * b
        b *= 2
        k += 1
    return b


def enabled(opts: dict) -> bool:
    return opts.get("bucket_size", 8) != 0 and opts.get("num_dynamic_buckets", 1) != 0
