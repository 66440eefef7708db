"""runtime/first_run.py: which loaded executables are run ahead on zeros, and that a run ahead
changes no result."""
import jax
import jax.numpy as jnp
import numpy as np

from torchtpu.runtime import first_run


def _compiled(fn, *args):
    return jax.jit(fn).lower(*args).compile()


def test_a_plain_program_is_run_ahead_and_then_computes_the_same():
    x = jnp.arange(12.0).reshape(3, 4)
    c = _compiled(lambda a: jnp.tanh(a) @ a.T, x)
    assert first_run.run_ahead(c, jax.devices()[0], ())
    np.testing.assert_array_equal(np.asarray(c(x)), np.asarray(jnp.tanh(x) @ x.T))


def test_loops_custom_calls_and_big_programs_are_not_run_ahead(monkeypatch):
    x = jnp.ones(3)
    # on zeros this loop would never end
    loop = _compiled(lambda v: jax.lax.while_loop(lambda u: u.sum() < 10, lambda u: u * 2, v), x)
    assert not first_run.run_ahead(loop, jax.devices()[0], ())
    assert float(loop(x).sum()) >= 10
    plain = _compiled(lambda v: v + 1, x)
    assert not first_run.run_ahead(plain, jax.devices()[0], ("some_target",))
    monkeypatch.setattr(first_run, "MAX_BYTES", 8)
    assert not first_run.run_ahead(plain, jax.devices()[0], ())


def test_the_run_ahead_fills_the_entry_the_first_real_call_takes():
    # the executor's arguments: committed storage arrays and uncommitted weakly typed device
    # scalars (executor._device_scalar); an argument jit drops is still passed. The run ahead
    # goes through the C++ call, so the first real call finds its entry made (no Python
    # aot_cache_miss on the caller's path), and computes the same
    dev = jax.devices()[0]
    x = jax.device_put(np.arange(12.0, dtype=np.float32).reshape(3, 4), dev)
    k = jax.device_put(2.5)
    c = _compiled(lambda a, s, unused: jnp.tanh(a) @ a.T * s, x, k, x)
    assert first_run.run_ahead(c, dev, ())
    assert c._call._cache_size() == 1
    got = np.asarray(c(x, k, x))
    assert c._call._cache_size() == 1  # taken, not made
    np.testing.assert_array_equal(got, np.asarray(jnp.tanh(x) @ x.T * k))
