"""The PyTorch-facing device layer: torch.tpu, torch.accelerator, Generator, streams/events,
memory statistics, pinned memory, autocast, errors, jax_op, the environment report.

Every check compares with what PyTorch does on CPU (or what CUDA documents)."""
import copy
import os
import pickle
import subprocess
import sys
import time

import jax
import pytest
import torch
import torch.nn.functional as F

tpu = torch.tpu
DEV = torch.device("tpu", 0)


# ---------------------------------------------------------------- devices

def test_module_and_availability():
    assert torch.tpu is sys.modules["torchtpu.device.tpu_module"]
    assert tpu.is_available()
    assert tpu.device_count() == len(jax.local_devices(backend=jax.default_backend()))
    assert torch.accelerator.current_accelerator() == torch.device("tpu")
    assert torch.accelerator.device_count() == tpu.device_count()


def test_current_device_and_context():
    assert tpu.current_device() == 0
    with tpu.device(0):
        assert tpu.current_device() == 0
    with tpu.device_of(torch.ones(1, device="tpu")):
        assert tpu.current_device() == 0
    tpu.set_device("tpu:0")
    assert tpu.current_device() == 0


def test_invalid_device_index():
    n = tpu.device_count()
    with pytest.raises(RuntimeError, match=f"tpu:{n}"):
        tpu.set_device(n)
    with pytest.raises(RuntimeError, match="Invalid device ordinal"):
        torch.ones(2, device=f"tpu:{n + 3}")
    with pytest.raises(ValueError):
        tpu.get_device_name("cpu")


def test_device_name_and_properties():
    jd = jax.local_devices(backend=jax.default_backend())[0]
    assert tpu.get_device_name() == jd.device_kind
    assert tpu.get_device_name(0) == tpu.get_device_name("tpu:0")
    p = tpu.get_device_properties(0)
    assert p.name == jd.device_kind
    assert p.platform == jd.platform
    assert p.total_memory > 0
    assert "total_memory" in repr(p)
    assert tpu.is_bf16_supported()
    assert torch.bfloat16 in tpu.get_amp_supported_dtype()


# ---------------------------------------------------------------- errors and printing

def test_repr_shows_device():
    x = torch.tensor([1.0, 2.0], device="tpu")
    assert repr(x) == "tensor([1., 2.], device='tpu:0')"


def test_numpy_error_like_cuda():
    x = torch.ones(2, device="tpu")
    with pytest.raises(TypeError) as e:
        x.numpy()
    assert str(e.value) == ("can't convert tpu:0 device type tensor to numpy. Use Tensor.cpu() "
                            "to copy the tensor to host memory first.")


def test_mixing_devices():
    a = torch.arange(6.0).reshape(2, 3)
    x = a.to("tpu")
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        x + torch.ones(2, 3)
    # a 0-dim CPU tensor is a scalar, as on CUDA
    s = torch.tensor(2.5)
    torch.testing.assert_close((x * s).cpu(), a * s)
    assert (x * s).device == DEV


def test_unsupported_dtype():
    with pytest.raises(TypeError, match="complex32.*tpu"):
        torch.zeros(2, dtype=torch.complex32, device="tpu")


# ---------------------------------------------------------------- views of other dtypes

@pytest.mark.parametrize("src,dst", [(torch.float32, torch.int32), (torch.float32, torch.uint8),
                                     (torch.int64, torch.float32), (torch.bfloat16, torch.int16),
                                     (torch.complex64, torch.float32), (torch.bool, torch.uint8),
                                     (torch.uint8, torch.float32)])
def test_view_dtype_reinterprets_bytes(src, dst):
    base = torch.arange(16).to(src) if src != torch.bool else torch.arange(16) % 3 == 0
    if src.is_complex:
        base = torch.complex(torch.arange(8.0), -torch.arange(8.0))
    x = base.to("tpu")
    v = x.view(dst)
    torch.testing.assert_close(v.cpu(), base.view(dst), equal_nan=True)
    torch.testing.assert_close((v[1:3] * 1).cpu(), base.view(dst)[1:3] * 1, equal_nan=True)


def test_write_through_dtype_view():
    base = torch.arange(6.0)
    x = base.to("tpu")
    u = x.view(torch.uint8)
    patch = torch.tensor([0, 0, 128, 63], dtype=torch.uint8)  # 1.0f little-endian
    u[0:4] = patch.to("tpu")
    base.view(torch.uint8)[0:4] = patch
    torch.testing.assert_close(x.cpu(), base)
    x.view(torch.int32).add_(1)
    base.view(torch.int32).add_(1)
    torch.testing.assert_close(x.cpu(), base)


