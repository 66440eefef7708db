"""nn lowerings (convolution, pooling, norms, upsampling, losses, attention) against PyTorch CPU.

Every case runs the same function on CPU and on "tpu" and compares the outputs and the float32
gradients (torch.autograd.grad) of every floating input that requires grad.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

DEV = "tpu"
ATOL = RTOL = 1e-5


def _compare(fn, *inputs, no_grad=(), atol=ATOL, rtol=RTOL, dev_fn=None, grad_nan=False):
    """``fn`` on CPU against ``dev_fn`` (default ``fn``) on tpu: outputs, and gradients of the
    first output (``grad_nan``: NaN gradients must match as NaN)."""
    req = [i.is_floating_point() and k not in no_grad for k, i in enumerate(inputs)]
    cpu = [i.clone().requires_grad_(r) for i, r in zip(inputs, req)]
    dev = [i.to(DEV).requires_grad_(r) for i, r in zip(inputs, req)]
    oc, od = fn(*cpu), (dev_fn or fn)(*dev)
    oc = oc if isinstance(oc, tuple) else (oc,)
    od = od if isinstance(od, tuple) else (od,)
    for a, b in zip(oc, od):
        assert b.device.type == DEV
        torch.testing.assert_close(b.detach().cpu(), a.detach(), atol=atol, rtol=rtol, equal_nan=True)
    wrt_c = [c for c in cpu if c.requires_grad]
    wrt_d = [d for d in dev if d.requires_grad]
    if wrt_c and oc[0].requires_grad:
        go = torch.randn_like(oc[0])
        gc = torch.autograd.grad(oc[0], wrt_c, go)
        gd = torch.autograd.grad(od[0], wrt_d, go.to(DEV))
        for a, b in zip(gc, gd):
            torch.testing.assert_close(b.cpu(), a, atol=atol, rtol=rtol, equal_nan=grad_nan)


def _fallbacks():
    return dict(torch.tpu.metrics()["per_op"].get("cpu_fallbacks", {}))


def _r(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g)


# ------------------------------------------------------------------ convolution

CONV = {
    "2d_stride_groups_bias": (lambda x, w, b: F.conv2d(x, w, b, stride=2, padding=1, groups=2),
                              (_r(2, 4, 9, 9), _r(6, 2, 3, 3, seed=1), _r(6, seed=2))),
    "2d_dilation": (lambda x, w: F.conv2d(x, w, padding=2, dilation=2), (_r(2, 4, 8, 7), _r(3, 4, 3, 3, seed=1))),
    "1d": (lambda x, w: F.conv1d(x, w, stride=2), (_r(2, 3, 10), _r(4, 3, 3, seed=1))),
    "3d": (lambda x, w: F.conv3d(x, w, padding=1), (_r(1, 2, 5, 5, 4), _r(3, 2, 3, 3, 3, seed=1))),
    "unbatched": (lambda x, w: F.conv2d(x, w, padding="same"), (_r(4, 6, 6), _r(2, 4, 3, 3, seed=1))),
    "transposed_2d": (lambda x, w, b: F.conv_transpose2d(x, w, b, stride=2, padding=1, output_padding=1, groups=2),
                      (_r(2, 4, 5, 5), _r(4, 3, 3, 3, seed=1), _r(6, seed=2))),
    "transposed_1d_dilation": (lambda x, w: F.conv_transpose1d(x, w, stride=3, padding=2, dilation=2),
                               (_r(2, 3, 7), _r(3, 2, 4, seed=1))),
    "transposed_3d": (lambda x, w: F.conv_transpose3d(x, w, stride=2), (_r(1, 2, 3, 3, 2), _r(2, 3, 2, 2, 2, seed=1))),
}


@pytest.mark.parametrize("case", sorted(CONV))
def test_convolution(case):
    fn, inputs = CONV[case]
    before = _fallbacks()
    _compare(fn, *inputs)
    after = _fallbacks()
    assert not any("conv" in k and after[k] != before.get(k) for k in after)


# ------------------------------------------------------------------ pooling

X4 = _r(2, 3, 9, 8)
X5 = _r(1, 2, 5, 6, 7)
@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_conv_transpose_of_int64_matches_cpu(mode):
    # CPU computes int64 transposed convolutions; the lowering's jax.linear_transpose has no
    # integer cotangents and the kernel crashed on a float0 result
    g = torch.Generator().manual_seed(90)
    cases = [  # (conv, x shape, w shape, keywords)
        (F.conv_transpose1d, (2, 4, 5), (4, 3, 3), dict(stride=3, padding=1, output_padding=2, dilation=2)),
        (F.conv_transpose2d, (2, 4, 4, 3), (4, 2, 2, 3), dict(stride=(2, 1), padding=(1, 2), groups=2,
                                                              dilation=(1, 2), output_padding=(1, 0))),
        (F.conv_transpose3d, (1, 2, 3, 2, 3), (2, 2, 2, 1, 2), dict(stride=2, output_padding=(1, 0, 1))),
        (F.conv_transpose2d, (3, 4, 5), (3, 2, 2, 2), dict(stride=2)),  # unbatched
    ]
    ctx = (torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE) if mode == "fused"
           else torch.no_grad())
    with ctx:
        for conv, xs, ws, kw in cases:
            x = torch.randint(-9, 9, xs, generator=g)
            w = torch.randint(-9, 9, ws, generator=g)
            b = torch.randint(-9, 9, (ws[1] * kw.get("groups", 1),), generator=g)
            want = conv(x, w, b, **kw)
            got = conv(x.to(DEV), w.to(DEV), b.to(DEV), **kw)
            assert got.dtype == torch.int64
            assert torch.equal(got.cpu(), want), (conv, kw)


POOL = {
    "max2d_ceil_pad": (lambda x: F.max_pool2d(x, 3, 2, 1, ceil_mode=True, return_indices=True), X4),
    "max2d_dilation": (lambda x: F.max_pool2d(x, 2, 1, 0, dilation=2, return_indices=True), X4),
    "max2d_unbatched": (lambda x: F.max_pool2d(x, (2, 3), return_indices=True), X4[0]),
    "max3d": (lambda x: F.max_pool3d(x, 2, padding=1, return_indices=True), X5),
    "avg2d_ceil_pad": (lambda x: F.avg_pool2d(x, 3, 2, 1, ceil_mode=True), X4),
    "avg2d_exclude_pad": (lambda x: F.avg_pool2d(x, 3, 2, 1, ceil_mode=True, count_include_pad=False), X4),
    "avg2d_divisor": (lambda x: F.avg_pool2d(x, 2, divisor_override=3), X4),
    "avg3d": (lambda x: F.avg_pool3d(x, 3, 2, 1, ceil_mode=True, count_include_pad=False), X5),
    "adaptive_avg2d": (lambda x: F.adaptive_avg_pool2d(x, (4, 3)), X4),
    "adaptive_avg3d": (lambda x: F.adaptive_avg_pool3d(x, (2, 3, 4)), X5),
    "adaptive_max2d": (lambda x: F.adaptive_max_pool2d(x, (4, 3), return_indices=True), X4),
}


@pytest.mark.parametrize("case", sorted(POOL))
def test_pooling(case):
    fn, x = POOL[case]
    _compare(fn, x)


def test_max_pool_nan_and_ties():
    x = torch.zeros(1, 1, 4, 4)
    x[0, 0, 1, 1] = float("nan")
    _compare(lambda x: F.max_pool2d(x, 2, return_indices=True), x)


# ------------------------------------------------------------------ normalization

NORM = {
    "batch_norm_train": (lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True), (X4, _r(3, seed=1), _r(3, seed=2))),
    "batch_norm_eval": (lambda x, w, b: F.batch_norm(x, torch.full((3,), 0.3, device=x.device),
                                                     torch.full((3,), 2.0, device=x.device), w, b, training=False),
                        (X4, _r(3, seed=1), _r(3, seed=2))),
    "layer_norm": (lambda x, w, b: F.layer_norm(x, (9, 8), w, b), (X4, _r(9, 8, seed=1), _r(9, 8, seed=2))),
    "layer_norm_no_affine": (lambda x: F.layer_norm(x, (8,)), (X4,)),
    "group_norm": (lambda x, w, b: F.group_norm(x, 3, w, b), (_r(2, 6, 5, 4), _r(6, seed=1), _r(6, seed=2))),
    "rms_norm": (lambda x, w: F.rms_norm(x, (8,), w), (X4, _r(8, seed=1))),
}


@pytest.mark.parametrize("case", sorted(NORM))
def test_norm(case):
    fn, inputs = NORM[case]
    _compare(fn, *inputs)


@pytest.mark.parametrize("momentum", [0.1, None])
def test_batch_norm_module_running_stats(momentum):
    torch.manual_seed(0)
    cpu = nn.BatchNorm2d(3, momentum=momentum)
    dev = nn.BatchNorm2d(3, momentum=momentum).to(DEV)
    for step in range(2):
        x = _r(4, 3, 5, 5, seed=step) * (step + 1) + step
        torch.testing.assert_close(dev(x.to(DEV)).cpu(), cpu(x))
    torch.testing.assert_close(dev.running_mean.cpu(), cpu.running_mean)
    torch.testing.assert_close(dev.running_var.cpu(), cpu.running_var)
    assert int(dev.num_batches_tracked.cpu()) == 2
    cpu.eval(), dev.eval()
    x = _r(2, 3, 5, 5, seed=9)
    torch.testing.assert_close(dev(x.to(DEV)).cpu(), cpu(x))
    decomps = torch.tpu.metrics()["per_op"].get("decompositions", {})
    assert "aten::native_batch_norm.default" not in decomps  # the lowering ran, not a decomposition


# ------------------------------------------------------------------ upsampling

UP = {}
for _mode in ("nearest", "nearest-exact"):
    UP[f"{_mode}_2d_size"] = (lambda x, m=_mode: F.interpolate(x, size=(13, 7), mode=m), X4)
    UP[f"{_mode}_2d_scale"] = (lambda x, m=_mode: F.interpolate(x, scale_factor=1.7, mode=m), X4)
    UP[f"{_mode}_1d"] = (lambda x, m=_mode: F.interpolate(x, scale_factor=2.3, mode=m), _r(2, 3, 5))
    UP[f"{_mode}_3d"] = (lambda x, m=_mode: F.interpolate(x, size=(4, 7, 3), mode=m), X5)
for _ac in (False, True):
    UP[f"bilinear_ac{_ac}"] = (lambda x, a=_ac: F.interpolate(x, size=(13, 5), mode="bilinear", align_corners=a), X4)
    UP[f"bilinear_scale_ac{_ac}"] = (lambda x, a=_ac: F.interpolate(x, scale_factor=1.5, mode="bilinear", align_corners=a), X4)
    UP[f"bicubic_ac{_ac}"] = (lambda x, a=_ac: F.interpolate(x, size=(13, 5), mode="bicubic", align_corners=a), X4)
    UP[f"linear_ac{_ac}"] = (lambda x, a=_ac: F.interpolate(x, size=11, mode="linear", align_corners=a), _r(2, 3, 5))
    UP[f"trilinear_ac{_ac}"] = (lambda x, a=_ac: F.interpolate(x, size=(4, 7, 3), mode="trilinear", align_corners=a), X5)


@pytest.mark.parametrize("case", sorted(UP))
def test_upsample(case):
    fn, x = UP[case]
    _compare(fn, x, atol=1e-4 if "bicubic" in case else ATOL)


def _uint8_image(h, w, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (2, 3, h, w), generator=g, dtype=torch.uint8)


UINT8_UP = [  # (input h, w, interpolate's keywords): up, down, mixed, a side left alone
    (6, 5, dict(size=(3, 7))), (4, 9, dict(size=(11, 13))), (2, 3, dict(size=(7, 1))),
    (7, 6, dict(scale_factor=(1.7, 0.6))), (9, 5, dict(scale_factor=(0.9, 1.06))),
    (5, 8, dict(size=(5, 17))), (1, 4, dict(size=(3, 6)))]


@pytest.mark.parametrize("mode", ["strict", "fused"])
@pytest.mark.parametrize("kind", ["bilinear", "bicubic"])
@pytest.mark.parametrize("align_corners", [False, True])
def test_upsample_uint8_bit_exact(kind, align_corners, mode):
    # CPU resizes uint8 images (torchvision's resize) with fixed-point weights and clamps after
    # each pass; the float matrices cast to uint8 gave all zeros (align_corners=False) or zeros
    # between the corners
    ctx = (torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE) if mode == "fused"
           else torch.no_grad())
    with ctx:
        for k, (h, w, kw) in enumerate(UINT8_UP):
            if align_corners and "scale_factor" in kw:
                continue
            x = _uint8_image(h, w, seed=80 + k)
            for layout in (torch.contiguous_format, torch.channels_last):
                xl = x.contiguous(memory_format=layout)
                want = F.interpolate(xl, mode=kind, align_corners=align_corners, **kw)
                got = F.interpolate(xl.to(DEV), mode=kind, align_corners=align_corners, **kw)
                assert got.dtype == torch.uint8
                assert torch.equal(got.cpu(), want), (h, w, kw, layout)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool])
@pytest.mark.parametrize("kind", ["bilinear", "bicubic", "area"])
def test_upsample_of_other_integer_dtypes_raises_like_cpu(kind, dtype):
    x = torch.ones(1, 2, 3, 4, dtype=dtype)
    with pytest.raises(NotImplementedError):
        F.interpolate(x, size=(5, 6), mode=kind)
    with pytest.raises(NotImplementedError):
        F.interpolate(x.to(DEV), size=(5, 6), mode=kind).cpu()


def test_uint8_area_and_1d_3d_linear_raise_like_cpu():
    # CPU has no uint8 kernel for these; the float-weight lowerings returned zeros
    cases = [(lambda x: F.interpolate(x, size=(2, 3), mode="area"), (1, 2, 4, 6)),
             (lambda x: F.adaptive_avg_pool3d(x, 2), (1, 2, 4, 4, 4)),
             (lambda x: F.interpolate(x, size=7, mode="linear"), (1, 2, 4)),
             (lambda x: F.interpolate(x, size=(3, 3, 3), mode="trilinear"), (1, 1, 2, 3, 4))]
    for fn, shape in cases:
        x = torch.full(shape, 200, dtype=torch.uint8)
        with pytest.raises(NotImplementedError):
            fn(x)
        with pytest.raises(NotImplementedError):
            fn(x.to(DEV)).cpu()


GRID = (_r(2, 3, 5, 6, seed=70), torch.rand(2, 4, 7, 2, generator=torch.Generator().manual_seed(71)) * 2.6 - 1.3)


@pytest.mark.parametrize("mode,padding_mode,align_corners", [
    ("bilinear", "zeros", False), ("bilinear", "reflection", True), ("nearest", "border", False),
    ("bicubic", "zeros", True), ("bicubic", "reflection", False)])
def test_grid_sample(mode, padding_mode, align_corners):
    _compare(lambda x, g: F.grid_sample(x, g, mode=mode, padding_mode=padding_mode,
                                        align_corners=align_corners), *GRID, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("mode,padding_mode", [("bilinear", "reflection"), ("nearest", "zeros")])
def test_grid_sample_3d(mode, padding_mode):
    x = _r(2, 3, 4, 5, 6, seed=72)
    g = torch.rand(2, 3, 4, 5, 3, generator=torch.Generator().manual_seed(73)) * 2.6 - 1.3
    _compare(lambda x, g: F.grid_sample(x, g, mode=mode, padding_mode=padding_mode, align_corners=False),
             x, g, atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------ losses

LOGITS = _r(5, 4)
TGT = torch.tensor([0, 3, -100, 1, 2])
X4C = _r(2, 3, 4, 5, seed=3)
T4C = torch.randint(0, 3, (2, 4, 5), generator=torch.Generator().manual_seed(0))
T4C[0, 0, 0] = -100
Y = _r(5, 4, seed=4)
P = torch.rand(5, 4, generator=torch.Generator().manual_seed(5)).clamp(0.01, 0.99)
Q = torch.rand(5, 4, generator=torch.Generator().manual_seed(6))
W4 = torch.rand(4, generator=torch.Generator().manual_seed(7))
W3 = torch.rand(3, generator=torch.Generator().manual_seed(8))


def _loss_cases():
    cases = {}
    for red in ("none", "mean", "sum"):
        if red == "sum":  # the sum reduction only where it differs from mean beyond a scale
            cases[f"nll_weight_{red}"] = (lambda x, w: F.nll_loss(x, TGT.to(x.device), w, reduction="sum"),
                                          (LOGITS.log_softmax(1), W4), (1,))
            cases[f"bce_logits_{red}"] = (lambda a, b: F.binary_cross_entropy_with_logits(a, b, reduction="sum"),
                                          (LOGITS, Q), (1,))
            continue
        cases.update({
            f"nll_weight_{red}": (lambda x, w, r=red: F.nll_loss(x, TGT.to(x.device), w, reduction=r),
                                  (LOGITS.log_softmax(1), W4), (1,)),
            f"nll_ignore_{red}": (lambda x, r=red: F.nll_loss(x, TGT.clamp(min=0).to(x.device), ignore_index=3, reduction=r),
                                  (LOGITS.log_softmax(1),), ()),
            f"nll2d_{red}": (lambda x, w, r=red: F.nll_loss(x, T4C.to(x.device), w, reduction=r), (X4C, W3), (1,)),
            # every target ignored (a fully padded batch): the mean is nan, its gradient zeros
            f"cross_entropy_all_ignored_{red}": (
                lambda x, w, r=red: F.cross_entropy(x, torch.full((5,), -100, device=x.device), weight=w,
                                                    label_smoothing=0.1, reduction=r),
                (LOGITS, W4), (1,)),
            f"cross_entropy_smoothing_{red}": (
                lambda x, w, r=red: F.cross_entropy(x, T4C.to(x.device), weight=w, label_smoothing=0.2, reduction=r),
                (X4C, W3), (1,)),
            f"cross_entropy_probs_{red}": (lambda x, p, r=red: F.cross_entropy(x, p, reduction=r),
                                           (LOGITS, Q.softmax(1)), (1,)),
            f"mse_{red}": (lambda a, b, r=red: F.mse_loss(a, b, reduction=r), (LOGITS, Y), ()),
            f"smooth_l1_{red}": (lambda a, b, r=red: F.smooth_l1_loss(a, b, reduction=r, beta=0.5), (LOGITS, Y), ()),
            f"huber_{red}": (lambda a, b, r=red: F.huber_loss(a, b, reduction=r, delta=0.7), (LOGITS, Y), ()),
            f"bce_{red}": (lambda a, b, w, r=red: F.binary_cross_entropy(a, b, w, reduction=r), (P, Q, W4), (1, 2)),
            f"bce_logits_{red}": (lambda a, b, w, pw, r=red: F.binary_cross_entropy_with_logits(
                a, b, w, reduction=r, pos_weight=pw), (LOGITS * 5, Q, W4, W4 * 3), (2, 3)),
            f"kl_div_{red}": (lambda a, b, r=red: F.kl_div(a, b, reduction=r), (LOGITS.log_softmax(1), Q), ()),
            f"soft_margin_{red}": (lambda a, r=red: F.soft_margin_loss(a, Y.sign().to(a.device), reduction=r), (LOGITS,), ()),
            f"multilabel_margin_{red}": (lambda a, r=red: F.multilabel_margin_loss(
                a, torch.tensor([[3, 0, -1, 1], [1, 2, 3, -1], [-1, 1, 2, 0], [0, 1, 2, 3], [2, -1, 0, 0]]
                                ).to(a.device), reduction=r), (LOGITS,), ()),
            f"multi_margin_{red}": (lambda a, w, r=red: F.multi_margin_loss(
                a, TGT.clamp(min=0).to(a.device), p=2, margin=0.7, weight=w, reduction=r), (LOGITS, W4), (1,)),
        })
    return cases


LOSS = _loss_cases()


@pytest.mark.parametrize("case", sorted(LOSS))
def test_loss(case):
    fn, inputs, no_grad = LOSS[case]
    _compare(fn, *inputs, no_grad=no_grad)


def test_nll_loss_out_of_range_target_raises_and_is_never_a_number():
    # the bounds check raises at the next sync (eager/checks.py); the value itself is NaN, so
    # even once the error was reported it is not a plausible loss
    out = F.nll_loss(LOGITS.to(DEV), torch.tensor([0, 9, 1, 1, 2], device=DEV))
    with pytest.raises(IndexError, match="Target is out of bounds"):
        out.cpu()
    assert torch.isnan(out.cpu())


# ------------------------------------------------------------------ attention

QA, KA, VA = _r(2, 4, 5, 8, seed=10), _r(2, 4, 7, 8, seed=11), _r(2, 4, 7, 6, seed=12)
SDPA = F.scaled_dot_product_attention
ATTN = {
    "plain": (lambda q, k, v: SDPA(q, k, v), (QA, KA, VA)),
    "causal_scale": (lambda q, k, v: SDPA(q, k, v, is_causal=True, scale=0.3), (QA, KA, VA)),
    "bool_mask": (lambda q, k, v: SDPA(q, k, v, attn_mask=(_r(5, 7, seed=13) > -0.5).to(q.device)), (QA, KA, VA)),
    "float_mask_grad": (lambda q, k, v, b: SDPA(q, k, v, attn_mask=b), (QA, KA, VA, _r(2, 1, 5, 7, seed=14))),
    "gqa_causal": (lambda q, k, v: SDPA(q, k, v, enable_gqa=True, is_causal=True), (QA, KA[:, :2], VA[:, :2])),
    "3d": (lambda q, k, v: SDPA(q, k, v), (QA[0], KA[0], VA[0])),
}


@pytest.mark.parametrize("case", sorted(ATTN))
def test_sdpa(case):
    fn, inputs = ATTN[case]
    _compare(fn, *inputs)


def test_sdpa_fully_masked_row_is_zero_like_cpu():
    m = torch.ones(5, 7, dtype=torch.bool)
    m[2] = False
    _compare(lambda q, k, v: SDPA(q, k, v, attn_mask=m.to(q.device)), QA, KA, VA)


def test_sdpa_uses_fused_op():
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    q = _r(1, 2, 3, 4, seed=20).to(DEV).requires_grad_()
    with Record():
        SDPA(q, q, q).sum().backward()
    assert torch.ops.aten._scaled_dot_product_fused_attention_overrideable.default in seen
    assert torch.ops.aten._scaled_dot_product_fused_attention_overrideable_backward.default in seen
    assert torch.ops.aten.bmm.default not in seen  # not the math path


def test_sdpa_dropout_backward_uses_forward_mask():
    # out = A @ v with A = dropout(softmax(q k^T)); v = I makes out == A, and then the gradient
    # of <out, g> w.r.t. v must be A^T g: only true if the backward regenerates the same mask.
    p = 0.5
    q, k = _r(1, 2, 6, 6, seed=30).to(DEV), _r(1, 2, 6, 6, seed=31).to(DEV)
    v = torch.eye(6).expand(1, 2, 6, 6).contiguous().to(DEV).requires_grad_()
    torch.manual_seed(0)
    a = SDPA(q, k, v, dropout_p=p)
    g = _r(1, 2, 6, 6, seed=32)
    (gv,) = torch.autograd.grad(a, v, g.to(DEV))
    a = a.detach().cpu()
    torch.testing.assert_close(gv.cpu(), a.transpose(-1, -2) @ g)
    dropped = (a == 0).float().mean().item()
    assert 0.2 < dropped < 0.8
    torch.manual_seed(0)
    torch.testing.assert_close(SDPA(q, k, v, dropout_p=p).cpu(), a)  # reproducible under the seed


# ------------------------------------------------------------------ models

class _CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=2)
        self.pool = nn.MaxPool2d(2)
        self.head = nn.Linear(8 * 2 * 2, 5)

    def forward(self, x):
        x = self.pool(F.relu(self.bn1(self.conv1(x))))
        x = F.adaptive_avg_pool2d(F.relu(self.conv2(x)), 2)
        return self.head(x.flatten(1))


def _train_compare(make, x, target, loss_fn, steps=2, atol=1e-4):
    torch.manual_seed(0)
    m_cpu = make()
    m_dev = make()
    m_dev.load_state_dict(m_cpu.state_dict())
    m_dev.to(DEV)
    opt_c = torch.optim.SGD(m_cpu.parameters(), lr=0.1)
    opt_d = torch.optim.SGD(m_dev.parameters(), lr=0.1)
    for _ in range(steps):
        lc = loss_fn(m_cpu(x), target)
        ld = loss_fn(m_dev(x.to(DEV)), target.to(DEV))
        torch.testing.assert_close(ld.detach().cpu(), lc.detach(), atol=atol, rtol=atol)
        opt_c.zero_grad(), opt_d.zero_grad()
        lc.backward(), ld.backward()
        for (n, pc), pd in zip(m_cpu.named_parameters(), m_dev.parameters()):
            torch.testing.assert_close(pd.grad.cpu(), pc.grad, atol=atol, rtol=atol, msg=n)
        opt_c.step(), opt_d.step()
    for (n, bc), bd in zip(m_cpu.named_buffers(), m_dev.buffers()):
        torch.testing.assert_close(bd.cpu(), bc, atol=atol, rtol=atol, msg=n)
    m_cpu.eval(), m_dev.eval()
    with torch.no_grad():
        torch.testing.assert_close(m_dev(x.to(DEV)).cpu(), m_cpu(x), atol=atol, rtol=atol)


def test_small_cnn_training_matches_cpu():
    x = _r(4, 3, 8, 8, seed=40)
    t = torch.tensor([0, 4, 2, 1])
    _train_compare(_CNN, x, t, lambda o, t: F.cross_entropy(o, t, label_smoothing=0.1))


class _Block(nn.Module):
    def __init__(self, d=16, h=4):
        super().__init__()
        self.h = h
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.h, d // self.h).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


def test_transformer_block_training_matches_cpu():
    x = _r(2, 6, 16, seed=50)
    target = _r(2, 6, 16, seed=51)
    _train_compare(_Block, x, target, F.mse_loss)


def test_transformer_encoder_layer_matches_cpu():
    x = _r(2, 5, 16, seed=60)
    target = _r(2, 5, 16, seed=61)
    make = lambda: nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)  # noqa: E731
    _train_compare(make, x, target, F.mse_loss, steps=1)


@pytest.mark.parametrize("norm_first,activation", [(False, "relu"), (True, "gelu")])
def test_transformer_encoder_layer_inference_fast_path(norm_first, activation):
    # eval + no_grad: PyTorch calls the fused aten::_transformer_encoder_layer_fwd
    torch.manual_seed(0)
    make = lambda: nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True,  # noqa: E731
                                              norm_first=norm_first, activation=activation).eval()
    cpu, dev = make(), make()
    dev.load_state_dict(cpu.state_dict())
    dev.to(DEV)
    x = _r(2, 5, 16, seed=80)
    kpm = torch.tensor([[False] * 5, [False, False, False, True, True]])
    causal = torch.ones(5, 5, dtype=torch.bool).triu(1)
    before = _fallbacks()
    with torch.no_grad():
        for kw in ({}, {"src_key_padding_mask": kpm}, {"src_mask": causal, "src_key_padding_mask": kpm}):
            out = dev(x.to(DEV), **{k: v.to(DEV) for k, v in kw.items()})
            torch.testing.assert_close(out.cpu(), cpu(x, **kw))
    assert _fallbacks() == before


def test_multihead_attention_inference_fast_path():
    torch.manual_seed(0)
    cpu = nn.MultiheadAttention(16, 4, batch_first=True).eval()
    dev = nn.MultiheadAttention(16, 4, batch_first=True).eval()
    dev.load_state_dict(cpu.state_dict())
    dev.to(DEV)
    x, y = _r(2, 5, 16, seed=90), _r(2, 7, 16, seed=91)
    kpm = torch.zeros(2, 7, dtype=torch.bool)
    kpm[1, 5:] = True
    before = _fallbacks()
    with torch.no_grad():
        for args, kw in (((x, x, x), {}), ((x, y, y), {"key_padding_mask": kpm, "average_attn_weights": False}),
                         ((x, x, x), {"need_weights": False})):
            a = cpu(*args, **kw)
            b = dev(*(t.to(DEV) for t in args), **{k: v.to(DEV) if isinstance(v, torch.Tensor) else v
                                                   for k, v in kw.items()})
            torch.testing.assert_close(b[0].cpu(), a[0])
            assert (a[1] is None) == (b[1] is None)
            if a[1] is not None:
                torch.testing.assert_close(b[1].cpu(), a[1])
    assert _fallbacks() == before


@pytest.mark.parametrize("mode", ["strict", "fused", "compiled"])
def test_sdpa_without_dropout_draws_no_randomness(mode):
    # as on CUDA (the philox offset advances only when dropout is on): an SDPA call with
    # dropout_p == 0 leaves the generator as it was, in every executor, while dropout > 0
    # still draws (and is reproducible under the seed)
    q, k, v = (_r(2, 3, 5, 4, seed=s).to(DEV) for s in (40, 41, 42))
    if mode == "compiled":
        torch._dynamo.reset()
        f = torch.compile(lambda q, k, v, p: SDPA(q, k, v, dropout_p=p, is_causal=True),
                          backend="tpu")
    else:
        f = lambda q, k, v, p: SDPA(q, k, v, dropout_p=p, is_causal=True)  # noqa: E731
    ctx = (torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE) if mode == "fused"
           else torch.no_grad())
    expect = SDPA(q.cpu(), k.cpu(), v.cpu(), is_causal=True)
    with ctx:
        torch.manual_seed(3)
        state = torch.tpu.get_rng_state()
        for _ in range(2):
            torch.testing.assert_close(f(q, k, v, 0.0).cpu(), expect)
        assert torch.equal(torch.tpu.get_rng_state(), state)
        after = torch.rand(3, device=DEV).cpu()
        torch.manual_seed(3)
        torch.testing.assert_close(torch.rand(3, device=DEV).cpu(), after)
        # dropout on: draws, and the next draw differs; same seed, same mask
        torch.manual_seed(3)
        a = f(q, k, v, 0.5).cpu()
        assert not torch.equal(torch.tpu.get_rng_state(), state)
        assert not torch.equal(torch.rand(3, device=DEV).cpu(), after)
        torch.manual_seed(3)
        torch.testing.assert_close(f(q, k, v, 0.5).cpu(), a)
        assert not torch.allclose(a, expect)


# ------------------------------------------------- ops that used to fall back to CPU
# Each runs eagerly (Strict) and under torch.compile(backend="tpu"), compares the outputs and
# gradients with CPU, and checks that nothing ran on the CPU fallback.

def _compare_no_fallback(fn, inputs, mode, no_grad=(), atol=ATOL, rtol=RTOL):
    from torchtpu.runtime.metrics import COUNTERS
    keys = ("cpu_fallbacks", "compile_cpu_fallbacks")
    before = [COUNTERS.get(k, 0) for k in keys]
    dev_fn = fn
    if mode == "compiled":
        torch._dynamo.reset()
        dev_fn = torch.compile(fn, backend="tpu")
    _compare(fn, *inputs, no_grad=no_grad, atol=atol, rtol=rtol, dev_fn=dev_fn, grad_nan=True)
    assert [COUNTERS.get(k, 0) for k in keys] == before, "fell back to CPU"


WEIGHT_NORM = {
    "dim0": (lambda v, g: torch._weight_norm(v, g, 0), (_r(4, 3, 5, seed=50), _r(4, 1, 1, seed=51))),
    "dim_last": (lambda v, g: torch._weight_norm(v, g, 2), (_r(4, 3, 5, seed=52), _r(1, 1, 5, seed=53))),
    "interface_norms": (lambda v, g: torch._weight_norm_interface(v, g, 0),
                        (_r(6, 2, seed=54), _r(6, 1, seed=55))),
    "whole_tensor": (lambda v, g: torch._weight_norm(v, g, -1), (_r(3, 4, seed=56), _r((), seed=57))),
}


@pytest.mark.parametrize("mode", ["strict", "compiled"])
@pytest.mark.parametrize("case", sorted(WEIGHT_NORM))
def test_weight_norm(case, mode):
    fn, inputs = WEIGHT_NORM[case]
    _compare_no_fallback(fn, inputs, mode)


@pytest.mark.parametrize("mode", ["strict", "compiled"])
def test_weight_norm_parametrized_conv1d_trains_like_cpu(mode):
    # HiFi-GAN's layer: a weight-normed Conv1d (parametrizations.weight_norm, dim 0)
    torch.manual_seed(0)
    conv = nn.utils.parametrizations.weight_norm(nn.Conv1d(3, 4, 5, padding=2))
    x = _r(2, 3, 16, seed=58)
    params = dict(conv.named_parameters())

    def fn(x, g, v, b):
        return torch.func.functional_call(conv, {"parametrizations.weight.original0": g,
                                                 "parametrizations.weight.original1": v,
                                                 "bias": b}, (x,))
    inputs = (x, params["parametrizations.weight.original0"].detach(),
              params["parametrizations.weight.original1"].detach(), params["bias"].detach())
    _compare_no_fallback(fn, inputs, mode, no_grad=(0,), atol=1e-5, rtol=1e-4)


def _pdist_x(n=6, m=4, seed=70):
    x = _r(n, m, seed=seed)
    x[3] = x[1]  # a duplicate row: distance 0, its gradient 0 as on CPU
    x[4, 0] = x[2, 0]  # one equal coordinate (p < 1 and inf take care there)
    return x


PDIST = {f"p{p}": (lambda x, p=p: F.pdist(x, p), (_pdist_x(),))
         for p in (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, float("inf"))}
PDIST["one_row"] = (lambda x: F.pdist(x), (_r(1, 3, seed=71),))
PDIST["no_columns"] = (lambda x: F.pdist(x, 3.0), (_r(4, 0, seed=72),))


@pytest.mark.parametrize("mode", ["strict", "compiled"])
@pytest.mark.parametrize("case", sorted(PDIST))
def test_pdist(case, mode):
    fn, inputs = PDIST[case]
    _compare_no_fallback(fn, inputs, mode)


@pytest.mark.parametrize("mode", ["strict", "fused"])
@pytest.mark.parametrize("kind", ["linear", "bilinear", "trilinear"])
def test_linear_upsample_leaves_an_unchanged_dimension_as_is(kind, mode):
    # CPU's linear kernels skip a dimension whose size stays the same even when its scale_factor
    # is not 1 (10 rows * 1.09 -> 10 rows: the rows come back as they were); the lowering
    # resampled them at 1/1.09 and was off by up to 4
    nd = {"linear": 1, "bilinear": 2, "trilinear": 3}[kind]
    sf = (1.09, 1.5, 0.7)[:nd]
    x = _r(*(2, 3, 10, 6, 5)[:2 + nd], seed=5)
    ctx = (torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE) if mode == "fused"
           else torch.no_grad())
    with ctx:
        want = F.interpolate(x, mode=kind, scale_factor=sf, recompute_scale_factor=False)
        got = F.interpolate(x.to(DEV), mode=kind, scale_factor=sf,
                            recompute_scale_factor=False).cpu()
        torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-5)
    xg = x.clone().requires_grad_()
    xd = x.to(DEV).requires_grad_()
    F.interpolate(xg, mode=kind, scale_factor=sf, recompute_scale_factor=False).sum().backward()
    F.interpolate(xd, mode=kind, scale_factor=sf, recompute_scale_factor=False).sum().backward()
    torch.testing.assert_close(xd.grad.cpu(), xg.grad, atol=ATOL, rtol=1e-5)


@pytest.mark.parametrize("mode", ["strict", "fused"])
@pytest.mark.parametrize("kind", ["bilinear", "bicubic"])
def test_upsample_reads_only_its_taps(kind, mode):
    # each output reads only the 2 (linear) / 4 (cubic) input pixels next to it: one inf pixel
    # spoils only its neighbours, as on CPU. A dense (out x in) weight matrix multiplied the inf
    # by the zero weights of every other output (0 * inf = nan over whole rows and columns), and
    # cost out x in instead of out x taps
    x = _r(1, 2, 12, 16, seed=3)
    x[0, 1, 2, 3] = float("inf")
    ctx = (torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE) if mode == "fused"
           else torch.no_grad())
    with ctx:
        want = F.interpolate(x, size=(30, 41), mode=kind)
        got = F.interpolate(x.to(DEV), size=(30, 41), mode=kind).cpu()
    assert int(torch.isfinite(want).sum()) > 0.9 * want.numel()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5, equal_nan=True)


# ------------------------------------------------------------------ antialiased resize

AA = {}  # torchvision's Resize default: bilinear/bicubic with antialias=True
for _kind in ("bilinear", "bicubic"):
    for _ac in (False, True):
        AA[f"{_kind}_down_ac{_ac}"] = (
            lambda x, k=_kind, a=_ac: F.interpolate(x, size=(4, 3), mode=k, align_corners=a, antialias=True),
            _r(2, 3, 19, 27, seed=60))
        AA[f"{_kind}_mixed_ac{_ac}"] = (
            lambda x, k=_kind, a=_ac: F.interpolate(x, size=(23, 5), mode=k, align_corners=a, antialias=True),
            _r(1, 2, 9, 26, seed=61))
    AA[f"{_kind}_scale"] = (
        lambda x, k=_kind: F.interpolate(x, scale_factor=(0.3, 1.7), mode=k, antialias=True),
        _r(1, 3, 20, 9, seed=62))
    AA[f"{_kind}_up"] = (lambda x, k=_kind: F.interpolate(x, size=(17, 11), mode=k, antialias=True),
                         _r(1, 3, 6, 5, seed=63))
    AA[f"{_kind}_one_side"] = (lambda x, k=_kind: F.interpolate(x, size=(7, 12), mode=k, antialias=True),
                               _r(1, 3, 30, 12, seed=64))
    AA[f"{_kind}_float64"] = (lambda x, k=_kind: F.interpolate(x, size=(5, 4), mode=k, antialias=True),
                              _r(1, 2, 33, 17, seed=65).double())


@pytest.mark.parametrize("mode", ["strict", "compiled"])
@pytest.mark.parametrize("case", sorted(AA))
def test_antialias_resize_runs_on_device(case, mode):
    # _upsample_bilinear2d_aa / _upsample_bicubic2d_aa (and their backward ops) were CPU
    # fallbacks; each output reads its antialias window (support grows with the downscale)
    fn, x = AA[case]
    _compare_no_fallback(fn, (x,), mode, atol=1e-5 if "bilinear" in case else 1e-4)


@pytest.mark.parametrize("kind", ["bilinear", "bicubic"])
def test_antialias_resize_fused(kind):
    from torchtpu.runtime.metrics import COUNTERS
    x = _r(2, 3, 40, 31, seed=66)
    before = COUNTERS.get("cpu_fallbacks", 0)
    with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE):
        got = F.interpolate(x.to(DEV) * 2, size=(9, 13), mode=kind, antialias=True) + 1
        got = got.cpu()
    assert COUNTERS.get("cpu_fallbacks", 0) == before, "fell back to CPU"
    want = F.interpolate(x * 2, size=(9, 13), mode=kind, antialias=True) + 1
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)


def _aa_uint8_cases(n, seed):
    import random
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        h, w = rng.randint(1, 40), rng.randint(1, 40)
        ac = rng.random() < 0.3
        if rng.random() < 0.5 or ac:
            kw = dict(size=(rng.randint(1, 45), rng.randint(1, 45)))
        else:
            # scale factors that keep at least one output pixel
            kw = dict(scale_factor=(rng.uniform(1.001 / h, 2.5), rng.uniform(1.001 / w, 2.5)),
                      recompute_scale_factor=rng.random() < 0.5)
        out.append((rng.randint(1, 2), rng.choice([1, 3, 4]), h, w, ac, kw, rng.randrange(1 << 30)))
    return out


@pytest.mark.parametrize("mode", ["strict", "fused", "compiled"])
@pytest.mark.parametrize("kind", ["bilinear", "bicubic"])
def test_antialias_resize_uint8_bit_exact(kind, mode):
    # CPU's uint8 antialias kernel (torchvision's Resize on uint8 images) rounds each window's
    # float64 weights to int16 fixed point, adds half a unit, shifts and clamps after each pass:
    # the device gives the same bytes on random sizes and scales, contiguous and channels_last
    from torchtpu.runtime.metrics import COUNTERS
    keys = ("cpu_fallbacks", "compile_cpu_fallbacks")
    before = [COUNTERS.get(k, 0) for k in keys]
    ctx = (torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE) if mode == "fused"
           else torch.no_grad())
    cases = _aa_uint8_cases(40, seed=70 + (kind == "bicubic"))
    with ctx:
        for k, (n, c, h, w, ac, kw, s) in enumerate(cases[:6] if mode == "compiled" else cases):
            g = torch.Generator().manual_seed(s)
            x = torch.randint(0, 256, (n, c, h, w), generator=g, dtype=torch.uint8)
            if k % 2:
                x = x.contiguous(memory_format=torch.channels_last)
            fn = lambda t: F.interpolate(t, mode=kind, align_corners=ac, antialias=True, **kw)  # noqa: E731
            want = fn(x)
            if mode == "compiled":
                torch._dynamo.reset()
                fn = torch.compile(fn, backend="tpu")
            got = fn(x.to(DEV)).cpu()
            assert got.dtype == torch.uint8
            assert torch.equal(got, want), (n, c, h, w, ac, kw, k % 2)
    assert [COUNTERS.get(k, 0) for k in keys] == before, "fell back to CPU"


@pytest.mark.parametrize("kind", ["bilinear", "bicubic"])
def test_antialias_resize_to_one_column_resamples_the_rows(kind):
    # PyTorch 2.13's float antialias CPU kernel gives every output row the first row's value when
    # the output is one column wide (uint8 and a two-column output are right); the device
    # resamples the rows: it matches CPU's own two-column result, column by column
    x = _r(1, 2, 31, 1, seed=67)
    got = F.interpolate(x.to(DEV), size=(6, 1), mode=kind, antialias=True).cpu()
    want = F.interpolate(x.expand(1, 2, 31, 2).contiguous(), size=(6, 2), mode=kind,
                         antialias=True)[..., :1]
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    assert got[0, 0, 0, 0] != got[0, 0, 1, 0]
    # uint8 with more than 4 channels takes CPU's generic kernel, with the same fault; its
    # 4-channel kernel is right and the device gives its bytes for every channel
    g = torch.Generator().manual_seed(68)
    xu = torch.randint(0, 256, (1, 8, 31, 3), generator=g, dtype=torch.uint8)
    got = F.interpolate(xu.to(DEV), size=(6, 1), mode=kind, antialias=True).cpu()
    want = torch.cat([F.interpolate(xu[:, i:i + 4], size=(6, 1), mode=kind, antialias=True)
                      for i in (0, 4)], 1)
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.int32])
def test_antialias_resize_dtypes_cpu_refuses_raise_like_cpu(dtype):
    x = torch.ones(1, 2, 6, 8, dtype=dtype)
    with pytest.raises(NotImplementedError, match="compute_index_ranges_weights"):
        F.interpolate(x, size=(3, 4), mode="bilinear", antialias=True)
    with pytest.raises(NotImplementedError, match="compute_index_ranges_weights"):
        F.interpolate(x.to(DEV), size=(3, 4), mode="bilinear", antialias=True).cpu()


@pytest.mark.parametrize("kind", ["bilinear", "bicubic"])
def test_antialias_resize_inf_spoils_only_its_windows(kind):
    # a window shorter at the border pads its taps with weight 0: the pad must add 0, not
    # 0 * (the pixel it points at), or one inf pixel would be nan in border outputs
    x = _r(1, 2, 24, 30, seed=69)
    x[0, 0, 0, 0] = float("inf")
    x[0, 1, 23, 29] = float("-inf")
    with torch.no_grad():
        want = F.interpolate(x, size=(7, 9), mode=kind, antialias=True)
        got = F.interpolate(x.to(DEV), size=(7, 9), mode=kind, antialias=True).cpu()
    assert int(torch.isfinite(want).sum()) > 0.8 * want.numel()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5, equal_nan=True)


@pytest.mark.parametrize("mode", ["strict", "compiled"])
@pytest.mark.parametrize("kind", ["bilinear", "bicubic"])
def test_antialias_resize_large_downscale(kind, mode):
    # 1/60 downscales: 121 (bilinear) / 241 (bicubic) taps per output, summed by a loop (the
    # unrolled gathers took XLA ~30 s to compile for 1080x1920 -> 4x4); same values, gradients,
    # uint8 bytes, and an inf pixel still spoils only its windows
    x = _r(1, 2, 181, 122, seed=71)
    fn = lambda t: F.interpolate(t, size=(3, 2), mode=kind, antialias=True)  # noqa: E731
    _compare_no_fallback(fn, (x,), mode, atol=1e-5, rtol=1e-4)
    g = torch.Generator().manual_seed(72)
    xu = torch.randint(0, 256, (1, 3, 181, 122), generator=g, dtype=torch.uint8)
    if mode == "compiled":
        torch._dynamo.reset()
        fn = torch.compile(fn, backend="tpu")
    assert torch.equal(fn(xu.to(DEV)).cpu(), F.interpolate(xu, size=(3, 2), mode=kind, antialias=True))
    x[0, 0, 0, 0] = float("inf")
    with torch.no_grad():
        torch.testing.assert_close(fn(x.to(DEV)).cpu(), F.interpolate(x, size=(3, 2), mode=kind, antialias=True),
                                   atol=1e-5, rtol=1e-4, equal_nan=True)
