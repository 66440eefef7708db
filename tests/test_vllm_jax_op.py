"""torch.tpu.pallas.jax_op as the vLLM work needs it (TorchTPU's signature): compiled graphs
trace the JAX function inline (no CPU fallback, no Dynamo graph break), ``donate_argnums``
writes arguments in place with their buffers donated, ``fake`` overrides the shape function,
``mesh``/``in_specs``/``out_specs`` run the function per shard. Compared with PyTorch on CPU."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
import torch

import torchtpu  # noqa: F401


def test_jax_op_lowered_inline_in_compiled_graphs_without_graph_break():
    op = torch.tpu.pallas.jax_op("vt_sin_mul", lambda x, y: jnp.sin(x) * y)

    def f(x, y):
        return op(x + 1, y).sum(0) * 2

    a, b = torch.randn(4, 5), torch.randn(4, 5)
    torch._dynamo.reset()
    explain = torch._dynamo.explain(f)(a.to("tpu"), b.to("tpu"))
    assert explain.graph_break_count == 0, explain.break_reasons
    torch.tpu.reset_metrics()
    got = torch.compile(f, backend="tpu", fullgraph=True)(a.to("tpu"), b.to("tpu"))
    c = torch.tpu.metrics()["counters"]
    torch.testing.assert_close(got.cpu(), (torch.sin(a + 1) * b).sum(0) * 2)
    assert not c.get("compile_cpu_fallbacks"), c


def test_jax_op_backward_in_compiled_graph():
    op = torch.tpu.pallas.jax_op("vt_sq", lambda x: x * x)
    a = torch.randn(6)
    x = a.to("tpu").requires_grad_()

    def f(x):
        return op(x).sum()

    torch.tpu.reset_metrics()
    torch.compile(f, backend="tpu")(x).backward()
    torch.testing.assert_close(x.grad.cpu(), 2 * a)
    assert not torch.tpu.metrics()["counters"].get("compile_cpu_fallbacks")


def _scatter_rows(cache, rows, idx):
    """``cache`` with ``rows`` written at ``idx``."""
    return cache.at[idx].set(rows)


@pytest.mark.parametrize("device", ["tpu", "cpu"])
def test_jax_op_donate_argnums_writes_in_place(device):
    op = torch.tpu.pallas.jax_op(f"vt_scatter_{device}", _scatter_rows, donate_argnums=(0,))
    cache = torch.zeros(8, 3)
    rows, idx = torch.randn(2, 3), torch.tensor([5, 1])
    want = cache.clone()
    want[idx] = rows
    c = cache.to(device)
    view = c[5]  # a view taken before the call sees the write
    assert op(c, rows.to(device), idx.to(device)) is None
    torch.testing.assert_close(c.cpu(), want)
    torch.testing.assert_close(view.cpu(), rows[0])


def test_jax_op_donation_reuses_the_buffer_and_spares_shared_arrays():
    op = torch.tpu.pallas.jax_op("vt_scatter_share", _scatter_rows, donate_argnums=0)
    c = torch.zeros(1024, 64, device="tpu")
    from torchtpu.runtime import buffer as _buffer

    ptr = _buffer.buffer_of(c).array.unsafe_buffer_pointer()
    op(c, torch.ones(1, 64, device="tpu"), torch.tensor([3], device="tpu"))
    # donated: XLA wrote the result into the same device buffer (no copy of the cache)
    assert _buffer.buffer_of(c).array.unsafe_buffer_pointer() == ptr
    torch.testing.assert_close(c.cpu()[3], torch.ones(64))
    # an array another storage shares is not donated (that storage keeps its data)
    a = torch.zeros(4, 2, device="tpu")
    b = torch.empty(4, 2, device="tpu")
    b.copy_(a)  # may share a's immutable array
    op(a, torch.ones(1, 2, device="tpu"), torch.tensor([0], device="tpu"))
    torch.testing.assert_close(b.cpu(), torch.zeros(4, 2))
    torch.testing.assert_close(a.cpu()[0], torch.ones(2))


def test_jax_op_donating_in_compiled_graph():
    op = torch.tpu.pallas.jax_op("vt_scatter_compiled", _scatter_rows, donate_argnums=(0,))

    def f(cache, rows, idx):
        op(cache, rows * 2, idx)
        return cache.sum(0)

    cache, rows, idx = torch.randn(8, 3), torch.randn(2, 3), torch.tensor([7, 0])
    want_cache = cache.clone()
    want = f(want_cache, rows, idx)
    c = cache.to("tpu")
    torch.tpu.reset_metrics()
    got = torch.compile(f, backend="tpu", fullgraph=True)(c, rows.to("tpu"), idx.to("tpu"))
    m = torch.tpu.metrics()["counters"]
    torch.testing.assert_close(got.cpu(), want)
    torch.testing.assert_close(c.cpu(), want_cache)
    assert not m.get("compile_cpu_fallbacks"), m
    assert m.get("compile_donated_buffers", 0) >= 1, m


def test_jax_op_donating_must_return_only_the_new_values():
    op = torch.tpu.pallas.jax_op("vt_bad_donate", lambda c, x: (c + x, x.sum()),
                                 donate_argnums=(0,))
    with pytest.raises(RuntimeError, match="fn must return exactly the new values"):
        op(torch.zeros(3, device="tpu"), torch.ones(3, device="tpu"))


def test_jax_op_fake_override():
    calls = []

    def fake(x):
        calls.append(x.shape)
        return torch.empty(x.shape[0], dtype=x.dtype, device=x.device)

    op = torch.tpu.pallas.jax_op("vt_rowsum", lambda x: x.sum(1), fake=fake)
    x = torch.randn(3, 4)
    got = torch.compile(lambda x: op(x) + 1, backend="tpu", fullgraph=True)(x.to("tpu"))
    torch.testing.assert_close(got.cpu(), x.sum(1) + 1)
    assert calls, "the fake override was not used"


def test_jax_op_mesh_partition_specs():
    from jax.sharding import Mesh, PartitionSpec as P

    mesh = Mesh(jax.devices()[:1], ("x",))
    op = torch.tpu.pallas.jax_op("vt_sharded_double", lambda x: x * 2, mesh=mesh,
                                 in_specs=(P("x"),), out_specs=P("x"))
    a = torch.randn(4, 3)
    torch.testing.assert_close(op(a.to("tpu")).cpu(), a * 2)