def test_resize_dtype_view():
    base = torch.arange(4.0)
    v = base.to("tpu").view(torch.int32)
    v.resize_(6)
    ref = base.clone().view(torch.int32)
    ref.resize_(6)
    assert v.shape == ref.shape
    torch.testing.assert_close(v.cpu()[:4], ref[:4])  # the grown tail is uninitialised


# ---------------------------------------------------------------- RNG

def test_seed_state_api():
    tpu.manual_seed(1234)
    assert tpu.initial_seed() == 1234
    st = tpu.get_rng_state()
    assert st.dtype == torch.uint8 and st.device.type == "cpu" and st.numel() == 16
    assert st.view(torch.int64)[0].item() == 1234  # CUDA's layout: seed, then offset
    tpu.manual_seed(5)
    tpu.set_rng_state(st)
    assert tpu.initial_seed() == 1234
    torch.manual_seed(77)
    assert tpu.initial_seed() == 77
    with pytest.raises(RuntimeError, match="wrong size"):
        tpu.set_rng_state(torch.zeros(3, dtype=torch.uint8))
    g = torch.Generator(device="tpu")
    assert g.device == torch.device("tpu", 0) and isinstance(g, torch.Generator)
    assert g.manual_seed(11) is g and g.initial_seed() == 11
    gs = g.get_state()
    g.manual_seed(12)
    g.set_state(gs)
    assert g.initial_seed() == 11 and g.get_offset() == 0
    assert tpu.initial_seed() == 77  # the default generator is a different one
    for h in (copy.deepcopy(g), pickle.loads(pickle.dumps(g)), g.clone_state()):
        assert h.device == g.device and torch.equal(h.get_state(), g.get_state())
    with pytest.raises(RuntimeError, match="Invalid device ordinal"):
        torch.Generator(device=f"tpu:{tpu.device_count()}")


def test_seed_state_roundtrip():
    tpu.manual_seed(1234)
    assert tpu.initial_seed() == 1234
    st = tpu.get_rng_state()
    assert st.dtype == torch.uint8 and st.device.type == "cpu" and st.numel() == 16
    a = torch.rand(5, device="tpu").cpu()
    tpu.set_rng_state(st)
    b = torch.rand(5, device="tpu").cpu()
    torch.testing.assert_close(a, b)
    c = torch.rand(5, device="tpu").cpu()
    assert not torch.equal(a, c)
    states = tpu.get_rng_state_all()
    assert len(states) == tpu.device_count()
    tpu.set_rng_state_all(states)
    with pytest.raises(RuntimeError, match="wrong size"):
        tpu.set_rng_state(torch.zeros(3, dtype=torch.uint8))


def test_torch_manual_seed_seeds_tpu():
    torch.manual_seed(7)
    assert tpu.initial_seed() == 7
    a = torch.randn(4, device="tpu").cpu()
    torch.manual_seed(7)
    torch.testing.assert_close(torch.randn(4, device="tpu").cpu(), a)
    tpu.manual_seed_all(99)
    assert tpu.initial_seed() == 99
    tpu.seed()
    assert tpu.initial_seed() != 99


def test_fork_rng_tpu():
    tpu.manual_seed(3)
    before = tpu.get_rng_state()
    with torch.random.fork_rng(device_type="tpu"):
        torch.rand(3, device="tpu")
    assert torch.equal(tpu.get_rng_state(), before)


def test_generator_tpu():
    g = torch.Generator(device="tpu")
    assert g.device == torch.device("tpu", 0)
    assert isinstance(g, torch.Generator)
    assert g.manual_seed(11) is g
    assert g.initial_seed() == 11
    st = g.get_state()
    assert st.dtype == torch.uint8 and st.numel() == 16
    a = torch.rand(6, device="tpu", generator=g).cpu()
    g.set_state(st)
    b = torch.rand(6, device="tpu", generator=g).cpu()
    torch.testing.assert_close(a, b)
    # another generator with the same seed gives the same stream; the default one is untouched
    tpu.manual_seed(5)
    d0 = tpu.get_rng_state()
    g2 = torch.Generator("tpu").manual_seed(11)
    torch.testing.assert_close(torch.rand(6, device="tpu", generator=g2).cpu(), a)
    assert torch.equal(tpu.get_rng_state(), d0)
    # copies carry the state
    for h in (copy.deepcopy(g), pickle.loads(pickle.dumps(g)), g.clone_state()):
        assert h.device == g.device and torch.equal(h.get_state(), g.get_state())
    with pytest.raises(RuntimeError, match="Invalid device ordinal"):
        torch.Generator(device=f"tpu:{tpu.device_count()}")


