"""Collective ops of ``torch.tpu.ops``: ``all_gather_dim``, ``reduce_scatter_dim`` and
``ragged_all_to_all`` (MoE token dispatch).

No TorchTPU source was available to read; the signatures follow PyTorch's functional
collectives (``group`` is a ProcessGroup, a group name or a 1-D DeviceMesh, as
``torch.distributed._functional_collectives`` takes) and, for ``ragged_all_to_all``,
``jax.lax.ragged_all_to_all``:

- ``all_gather_dim(x, dim, group)``: every rank's ``x`` concatenated along ``dim`` in group-rank
  order (``funcol.all_gather_tensor(x, dim, group)``). Backward: ``reduce_scatter_dim`` (sum).
- ``reduce_scatter_dim(x, dim, reduce_op="sum", group)``: ``x`` reduced over the group, then
  this rank's ``1/n`` slice along ``dim`` (``dim``'s size must divide by n). Backward (sum, avg):
  ``all_gather_dim`` (divided by n for avg).
- ``ragged_all_to_all(input, output, input_offsets, send_sizes, output_offsets, recv_sizes,
  group)``: for each peer ``j``, rows ``input[input_offsets[j] : + send_sizes[j]]`` go to peer
  ``j``, which writes them into its ``output`` at row ``output_offsets[j]`` (offsets as the
  sender gives them for the receiver's buffer, JAX's convention); ``recv_sizes[i]`` is how many
  rows this rank receives from peer ``i``. Returns ``output`` with the received rows written
  (a new tensor; ``output`` is not modified). Differentiable in ``input`` and ``output``.

Each is a custom op in the ``tpu`` namespace (``torch.ops.tpu.<name>``, taking the group's
name) with a fake kernel and autograd. In eager (Strict and Fused, "tpu" or CPU tensors) it runs
as its definition composed from PyTorch's functional collectives (``_c10d_functional``: on
"tpu" those are tpu_dist's programs, on CPU gloo's), so any backend works. Inside a compiled
graph the lowering that ``distributed/tpu_ops.py`` registers in the one table runs it as part
of the graph's SPMD program (``lax.all_gather`` / ``psum_scatter`` / a padded ``all_to_all``;
``lax.ragged_all_to_all`` where XLA implements it, TPU and GPU). As in any SPMD program (and
JAX's ``shard_map``), every rank's operands then have the same shapes: ``ragged_all_to_all``'s
raggedness lives in the sizes and offsets, not in the buffers' row counts.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["all_gather_dim", "reduce_scatter_dim", "ragged_all_to_all"]

_lib = torch.library.Library("tpu", "FRAGMENT")
_lib.define("all_gather_dim(Tensor x, int dim, str group_name) -> Tensor")
_lib.define("reduce_scatter_dim(Tensor x, int dim, str reduce_op, str group_name) -> Tensor")
_lib.define("ragged_all_to_all(Tensor input, Tensor output, Tensor input_offsets, "
            "Tensor send_sizes, Tensor output_offsets, Tensor recv_sizes, str group_name) "
            "-> Tensor")
_ops = torch.ops.tpu
_c10d = torch.ops._c10d_functional
_REDUCE = ("sum", "avg", "product", "min", "max")


def group_name(group) -> str:
    """The c10d name of ``group`` (a ProcessGroup, a name, a 1-D DeviceMesh, or None: WORLD)."""
    from torch.distributed import _functional_collectives as funcol

    if group is None:
        group = dist.group.WORLD
    return funcol._resolve_group_name(group)


def _size(name) -> int:
    return dist.distributed_c10d._get_group_size_by_name(name)


def _dim(x, dim, op):
    if x.dim() == 0:
        raise RuntimeError(f"{op}: expected a tensor with at least one dimension, got a 0-d "
                           "tensor")
    if not -x.dim() <= dim < x.dim():
        raise IndexError(f"{op}: dim {dim} is out of range for a {x.dim()}-d tensor")
    return dim % x.dim()


def all_gather_dim(x: torch.Tensor, dim: int = 0, group=None) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim`` (group-rank order)."""
    return _ops.all_gather_dim(x, dim, group_name(group))


