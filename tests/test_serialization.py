"""torch.save / torch.load, deepcopy, pickle and storage copies of tpu tensors, against CPU."""
import copy
import io
import pickle

import pytest
import torch
import torch.nn as nn

TPU = torch.device("tpu", 0)


def _roundtrip(obj, **load_kwargs):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, **load_kwargs)


DTYPE_CASES = [
    torch.arange(12.0).reshape(3, 4),
    torch.arange(-5, 5, dtype=torch.int64),
    torch.tensor([True, False, True]),
    torch.randn(5).to(torch.bfloat16),
    torch.randn(4, dtype=torch.float64),
    torch.complex(torch.randn(3), torch.randn(3)),
    torch.arange(7, dtype=torch.uint8),
    torch.randn(2, 3).half(),
]


@pytest.mark.parametrize("ref", DTYPE_CASES, ids=lambda t: str(t.dtype))
def test_tensor_roundtrip_default_location(ref):
    got = _roundtrip(ref.to("tpu"))  # weights_only=True is the default
    assert got.device == TPU and got.dtype == ref.dtype and got.shape == ref.shape
    torch.testing.assert_close(got.cpu(), ref)
    # a loaded tensor is an ordinary tpu tensor: ops and in-place ops work on it
    if ref.dtype.is_floating_point:
        torch.testing.assert_close((got * 2).cpu(), ref * 2)
        got.add_(1)
        torch.testing.assert_close(got.cpu(), ref + 1)


@pytest.mark.parametrize("loc", ["cpu", torch.device("cpu"), {"tpu:0": "cpu"},
                                 lambda s, l: s])
def test_map_location_cpu(loc):
    ref = torch.randn(3, 5)
    got = _roundtrip({"w": ref.to("tpu"), "n": 3}, map_location=loc)
    assert got["n"] == 3 and got["w"].device.type == "cpu"
    torch.testing.assert_close(got["w"], ref)


@pytest.mark.parametrize("loc", ["tpu", "tpu:0", TPU])
def test_cpu_checkpoint_to_tpu(loc):
    ref = torch.randn(4, 2)
    got = _roundtrip({"w": ref, "i": torch.arange(3)}, map_location=loc)
    assert got["w"].device == TPU and got["i"].device == TPU
    torch.testing.assert_close(got["w"].cpu(), ref)
    torch.testing.assert_close(got["i"].cpu(), torch.arange(3))


def test_shared_storage_and_views_survive():
    base = torch.arange(10.0)
    x = base.to("tpu")
    got = _roundtrip({"x": x, "tail": x[4:], "strided": x[::3]})
    torch.testing.assert_close(got["tail"].cpu(), base[4:])
    torch.testing.assert_close(got["strided"].cpu(), base[::3])
    assert got["tail"].untyped_storage().data_ptr() == got["x"].untyped_storage().data_ptr()
    assert got["tail"].storage_offset() == 4
    got["x"][5] = -1.0  # still views of one storage after loading
    assert got["tail"][1].item() == -1.0
    assert got["strided"].cpu().tolist() == [0.0, 3.0, 6.0, 9.0]


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3), nn.BatchNorm1d(3))


def test_state_dict_roundtrip_tpu_and_cpu():
    cpu_model = _model()
    tpu_model = copy.deepcopy(cpu_model).to("tpu")
    buf = io.BytesIO()
    torch.save(tpu_model.state_dict(), buf)
    x = torch.randn(5, 4)
    ref = cpu_model.eval()(x)
    # back onto tpu
    buf.seek(0)
    sd = torch.load(buf)
    assert all(v.device == TPU for v in sd.values())
    m2 = _model()
    with torch.no_grad():
        for p in m2.parameters():
            p.zero_()
    m2 = m2.to("tpu")
    m2.load_state_dict(sd)
    torch.testing.assert_close(m2.eval()(x.to("tpu")).cpu(), ref)
    # onto a CPU model
    buf.seek(0)
    sd_cpu = torch.load(buf, map_location="cpu", weights_only=True)
    m3 = _model()
    m3.load_state_dict(sd_cpu)
    torch.testing.assert_close(m3.eval()(x), ref)
    assert sd_cpu["3.num_batches_tracked"].dtype == torch.int64