def test_cpu_generator_unchanged():
    g = torch.Generator()
    assert type(g) is torch._C.Generator and g.device == torch.device("cpu")
    g.manual_seed(3)
    a = torch.rand(4, generator=g)
    ref = torch._C.Generator().manual_seed(3)
    torch.testing.assert_close(a, torch.rand(4, generator=ref))
    assert isinstance(torch.default_generator, torch.Generator)
    assert issubclass(torch._C.Generator, torch.Generator)


def test_default_generators():
    g = tpu.default_generators[0]
    tpu.manual_seed(21)
    assert g.initial_seed() == 21
    g.manual_seed(22)
    assert tpu.initial_seed() == 22


# ---------------------------------------------------------------- sync, streams, events

def _work(n=256, reps=8):
    x = torch.randn(n, n, device="tpu")
    for _ in range(reps):
        x = torch.tanh(x @ x)
    return x


def test_synchronize():
    x = _work()
    tpu.synchronize()
    torch.accelerator.synchronize()
    tpu.synchronize(0)
    tpu.synchronize("tpu:0")
    assert torch.isfinite(x).all().item()


def test_events_measure_device_time():
    tpu.synchronize()
    start = tpu.Event(enable_timing=True)
    end = tpu.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    x = _work(512, 6)
    end.record()
    end.synchronize()
    wall = (time.perf_counter() - t0) * 1000
    assert end.query() and start.query()
    ms = start.elapsed_time(end)
    assert 0 < ms <= wall + 1.0
    del x


def test_event_errors_and_stream():
    e1, e2 = tpu.Event(), tpu.Event()
    with pytest.raises(RuntimeError, match="enable_timing"):
        e1.elapsed_time(e2)
    t1, t2 = tpu.Event(enable_timing=True), tpu.Event(enable_timing=True)
    with pytest.raises(RuntimeError, match="recorded"):
        t1.elapsed_time(t2)
    s = tpu.current_stream()
    assert s == tpu.default_stream(0) and s.device == torch.device("tpu", 0)
    ev = s.record_event()
    s.wait_event(ev)
    s.wait_stream(tpu.Stream())
    # PyTorch's device-generic classes give the tpu ones; CPU keeps PyTorch's
    ge = torch.Event(device="tpu", enable_timing=True)
    assert isinstance(ge, tpu.Event) and isinstance(ge, torch.Event)
    gs = torch.Stream(device="tpu")
    # a new stream, as torch.Stream(device="cuda") (tests/test_streams.py has the semantics)
    assert isinstance(gs, tpu.Stream) and isinstance(gs, torch.Stream) and gs != s
    assert type(torch.Event(device="cpu")) is tpu.Event.__mro__[1]
    acc_s = torch.accelerator.current_stream()
    assert isinstance(acc_s, tpu.Stream) and acc_s == s
    acc_s.synchronize()
    ge.record(gs)
    ge.synchronize()
    assert ge.query()
    with tpu.stream(s):
        y = torch.ones(3, device="tpu") * 2
    s.synchronize()
    assert s.query() and ev.query()
    assert y.sum().item() == 6.0


# ---------------------------------------------------------------- memory

def test_memory_accounting():
    tpu.synchronize()
    tpu.empty_cache()
    before = tpu.memory_allocated()
    x = torch.ones(1 << 18, device="tpu")  # 1 MiB
    tpu.synchronize()
    during = tpu.memory_allocated()
    assert during - before >= x.nbytes
    assert tpu.max_memory_allocated() >= during
    assert torch.accelerator.memory_allocated() == tpu.memory_allocated()
    assert torch.accelerator.memory_allocated("tpu:0") == tpu.memory_allocated(0)
    assert tpu.memory_reserved() >= 0 and torch.accelerator.memory_reserved() >= 0
    stats = tpu.memory_stats()
    assert stats["allocated_bytes.all.current"] >= x.nbytes
    assert stats["source"] in ("pjrt", "live_arrays")
    assert torch.accelerator.memory_stats()["allocated_bytes.all.current"] >= x.nbytes
    del x
    tpu.empty_cache()
    after = tpu.memory_allocated()
    assert during - after >= (1 << 20)
    tpu.reset_peak_memory_stats()
    assert tpu.max_memory_allocated() <= during
    torch.accelerator.reset_peak_memory_stats()
    torch.accelerator.empty_cache()
    torch.accelerator.empty_host_cache()
    assert torch.accelerator.get_device_capability()["supported_dtypes"] >= {
        torch.float32, torch.bfloat16, torch.int64, torch.bool}
    free, total = tpu.mem_get_info()
    assert 0 <= free <= total


