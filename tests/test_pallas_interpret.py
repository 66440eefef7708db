"""lowering/pallas_interpret.py: Pallas TPU kernels that JAX's TPU interpreter cannot run as
written (reads through reshaped/bitcast refs, masked stores) run after its rewrite, with the
numbers the kernel defines. JAX's ragged paged attention kernel, the user of this, is tested in
test_vllm_paged_attention.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from torchtpu.lowering import pallas_interpret
from torchtpu.lowering.paged_attention import _interpret_mode


def _kernel(x_ref, y_ref, z_ref, o_ref, m_ref, b_ref):
    # a strided read through a reshaped ref, in a loop (a sub-jaxpr of the kernel)
    def body(i, acc):
        return acc + x_ref.reshape(32, 128)[pl.ds(i, 8, stride=4), :]

    o_ref[...] = jax.lax.fori_loop(0, 4, body, jnp.zeros((8, 128), jnp.float32))
    # a masked store into a buffer whose first dimension is longer than its second
    m_ref[...] = jnp.zeros_like(m_ref)
    rows = jax.lax.broadcasted_iota(jnp.int32, (8, 2, 128), 0)
    pltpu.store(m_ref.at[:, pl.ds(1, 2), :], y_ref[...], mask=rows < 5)
    # a strided read through a bitcast ref (bf16 row pairs packed as uint32, TPU's layout)
    b_ref[...] = z_ref.bitcast(jnp.uint32)[pl.ds(1, 4, stride=2), :]


def _run(x, y, z, rewrite):
    with _interpret_mode(pltpu.InterpretParams()):  # read when the pallas_call is made
        f = pl.pallas_call(_kernel, out_shape=(jax.ShapeDtypeStruct((8, 128), jnp.float32),
                                               jax.ShapeDtypeStruct((8, 4, 128), jnp.float32),
                                               jax.ShapeDtypeStruct((4, 128), jnp.uint32)))
        if rewrite:
            return pallas_interpret.call(f, x, y, z)
        return jax.jit(f)(x, y, z)


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((8, 4, 128)).astype(np.float32)
    y = rng.standard_normal((8, 2, 128)).astype(np.float32)
    z = jnp.asarray(rng.standard_normal((16, 128)), jnp.bfloat16)
    return x, y, z


def test_reads_through_reshaped_refs_and_masked_stores_run_with_the_kernels_numbers():
    x, y, z = _inputs()
    out, masked, packed = _run(jnp.asarray(x), jnp.asarray(y), z, rewrite=True)
    flat = x.reshape(32, 128)
    want = sum(flat[i:i + 29:4] for i in range(4))
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-6, atol=1e-6)
    want_m = np.zeros((8, 4, 128), np.float32)
    want_m[:5, 1:3] = y[:5]
    np.testing.assert_array_equal(np.asarray(masked), want_m)
    bits = np.asarray(z).view(np.uint16).astype(np.uint32)  # row 2i low half, 2i+1 high
    words = bits[0::2] | (bits[1::2] << 16)
    np.testing.assert_array_equal(np.asarray(packed), words[1::2])


def test_the_interpreter_needs_the_rewrite_for_this_kernel():
    """Without the rewrite JAX 0.10's interpreter fails on this kernel (if a later JAX runs it,
    the rewrite is no longer needed and this test says so)."""
    with pytest.raises(Exception, match="indices|Out-of-bounds"):
        jax.block_until_ready(_run(*_inputs(), rewrite=False))


def test_a_kernel_needing_nothing_is_left_untouched():
    f = pl.pallas_call(lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...] * 2),
                       out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32))
    closed = jax.make_jaxpr(f)(jnp.ones((8, 128), jnp.float32))
    assert pallas_interpret.rewrite_for_interpreter(closed.jaxpr) is closed.jaxpr