def reduce_scatter_dim(x: torch.Tensor, dim: int = 0, reduce_op: str = "sum",
                       group=None) -> torch.Tensor:
    """``x`` reduced over the group (``reduce_op``: sum, avg, product, min, max), this rank's
    slice of ``dim``."""
    op = str(reduce_op).lower()
    if op not in _REDUCE:
        raise ValueError(f"reduce_scatter_dim: unsupported reduce_op {reduce_op!r} "
                         f"(expected one of {', '.join(_REDUCE)})")
    return _ops.reduce_scatter_dim(x, dim, op, group_name(group))


def ragged_all_to_all(input: torch.Tensor, output: torch.Tensor, input_offsets: torch.Tensor,
                      send_sizes: torch.Tensor, output_offsets: torch.Tensor,
                      recv_sizes: torch.Tensor, group=None) -> torch.Tensor:
    """``jax.lax.ragged_all_to_all`` over a process group; see the module docstring."""
    return _ops.ragged_all_to_all(input, output, input_offsets, send_sizes, output_offsets,
                                  recv_sizes, group_name(group))


# ---------------------------------------------------------------- fake kernels

@torch.library.register_fake("tpu::all_gather_dim")
def _gather_fake(x, dim, group_name):
    d = _dim(x, dim, "all_gather_dim")
    shape = list(x.shape)
    shape[d] *= _size(group_name)
    return x.new_empty(shape)


@torch.library.register_fake("tpu::reduce_scatter_dim")
def _scatter_fake(x, dim, reduce_op, group_name):
    d = _dim(x, dim, "reduce_scatter_dim")
    n = _size(group_name)
    torch._check(x.shape[d] % n == 0,
                 lambda: f"reduce_scatter_dim: dim {dim} of size {x.shape[d]} is not divisible "
                         f"by the group size {n}")
    shape = list(x.shape)
    shape[d] //= n
    return x.new_empty(shape)


def _ragged_check(input, output, offsets):
    if input.dim() == 0 or output.dim() == 0 or input.shape[1:] != output.shape[1:] \
            or input.dtype != output.dtype:
        raise RuntimeError("ragged_all_to_all: input and output must have one dtype and the "
                           f"same trailing dims, got {input.dtype}{list(input.shape)} and "
                           f"{output.dtype}{list(output.shape)}")
    for t in offsets:
        if t.dim() != 1 or t.dtype.is_floating_point or t.dtype == torch.bool:
            raise RuntimeError("ragged_all_to_all: offsets and sizes must be 1-D integer "
                               "tensors (one entry per group rank)")


@torch.library.register_fake("tpu::ragged_all_to_all")
def _ragged_fake(input, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                 group_name):
    _ragged_check(input, output, (input_offsets, send_sizes, output_offsets, recv_sizes))
    return torch.empty_like(output)


# ---------------------------------------------------------------- eager: the definitions,
# composed from PyTorch's functional collectives (tpu_dist's kernels on "tpu", gloo's on CPU)

def _wait(t):
    return _c10d.wait_tensor(t)


def _gather_eager(x, dim, group_name):
    d = _dim(x, dim, "all_gather_dim")
    n = _size(group_name)
    g = _wait(_c10d.all_gather_into_tensor(x.contiguous(), n, group_name))
    if d == 0:
        return g
    return torch.cat(torch.chunk(g, n, 0), d)


def _scatter_eager(x, dim, reduce_op, group_name):
    d = _dim(x, dim, "reduce_scatter_dim")
    n = _size(group_name)
    if x.shape[d] % n:
        raise RuntimeError(f"reduce_scatter_dim: dim {dim} of size {x.shape[d]} is not "
                           f"divisible by the group size {n}")
    # the n slices of dim d stacked along dim 0: reduce-scattering dim 0 leaves this rank's
    # slice, reduced, in x's layout
    src = x.contiguous() if d == 0 else torch.cat(torch.chunk(x, n, d), 0)
    return _wait(_c10d.reduce_scatter_tensor(src, reduce_op, n, group_name))


def _a2a(x, outs, ins, group_name):
    return _wait(_c10d.all_to_all_single(x.contiguous(), outs, ins, group_name))