# ---------------------------------------------------------------- pinned memory, transfers

def test_pin_memory_and_non_blocking():
    a = torch.randn(4, 5)
    p = a.pin_memory()
    assert p.is_pinned() and not a.is_pinned()
    assert p.pin_memory() is p
    torch.testing.assert_close(p, a)
    x = p.to("tpu", non_blocking=True)
    back = x.to("cpu", non_blocking=True)
    tpu.synchronize()
    torch.testing.assert_close(back, a)
    assert not x.is_pinned()
    for dt in (torch.float64, torch.bfloat16, torch.int32):
        y = x.to("cpu", dtype=dt, non_blocking=True)
        torch.testing.assert_close(y, a.to(dt))
        torch.testing.assert_close(x.to(dt).cpu(), a.to(dt))
    t = a.t().to("tpu")
    assert t.cpu(memory_format=torch.preserve_format).stride() == a.t().stride()


def test_host_to_device_copies_compile_nothing_and_name_the_device():
    """``.to("tpu")`` of a CPU tensor is one transfer into a new tensor: no program per new
    shape (it allocated zeros first: an XLA compile for every batch shape a data loader made),
    strides, dtype, conj and values as CPU's ``_to_copy`` gives them. ``aten::_to_copy`` with
    ``device="tpu"`` (no index) returned a CPU tensor: the same-device shortcut took a CPU
    ``self`` for a tpu one."""
    srcs = [torch.arange(12.).reshape(3, 4), torch.arange(12.).reshape(3, 4).t(),
            torch.randn(2, 3, dtype=torch.complex64).conj(), torch.tensor([True, False]),
            torch.randn(4).bfloat16(), torch.empty(0, 3), torch.tensor(3.5),
            torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)]
    for x in srcs:
        for kw in ({}, {"memory_format": torch.contiguous_format}, {"dtype": torch.float64}):
            if x.is_complex() and "dtype" in kw:
                continue
            ref = torch.ops.aten._to_copy.default(x, **kw)
            for d in ("tpu", "tpu:0", torch.device("tpu")):
                y = torch.ops.aten._to_copy.default(x, device=d, **kw)
                assert y.device == torch.device("tpu", 0), (d, y.device)
                assert (y.dtype, y.shape, y.stride(), y.is_conj()) == \
                    (ref.dtype, ref.shape, ref.stride(), ref.is_conj()), (x.shape, kw)
                assert torch.equal(y.cpu().resolve_conj(), ref.resolve_conj())
    c0 = dict(tpu.metrics()["counters"])
    ys = [torch.arange(n, dtype=torch.float32).to("tpu") for n in (17, 19, 23, 29)]
    c1 = tpu.metrics()["counters"]
    assert c1.get("eager_xla_compiles", 0) == c0.get("eager_xla_compiles", 0)
    assert c1["transfers_host_to_device"] - c0.get("transfers_host_to_device", 0) == 4
    x = torch.arange(4.)
    y = x.to("tpu")
    x.add_(1)  # the device copy is the value at the time of the copy
    assert y.cpu().tolist() == [0, 1, 2, 3] and [t.cpu().sum().item() for t in ys] == [
        136, 171, 253, 406]


def test_dataloader_pin_memory():
    ds = torch.utils.data.TensorDataset(torch.arange(12.0).reshape(6, 2), torch.arange(6))
    dl = torch.utils.data.DataLoader(ds, batch_size=3, pin_memory=True)
    got = []
    for xb, yb in dl:
        assert xb.is_pinned() and yb.is_pinned()
        got.append((xb.to("tpu", non_blocking=True) * 2).cpu())
    torch.testing.assert_close(torch.cat(got), torch.arange(12.0).reshape(6, 2) * 2)