def test_file_roundtrip(tmp_path):
    ref = torch.randn(6, 6)
    path = tmp_path / "ckpt.pt"
    torch.save({"a": ref.to("tpu")}, path)
    torch.testing.assert_close(torch.load(path)["a"].cpu(), ref)
    torch.testing.assert_close(torch.load(path, map_location="cpu", mmap=True)["a"], ref)


def test_deepcopy_tensor_is_independent():
    ref = torch.arange(6.0).reshape(2, 3)
    x = ref.to("tpu")
    y = copy.deepcopy(x)
    assert y.device == TPU and y.dtype == x.dtype and y.shape == x.shape
    torch.testing.assert_close(y.cpu(), ref)
    y.mul_(10)
    torch.testing.assert_close(x.cpu(), ref)
    torch.testing.assert_close(y.cpu(), ref * 10)
    v = x[1]
    vc = copy.deepcopy(v)
    torch.testing.assert_close(vc.cpu(), ref[1])
    # a leaf tensor's .grad is deep-copied too (plain tensors, unlike Parameters)
    w = torch.ones(3, device="tpu", requires_grad=True)
    (w * 2).sum().backward()
    wc = copy.deepcopy(w)
    assert wc.requires_grad and wc.grad.device == TPU
    torch.testing.assert_close(wc.grad.cpu(), torch.full((3,), 2.0))


def test_deepcopy_model_and_grad():
    m = _model().to("tpu")
    out = m(torch.randn(3, 4, device="tpu"))
    out.sum().backward()
    m2 = copy.deepcopy(m)
    for (n1, p1), (n2, p2) in zip(m.named_parameters(), m2.named_parameters()):
        assert n1 == n2 and p2.device == TPU and p2.requires_grad
        torch.testing.assert_close(p2.detach().cpu(), p1.detach().cpu())
        assert p2.grad is None  # nn.Parameter.__deepcopy__ drops .grad, as on CPU
    with torch.no_grad():
        m2[0].weight.fill_(0)
    assert m[0].weight.abs().sum().item() > 0


def test_pickle_tensor():
    ref = torch.randn(3, 3)
    got = pickle.loads(pickle.dumps(ref.to("tpu")))
    assert got.device == TPU
    torch.testing.assert_close(got.cpu(), ref)


def test_legacy_format():
    ref = {"a": torch.randn(2, 5), "b": torch.arange(4)}
    buf = io.BytesIO()
    torch.save({k: v.to("tpu") for k, v in ref.items()}, buf, _use_new_zipfile_serialization=False)
    for loc, dev in ((None, TPU), ("cpu", torch.device("cpu"))):
        buf.seek(0)
        got = torch.load(buf, map_location=loc)
        for k in ref:
            assert got[k].device == dev
            torch.testing.assert_close(got[k].cpu(), ref[k])


def test_storage_copies():
    ref = torch.arange(5.0)
    x = ref.to("tpu")
    st = x.untyped_storage()
    assert st.device == TPU and st.nbytes() == 20
    cpu_st = st.cpu()
    assert cpu_st.device.type == "cpu"
    assert bytes(cpu_st) == bytes(ref.untyped_storage())
    cl = st.clone()
    assert cl.device == TPU and cl.data_ptr() != st.data_ptr()
    y = torch.empty(0, device="tpu").set_(cl, 0, (5,), (1,))
    torch.testing.assert_close(y.cpu(), ref)
    back = ref.untyped_storage().tpu()
    assert back.device == TPU
    z = torch.empty(0, device="tpu").set_(back, 0, (5,), (1,))
    torch.testing.assert_close(z.cpu(), ref)
    fresh = torch.UntypedStorage(8, device="tpu")
    assert fresh.device == TPU and bytes(fresh.cpu()) == bytes(8)
    listed = torch.UntypedStorage([1, 2, 255], device="tpu")
    assert list(listed.cpu()) == [1, 2, 255]
    ts = torch.TypedStorage(4, dtype=torch.float32, device="tpu")
    assert ts.device == TPU and ts.size() == 4
    assert torch.UntypedStorage(3).device.type == "cpu"  # CPU unchanged
