"""Explicit memory formats on "tpu": a channels_last(_3d) request gives that layout, as on CPU
and CUDA. Eager results are otherwise contiguous (docs/ARCHITECTURE.md); these are the calls
where the caller asks for a layout and may view its permutation."""
import pytest
import torch

CL, CL3 = torch.channels_last, torch.channels_last_3d


def _x(*shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0))


CASES = {
    "empty": lambda d: torch.empty(2, 3, 4, 5, device=d, memory_format=CL),
    "empty_like": lambda d: torch.empty_like(_x(2, 3, 4, 5).to(d), memory_format=CL),
    "zeros_like": lambda d: torch.zeros_like(_x(2, 3, 4, 5).to(d), memory_format=CL),
    "full_like": lambda d: torch.full_like(_x(2, 3, 4, 5).to(d), 2.5, memory_format=CL),
    "clone": lambda d: _x(2, 3, 4, 5).to(d).clone(memory_format=CL),
    "contiguous": lambda d: _x(2, 3, 4, 5).to(d).contiguous(memory_format=CL),
    "contiguous_3d": lambda d: _x(2, 3, 2, 4, 5).to(d).contiguous(memory_format=CL3),
    "to_from_cpu": lambda d: _x(2, 3, 4, 5).to(d, memory_format=CL),
    "to_from_cpu_with_dtype": lambda d: _x(2, 3, 4, 5).to(d, torch.float64, memory_format=CL),
    "to_same_device": lambda d: _x(2, 3, 4, 5).to(d).to(memory_format=CL),
    "back_to_contiguous": lambda d: _x(2, 3, 4, 5).to(d).contiguous(memory_format=CL).contiguous(),
    "module_weight": lambda d: torch.nn.Conv2d(3, 4, 3).to(d).to(memory_format=CL).weight,
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_explicit_memory_format_gives_cpus_layout(name):
    for _ in range(3):  # the second and third calls are the C++ fast path's where it serves them
        c, t = CASES[name]("cpu"), CASES[name]("tpu")
        assert t.device.type == "tpu"
        assert t.stride() == c.stride()
        if not name.startswith("empty") and name != "module_weight":
            assert torch.equal(t.cpu(), c)


def test_a_channels_last_result_views_its_permutation_and_differentiates():
    x = _x(2, 3, 4, 5)
    g = x.clone().to("tpu").requires_grad_()
    y = g.contiguous(memory_format=CL)
    assert y.is_contiguous(memory_format=CL)
    flat = y.permute(0, 2, 3, 1).view(2, -1)  # a RuntimeError when y was row-major
    assert torch.equal(flat.cpu(), x.permute(0, 2, 3, 1).reshape(2, -1))
    w = torch.arange(120.0).view(2, 3, 4, 5)
    (y * w.to("tpu")).sum().backward()
    assert torch.equal(g.grad.cpu(), w)


def test_channels_last_needs_rank_4_as_on_cpu():
    with pytest.raises(RuntimeError, match="rank 4"):
        torch.empty(2, 3, device="tpu", memory_format=CL)


def test_channels_last_conv_equals_cpu():
    torch.manual_seed(0)
    m = torch.nn.Conv2d(3, 4, 3)
    x = _x(2, 3, 8, 8)
    t = torch.nn.Conv2d(3, 4, 3)
    t.load_state_dict(m.state_dict())
    t = t.to("tpu").to(memory_format=CL)
    out = t(x.to("tpu", memory_format=CL))
    torch.testing.assert_close(out.cpu(), m(x), atol=1e-5, rtol=1e-5)


def test_fused_mode_keeps_the_requested_layout():
    x = _x(2, 3, 4, 5)
    with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE):
        for _ in range(3):
            t = (x.to("tpu") * 2).clone(memory_format=CL)
            assert t.stride() == (60, 1, 15, 3)
            assert torch.equal(t.cpu(), x * 2)