# ---------------------------------------------------------------- autocast

def test_autocast_lower_precision_ops():
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    w, bias = torch.randn(4, 16), torch.randn(4)
    ta, tb, tw, tbias = (t.to("tpu") for t in (a, b, w, bias))
    with torch.autocast("tpu", dtype=torch.bfloat16):
        assert torch.is_autocast_enabled("tpu")
        mm = ta @ tb
        lin = F.linear(ta, tw, tbias)
    assert mm.dtype == torch.bfloat16 and lin.dtype == torch.bfloat16
    ref_mm = a.bfloat16() @ b.bfloat16()
    torch.testing.assert_close(mm.cpu(), ref_mm)
    torch.testing.assert_close(lin.float().cpu(), F.linear(a, w, bias), atol=0.1, rtol=0.02)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert F.linear(a, w, bias).dtype == lin.dtype
    # outside autocast: float32 again
    assert (ta @ tb).dtype == torch.float32
    with torch.autocast("tpu"):  # the default low precision on tpu is bfloat16
        assert (ta @ tb).dtype == torch.bfloat16
    with torch.autocast("tpu", dtype=torch.float16):
        assert (ta @ tb).dtype == torch.float16
    with torch.autocast("tpu", enabled=False):
        assert (ta @ tb).dtype == torch.float32


def test_autocast_float32_ops():
    x = torch.randn(6, 5)
    target = torch.tensor([0, 1, 2, 3, 4, 0])
    tx = x.to("tpu")
    with torch.autocast("tpu", dtype=torch.bfloat16):
        h = tx @ torch.eye(5, device="tpu")
        assert h.dtype == torch.bfloat16
        loss = F.cross_entropy(h, target.to("tpu"))
        s = h.sum()
        sm = torch.softmax(h, dim=-1)
        e = torch.exp(h)
    assert loss.dtype == torch.float32 and s.dtype == torch.float32
    assert sm.dtype == torch.float32 and e.dtype == torch.float32
    hb = x.bfloat16()
    torch.testing.assert_close(loss.cpu(), F.cross_entropy(hb.float(), target))
    torch.testing.assert_close(s.cpu(), hb.float().sum())


def test_autocast_promote_and_backward():
    w = torch.randn(4, 3, requires_grad=True)
    tw = w.detach().to("tpu").requires_grad_()
    x = torch.randn(2, 4)
    with torch.autocast("tpu", dtype=torch.bfloat16):
        y = x.to("tpu") @ tw
        z = torch.cat([y, tw[:2].float()])
    assert z.dtype == torch.float32
    z.float().sum().backward()
    assert tw.grad.dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (torch.cat([x @ w, w[:2].float()])).float().sum().backward()
    torch.testing.assert_close(tw.grad.cpu(), w.grad)


# ---------------------------------------------------------------- precision

def test_precision():
    assert tpu.precision() in tuple(tpu.Precision)
    before = tpu.precision()
    with tpu.precision(tpu.Precision.HIGHEST):
        assert tpu.precision() is tpu.Precision.HIGHEST
        a = torch.randn(8, 8)
        torch.testing.assert_close((a.to("tpu") @ a.to("tpu")).cpu(), a @ a)
    assert tpu.precision() is before


# ---------------------------------------------------------------- jax_op

def test_jax_op_forward_backward():
    import jax.numpy as jnp

    op = tpu.pallas.jax_op("test_sin_mul", lambda x, y: jnp.sin(x) * y)
    a, b = torch.randn(3, 4), torch.randn(3, 4)
    ta = a.to("tpu").requires_grad_()
    tb = b.to("tpu").requires_grad_()
    out = op(ta, tb)
    assert out.device == DEV
    torch.testing.assert_close(out.detach().cpu(), torch.sin(a) * b)
    (out * 2).sum().backward()
    torch.testing.assert_close(ta.grad.cpu(), 2 * torch.cos(a) * b)
    torch.testing.assert_close(tb.grad.cpu(), 2 * torch.sin(a))
    torch.testing.assert_close(op(a, b), torch.sin(a) * b)  # CPU tensors run on JAX's CPU
    with pytest.raises(RuntimeError, match="already registered"):
        tpu.pallas.jax_op("test_sin_mul", lambda x: x)