def _ragged_eager(input, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                  group_name):
    _ragged_check(input, output, (input_offsets, send_sizes, output_offsets, recv_sizes))
    n = _size(group_name)
    io, ss, rs = (t.tolist() for t in (input_offsets, send_sizes, recv_sizes))
    if not len(io) == len(ss) == len(rs) == output_offsets.shape[0] == n:
        raise RuntimeError(f"ragged_all_to_all: offsets and sizes need {n} entries (the group "
                           "size)")
    # where each peer's rows go in this rank's output: the peers' output_offsets[me]
    where = _a2a(output_offsets.to(torch.int64), [1] * n, [1] * n, group_name).tolist()
    data = torch.cat([input[o:o + s] for o, s in zip(io, ss)]) if n else input[:0]
    got = _a2a(data, rs, ss, group_name)
    out = output.clone()
    start = 0
    for o, s in zip(where, rs):
        if o < 0 or o + s > out.shape[0]:
            raise RuntimeError(f"ragged_all_to_all: rows [{o}, {o + s}) are outside the "
                               f"output's {out.shape[0]} rows")
        out[o:o + s] = got[start:start + s]
        start += s
    return out


for _name, _fn in (("all_gather_dim", _gather_eager), ("reduce_scatter_dim", _scatter_eager),
                   ("ragged_all_to_all", _ragged_eager)):
    _lib.impl(_name, _fn, "CompositeExplicitAutograd")


# ---------------------------------------------------------------- autograd

def _gather_setup(ctx, inputs, output):
    _, ctx.dim, ctx.group_name = inputs


def _gather_backward(ctx, grad):
    return _ops.reduce_scatter_dim(grad, ctx.dim, "sum", ctx.group_name), None, None


def _scatter_setup(ctx, inputs, output):
    _, ctx.dim, ctx.reduce_op, ctx.group_name = inputs


def _scatter_backward(ctx, grad):
    if ctx.reduce_op not in ("sum", "avg"):
        raise RuntimeError(f"reduce_scatter_dim: the backward of reduce_op "
                           f"{ctx.reduce_op!r} is not implemented (sum and avg are)")
    g = _ops.all_gather_dim(grad, ctx.dim, ctx.group_name)
    if ctx.reduce_op == "avg":
        g = g / _size(ctx.group_name)
    return g, None, None, None


def _ragged_setup(ctx, inputs, output):
    input, output_, input_offsets, send_sizes, output_offsets, recv_sizes, name = inputs
    ctx.save_for_backward(input_offsets, send_sizes, output_offsets, recv_sizes)
    ctx.input_shape, ctx.group_name = input.shape, name
    ctx.dtype = input.dtype


def _ragged_backward(ctx, grad):
    io, ss, oo, rs = ctx.saved_tensors
    name = ctx.group_name
    n = _size(name)
    # the reverse exchange: each rank sends back the rows it received, from where they were
    # written, to where they came from in the sender's input
    where = _wait(_c10d.all_to_all_single(oo.contiguous(), [1] * n, [1] * n, name))
    came_from = _wait(_c10d.all_to_all_single(io.contiguous(), [1] * n, [1] * n, name))
    d_input = d_output = None
    if ctx.needs_input_grad[0]:
        d_input = _ops.ragged_all_to_all(
            grad, grad.new_zeros(ctx.input_shape), where.to(io.dtype), rs, came_from.to(oo.dtype),
            ss, name)
    if ctx.needs_input_grad[1]:
        rows = torch.arange(grad.shape[0], device=grad.device)[:, None]
        w = where.to(rows.dtype)[None, :]
        written = ((rows >= w) & (rows < w + rs.to(rows.dtype)[None, :])).any(1)
        d_output = grad.masked_fill(written.reshape((-1,) + (1,) * (grad.dim() - 1)), 0)
    return d_input, d_output, None, None, None, None, None


torch.library.register_autograd("tpu::all_gather_dim", _gather_backward,
                                setup_context=_gather_setup)
torch.library.register_autograd("tpu::reduce_scatter_dim", _scatter_backward,
                                setup_context=_scatter_setup)
torch.library.register_autograd("tpu::ragged_all_to_all", _ragged_backward,
                                setup_context=_ragged_setup)