def test_jax_op_multi_output_and_fake():
    import jax.numpy as jnp

    @tpu.pallas.jax_op("test_split_stats")
    def stats(x):
        return x * 2, jnp.sum(x, axis=0).astype(jnp.float64)

    x = torch.randn(5, 3)
    d, s = stats(x.to("tpu"))
    torch.testing.assert_close(d.cpu(), x * 2)
    assert s.dtype == torch.float64
    torch.testing.assert_close(s.cpu(), x.sum(0).double())
    from torch._subclasses.fake_tensor import FakeTensorMode

    tx = x.to("tpu")
    with FakeTensorMode() as m:
        fx = m.from_tensor(tx)
        fd, fs = stats(fx)
    assert fd.shape == (5, 3) and fs.shape == (3,) and fs.dtype == torch.float64


# ---------------------------------------------------------------- environment report

def test_main_report():
    env = dict(os.environ, TORCHTPU_CACHE_DIR="/tmp/torchtpu-test-cache")
    out = subprocess.run([sys.executable, "-m", "torchtpu"], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert f"torch {torch.__version__}" in text
    assert f"jax {jax.__version__}" in text and "jaxlib " in text
    assert f"PJRT platform: {jax.default_backend()}" in text
    assert "tpu:0: " in text and "MiB total" in text
    assert "eager mode: DEFER_NEVER" in text
    assert "cache folder: /tmp/torchtpu-test-cache" in text
    assert "CPU fallback: enabled" in text


# ---------------------------------------------------------------- several devices

_MULTI_SCRIPT = r'''
import copy, io, torch
assert torch.tpu.device_count() == 2, torch.tpu.device_count()
a = torch.arange(6.0).reshape(2, 3)
x = a.to("tpu:1")
assert x.device == torch.device("tpu", 1) and x.untyped_storage().device == x.device
torch.testing.assert_close(x.cpu(), a)
y = x * 2 + x
assert y.device == x.device
torch.testing.assert_close(y.cpu(), a * 3)
torch.testing.assert_close((x @ x.t()).cpu(), a @ a.t())
assert torch.ones(2, device="tpu:1").device.index == 1
assert torch.empty(0, device="tpu:1").device.index == 1
x[1].add_(10)
torch.testing.assert_close(x.cpu()[1], a[1] + 10)
z = x.to("tpu:0")
assert z.device.index == 0
assert torch.ops.aten._to_copy.default(x, device="tpu").device.index == 0  # the current one
torch.testing.assert_close(z.cpu(), x.cpu())
try:
    x + z
    raise SystemExit("mixing tpu:0 and tpu:1 did not raise")
except RuntimeError as e:
    assert "Expected all tensors to be on the same device" in str(e) and "tpu:1" in str(e), e
buf = io.BytesIO(); torch.save({"x": x}, buf); buf.seek(0)
loaded = torch.load(buf)["x"]
assert loaded.device.index == 1
torch.testing.assert_close(loaded.cpu(), x.cpu())
assert copy.deepcopy(x).device.index == 1
assert torch.Generator("tpu:1").device.index == 1
assert torch.tpu.memory_allocated(1) >= x.nbytes
with torch.tpu.device(1):
    assert torch.tpu.current_device() == 1
    # a device without an index is the current one, as for CUDA: also where C++ fills it in
    # (it took the guard's device, always 0: x.to("tpu") landed on tpu:0)
    assert torch.accelerator.current_device_index() == 1
    for t in (a.to("tpu"), a.to(torch.device("tpu")), torch.tensor([1.0], device="tpu"),
              torch.empty(2, device="tpu"), torch.ops.aten._to_copy.default(a, device="tpu")):
        assert t.device == torch.device("tpu", 1), t.device
    assert (a.to("tpu") + x).device.index == 1
assert torch.accelerator.current_device_index() == 0 and a.to("tpu").device.index == 0
torch.tpu.set_device(1)
assert a.to("tpu").device.index == 1 and torch.accelerator.current_device_index() == 1
w = a.to("tpu").requires_grad_()  # backward on tpu:1 (an internal assert in autograd's engine:
(w * w).sum().backward()          # the guard counted 1 device)
assert w.grad.device.index == 1 and torch.equal(w.grad.cpu(), 2 * a)
torch.tpu.set_device(0)
print("MULTI-OK")
'''


@pytest.mark.parametrize("fastpath", ["1", "0"])
def test_second_device(fastpath):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
               JAX_PLATFORMS="cpu", TORCHTPU_PLATFORM="cpu", TORCHTPU_FASTPATH=fastpath)
    out = subprocess.run([sys.executable, "-c", _MULTI_SCRIPT], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0 and "MULTI-OK" in out.stdout, out.stderr[-3000:]


def test_jax_op_pallas_kernel():
    from jax.experimental import pallas as pl

    def kernel(x_ref, y_ref, o_ref):
        o_ref[...] = x_ref[...] + 2 * y_ref[...]

    def padd(x, y):
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                              interpret=jax.default_backend() == "cpu")(x, y)

    op = tpu.pallas.jax_op("test_pallas_add", padd)
    a, b = torch.randn(8, 128), torch.randn(8, 128)
    ta = a.to("tpu").requires_grad_()
    out = op(ta, b.to("tpu"))
    torch.testing.assert_close(out.detach().cpu(), a + 2 * b)
    with pytest.raises(RuntimeError, match="test_pallas_add.*custom_vjp"):
        out.sum().backward()


def test_tensor_from_numpy_is_one_transfer_of_a_private_copy():
    """eager.copy.tensor_from_numpy (vLLM's per-step input transfer): the array's value on
    tpu, one host-to-device transfer, and a later change of the host array does not reach it
    (JAX's CPU client may alias host memory)."""
    import numpy as np

    from torchtpu.eager.copy import tensor_from_numpy

    host = np.arange(37, dtype=np.int32) * 3 - 5
    torch.tpu.reset_metrics()
    t = tensor_from_numpy(host)
    assert torch.tpu.metrics()["counters"].get("transfers_host_to_device") == 1
    host[:] = 0
    assert t.device.type == "tpu" and t.dtype == torch.int32 and t.shape == (37,)
    assert torch.equal(t.cpu(), torch.arange(37, dtype=torch.int32) * 3 - 5)
    assert torch.equal((t[5:9] + 1).cpu(), torch.tensor([11, 14, 17, 20], dtype=torch.int32))


_UNPACK_RAISES = r'''
import json
import torch
import torchtpu  # noqa: F401
x = torch.randn(4, 4, device="tpu", requires_grad=True)


def unpack(t):
    raise RuntimeError("unpack hook failed")


caught = None
try:
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack):
        y = (x * x).sum()
    y.backward()
except RuntimeError as e:
    caught = str(e)
z = (x * 3).sum()
z.backward()  # autograd still works after the error
print(json.dumps({"caught": caught, "grad": x.grad.cpu().tolist(), "x": x.detach().cpu().tolist()}))
'''


@pytest.mark.parametrize("fastpath", ["1", "0"])
def test_an_error_in_a_saved_tensor_hook_raises_in_backward(fastpath):
    """PyTorch throws a saved-tensor unpack hook's error with the Python error still set; the
    device guard's stream exchange in the unwinding destructors must not turn it into
    std::terminate (it aborted the process on "tpu"; CPU raises)."""
    from helpers import run_json

    env = dict(os.environ, TORCHTPU_FASTPATH=fastpath)
    out = run_json(_UNPACK_RAISES, env, timeout=300)
    assert out["caught"] is not None and "unpack hook failed" in out["caught"]
    assert out["grad"] == [[3.0] * 4] * 4


_FORK_SCRIPT = r'''
import json, multiprocessing as mp, os, sys
import torch
from torch.utils.data import DataLoader, Dataset

def child_sum(q):
    q.put((torch.arange(4, device="tpu") * 2).sum().item())

out = {}
# forked before the backend exists: a clean process that makes its own
ctx = mp.get_context("fork")
assert not torch.tpu._is_in_bad_fork()
q = ctx.Queue(); p = ctx.Process(target=child_sum, args=(q,)); p.start()
out["clean_fork"] = q.get(timeout=120); p.join(30)

x = torch.ones(3, device="tpu") + 1  # the backend exists from here on
class Host(Dataset):  # a worker that seeds torch (tpu's generators left alone) and uses the CPU
    def __len__(self): return 4
    def __getitem__(self, i): return torch.ones(2) * i + torch.rand(1) * 0
class Device(Dataset):
    def __init__(self, what): self.what = what
    def __len__(self): return 2
    def __getitem__(self, i):
        assert torch.tpu._is_in_bad_fork() and not torch.tpu.is_initialized()
        if self.what == "factory": return torch.ones(2, device="tpu")
        if self.what == "op": return (x + x).cpu()
        if self.what == "read": return x.cpu()
        if self.what == "sync": torch.tpu.synchronize()
        return torch.compile(lambda a: a * 2, backend="tpu")(x)
out["host_workers"] = [b.tolist() for b in DataLoader(Host(), batch_size=2, num_workers=2)]
for what in ("factory", "op", "read", "sync", "compiled"):
    try:
        list(DataLoader(Device(what), batch_size=1, num_workers=1))
        out[what] = "ran"
    except RuntimeError as e:
        out[what] = [l for l in str(e).splitlines() if "forked" in l][-1:]
out["parent"] = (x + x).tolist()
print(json.dumps(out))
'''


@pytest.mark.parametrize("fastpath", ["1", "0"])
def test_forked_child_raises_like_cuda(fastpath, tmp_path):
    """A process forked after the backend exists (a DataLoader worker) has the PJRT client
    without its threads, where a program or transfer used to wait forever: as CUDA, any use of
    the device there raises RuntimeError naming the 'spawn' start method, while the worker may
    still seed torch and compute on the CPU; a fork before the backend exists is a clean
    process (an empty compile cache: with a warm one, ``import torch`` starts loading its
    programs ahead, which makes the backend); the parent is unaffected."""
    from helpers import run_json

    env = dict(os.environ, TORCHTPU_FASTPATH=fastpath, TORCHTPU_CACHE_DIR=str(tmp_path))
    out = run_json(_FORK_SCRIPT, env, timeout=400)
    assert out["clean_fork"] == 12
    assert out["host_workers"] == [[[0.0, 0.0], [1.0, 1.0]], [[2.0, 2.0], [3.0, 3.0]]]
    msg = ("RuntimeError: Cannot re-initialize TPU in forked subprocess. To use TPU with "
           "multiprocessing, you must use the 'spawn' start method")
    for what in ("factory", "op", "read", "sync", "compiled"):
        assert out[what] == [msg], (what, out[what])
    assert out["parent"] == [4.0, 4.0, 4.0]


def test_a_dlpack_round_trip_of_a_tpu_tensor_raises_a_clear_error():
    """``to_dlpack`` of a tpu tensor hands out its storage's fake address: ``from_dlpack`` of
    that capsule makes a tpu tensor with no device buffer, which must say so (not crash or read
    a wrong value) on first use; ``__dlpack_device__`` refuses tpu as PyTorch does."""
    x = torch.arange(6.0).reshape(2, 3).to("tpu")
    y = torch.from_dlpack(torch.utils.dlpack.to_dlpack(x))
    with pytest.raises(RuntimeError, match="no device buffer.*DLPack"):
        y.cpu()
    with pytest.raises(ValueError, match="tpu"):
        x.__dlpack_device__()
    assert torch.equal(x.cpu(), torch.arange(6.0).reshape(2, 3))


def test_sync_debug_mode_warns_or_raises_on_host_syncs_like_cuda():
    """torch.tpu.set_sync_debug_mode: implicit host syncs warn ("warn") or raise ("error"),
    counted the same as metrics' host_syncs; explicit synchronize and async ops never do."""
    import warnings

    x = torch.randn(4, device="tpu")
    try:
        torch.tpu.set_sync_debug_mode("warn")
        assert torch.tpu.get_sync_debug_mode() == 1
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            (x * 2).exp()
            torch.tpu.synchronize()
            assert not [w for w in got if "synchronizing" in str(w.message)]
            x.sum().item()
            torch.nonzero(x > 0)
        msgs = [str(w.message) for w in got if "synchronizing TPU operation" in str(w.message)]
        assert len(msgs) == 2 and "nonzero" in msgs[1], msgs
        torch.tpu.set_sync_debug_mode(2)
        with pytest.raises(RuntimeError, match="called a synchronizing TPU operation"):
            x.cpu()
        with pytest.raises(RuntimeError, match="expected one of `default`, `warn`, `error`"):
            torch.tpu.set_sync_debug_mode("loud")
    finally:
        torch.tpu.set_sync_debug_mode("default")
    assert torch.tpu.get_sync_debug_mode() == 0
    assert x.cpu().shape == (4,)
    assert torch.tpu.OutOfMemoryError is torch.OutOfMemoryError
    torch.tpu.init()
    torch.tpu.ipc_collect()
    torch.tpu.reset_max_memory_allocated()
