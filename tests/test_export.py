"""torch.tpu.export: ExportedProgram -> StableHLO artifacts, compared with PyTorch on CPU.

The saved artifacts are also run by a fresh Python process that imports only JAX and numpy
(it asserts that torch was never imported)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.export import Dim
from torch.func import functional_call

import torchtpu  # noqa: F401
from torchtpu.export import (ExportError, StableHLOExportOptions, export_function,
                             exported_program_to_stablehlo, load)

transformers = pytest.importorskip("transformers")

VOCAB = 64


def tiny_llama():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=32)).eval()


def cnn():
    """torchvision-style: conv/BN/ReLU/pool stages, global pooling, a classifier."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))


def _randomize_bn(m):
    with torch.no_grad():
        for mod in m.modules():
            if isinstance(mod, nn.BatchNorm2d):
                mod.running_mean.uniform_(-0.5, 0.5)
                mod.running_var.uniform_(0.5, 2.0)
                mod.weight.uniform_(0.5, 1.5)


# run by a subprocess: JAX and numpy only
_RUNNER = r"""
import json, sys
import numpy as np
import jax
jax.config.update("jax_enable_x64", sys.argv[2] == "1")  # int64/float64 inputs
for d, inp, out in json.loads(sys.argv[1]):
    with open(d + "/program.jaxexport", "rb") as f:
        exp = jax.export.deserialize(bytearray(f.read()))
    meta = json.load(open(d + "/meta.json"))
    state = np.load(d + "/state.npz")
    xs = np.load(inp)
    args = [state[n] for n in meta["state_names"]] + [xs[f"x{i}"] for i in range(len(xs.files))]
    # bfloat16 travels as its bits (npz has no bfloat16): view as the function's dtypes
    args = [a.view(aval.dtype) for a, aval in zip(args, exp.in_avals)]
    res = exp.call(*args)
    np.savez(out, *[np.asarray(r).view(f"u{r.dtype.itemsize}") if r.dtype.name == "bfloat16"
                    else np.asarray(r) for r in res])
assert "torch" not in sys.modules, "the artifact runner imported torch"
print("ok")
"""


def _run_without_torch(jobs, x64=True):
    """jobs: [(artifact dir, [numpy inputs])] -> [list of numpy outputs] from a JAX-only process
    (``x64``: with jax_enable_x64, which int64 inputs need)."""
    spec = []
    for k, (d, inputs) in enumerate(jobs):
        inp = os.path.join(d, f"in{k}.npz")
        np.savez(inp, **{f"x{i}": x for i, x in enumerate(inputs)})
        spec.append((d, inp, os.path.join(d, f"out{k}.npz")))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-c", _RUNNER, json.dumps(spec), "1" if x64 else "0"],
                       capture_output=True,
                       text=True, env=env, timeout=300)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]
    outs = []
    for _, _, out in spec:
        with np.load(out) as z:
            outs.append([z[f"arr_{i}"] for i in range(len(z.files))])
    return outs


def test_llama_forward_matches_cpu_and_runs_without_torch(tmp_path):
    m = tiny_llama()
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    ref = m(ids, use_cache=False).logits
    ep = torch.export.export(m, (ids,), kwargs={"use_cache": False})
    prog = exported_program_to_stablehlo(ep)
    text = prog.get_stablehlo_text()
    assert "module @jit_exported_program" in text and "stablehlo.dot_general" in text
    assert "callback" not in text  # every op lowered: no host callbacks
    assert prog.get_stablehlo_bytecode()[:4] == b"ML\xefR"  # MLIR bytecode magic
    assert prog.state_names[0] == "model.embed_tokens.weight"
    out = prog(ids.to("tpu"), use_cache=False)
    assert out.logits.device.type == "tpu"
    torch.testing.assert_close(out.logits.cpu(), ref)
    # the artifact: JAX + numpy only
    d = str(tmp_path / "llama")
    prog.save(d)
    assert sorted(os.listdir(d)) == ["meta.json", "program.jaxexport", "state.npz"]
    with np.load(os.path.join(d, "state.npz")) as z:
        assert sorted(z.files) == sorted(prog.state_names)
        np.testing.assert_array_equal(z["lm_head.weight"], m.lm_head.weight.detach().numpy())
    (logits,), = _run_without_torch([(d, [ids.numpy()])])
    torch.testing.assert_close(torch.from_numpy(logits), ref)


@pytest.mark.parametrize("decompositions", ["tpu", "core"])
def test_llama_on_tpu_with_sdpa_exports(decompositions):
    """A model on "tpu" calling F.scaled_dot_product_attention (transformers' default attention):
    the composite op has a tpu kernel, so run_decompositions kept it whole and the export failed
    ("aten::scaled_dot_product_attention.default has no lowering"); it is exported through
    PyTorch's math path. The caller's ExportedProgram is left unchanged."""
    m = tiny_llama()
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(4))
    ref = m(ids, use_cache=False).logits
    m.to("tpu")
    ep = torch.export.export(m, (ids.to("tpu"),), kwargs={"use_cache": False})
    targets = [n.target for n in ep.graph.nodes]
    assert torch.ops.aten.scaled_dot_product_attention.default in targets
    prog = exported_program_to_stablehlo(ep, StableHLOExportOptions(decompositions=decompositions))
    assert [n.target for n in ep.graph.nodes] == targets
    torch.testing.assert_close(prog(ids.to("tpu"), use_cache=False).logits.cpu(), ref)


def test_sdpa_masks_of_a_tpu_model_export():
    """Boolean and float masks, grouped-query heads and an explicit scale, on "tpu"."""
    class Attn(nn.Module):
        def forward(self, q, k, v, bmask, fmask):
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=bmask, enable_gqa=True)
            b = F.scaled_dot_product_attention(q, k, v, attn_mask=fmask, scale=0.3,
                                               enable_gqa=True)
            return a + b

    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 5, 8, generator=g)
    k, v = torch.randn(2, 2, 7, 8, generator=g), torch.randn(2, 2, 7, 8, generator=g)
    bmask = torch.rand(5, 7, generator=g) > 0.3
    bmask[:, 0] = True  # no fully masked row
    fmask = torch.randn(2, 1, 5, 7, generator=g)
    args = (q, k, v, bmask, fmask)
    ref = Attn()(*args)
    prog = exported_program_to_stablehlo(torch.export.export(Attn(), tuple(a.to("tpu")
                                                                           for a in args)))
    torch.testing.assert_close(prog(*[a.to("tpu") for a in args]).cpu(), ref)


def test_llama_core_aten_opset_dynamic_batch_and_length():
    """With PyTorch's core ATen decompositions (the opset torch.export's users target), every
    op lowers (no host callbacks: an op without a lowering would raise ExportError); batch and
    sequence length stay symbolic."""
    m = tiny_llama()
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(2))
    ep = torch.export.export(m, (), kwargs={"input_ids": ids, "use_cache": False},
                             dynamic_shapes={"input_ids": {0: Dim("b", max=16),
                                                           1: Dim("s", max=32)},
                                             "use_cache": None})
    prog = exported_program_to_stablehlo(ep, StableHLOExportOptions(decompositions="core"))
    assert "tensor<?x?xi64>" in prog.get_stablehlo_text()
    for shape in [(1, 5), (3, 11)]:
        x = torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(3))
        torch.testing.assert_close(prog(input_ids=x, use_cache=False).logits.cpu(),
                                   m(x, use_cache=False).logits)


def test_bfloat16_state_saved_and_loaded(tmp_path):
    """bfloat16 state goes into state.npz as its bits; load() restores it and runs on tpu."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 3)).to(torch.bfloat16).eval()
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    prog = exported_program_to_stablehlo(torch.export.export(m, (x,)))
    d = str(tmp_path / "bf16")
    prog.save(d)
    with open(os.path.join(d, "meta.json")) as f:
        assert json.load(f)["state_dtypes"][0] == "bfloat16"
    loaded = load(d)
    out = loaded(x.to("tpu"))
    assert out.dtype == torch.bfloat16 and out.device.type == "tpu"
    torch.testing.assert_close(out.cpu(), m(x))
    (y,), = _run_without_torch([(d, [x.view(torch.int16).numpy()])])
    torch.testing.assert_close(torch.from_numpy(y.view(np.int16)).view(torch.bfloat16), m(x))


def test_cnn_of_a_tpu_model_dynamic_batch(tmp_path):
    torch.manual_seed(0)
    m = cnn().eval()
    _randomize_bn(m)
    mt = cnn().eval()
    mt.load_state_dict(m.state_dict())
    mt = mt.to("tpu")
    x = torch.randn(4, 3, 16, 16)
    ep = torch.export.export(mt, (x.to("tpu"),),
                             dynamic_shapes=({0: Dim("batch", min=1, max=64)},))
    prog = exported_program_to_stablehlo(ep)
    batch_dim = prog.exported.in_avals[-1].shape[0]
    assert not isinstance(batch_dim, int)  # shape-polymorphic StableHLO
    assert "tensor<?x3x16x16xf32>" in prog.get_stablehlo_text()
    xs = [torch.randn(n, 3, 16, 16) for n in (3, 7)]
    for xx in xs:
        torch.testing.assert_close(prog(xx.to("tpu")).cpu(), m(xx))
    d = str(tmp_path / "cnn")
    prog.save(d)
    # state the program never reads (the eval BatchNorms' int64 batch counts) is left out, so
    # a float32 model's artifact runs without jax_enable_x64
    assert not any(n.endswith("num_batches_tracked") for n in prog.state_names)
    outs = _run_without_torch([(d, [xx.numpy()]) for xx in xs], x64=False)
    for (y,), xx in zip(outs, xs):
        torch.testing.assert_close(torch.from_numpy(y), m(xx).detach())


def test_batchnorm_training_mode_buffer_updates():
    """Buffers the program writes (BatchNorm running statistics) come after the user outputs;
    __call__ keeps them in the program's state, as the module keeps its buffers."""
    torch.manual_seed(0)
    m = cnn().train()
    prog_m = cnn().train()
    prog_m.load_state_dict(m.state_dict())
    x = torch.randn(4, 3, 16, 16)
    prog = exported_program_to_stablehlo(torch.export.export(prog_m, (x,)))
    assert prog.output_names[1] == "buffer_mutation:1.running_mean"
    for _ in range(2):
        torch.testing.assert_close(prog(x.to("tpu")).cpu(), m(x))
    for name in ("1.running_mean", "1.running_var", "5.running_var", "5.num_batches_tracked"):
        torch.testing.assert_close(torch.from_numpy(np.asarray(
            prog.state[prog.state_names.index(name)])), m.state_dict()[name])


def _small_net():
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5))


def test_training_step_adam_and_sgd_as_one_program(tmp_path):
    """Forward, loss, backward and the optimizer update exported as one function
    (export_function), run for three steps against torch.optim on CPU."""
    torch.manual_seed(0)
    net = _small_net()
    names = [n for n, _ in net.named_parameters()]

    def grads_of(params, x, y):
        ps = [p.detach().requires_grad_() for p in params]
        loss = F.cross_entropy(functional_call(net, dict(zip(names, ps)), (x,)), y)
        return loss.detach(), torch.autograd.grad(loss, ps)

    def adam_step(params, exp_avg, exp_avg_sq, step, x, y, lr=1e-2, b1=0.9, b2=0.999, eps=1e-8):
        loss, grads = grads_of(params, x, y)
        step = step + 1
        bc1, bc2 = 1 - b1 ** step, 1 - b2 ** step
        new_p, new_m, new_v = [], [], []
        for p, g, m_, v_ in zip(params, grads, exp_avg, exp_avg_sq):
            m_ = m_ * b1 + g * (1 - b1)
            v_ = v_ * b2 + g * g * (1 - b2)
            new_p.append(p - (lr / bc1) * m_ / (v_.sqrt() / bc2.sqrt() + eps))
            new_m.append(m_)
            new_v.append(v_)
        return loss, new_p, new_m, new_v, step

    def sgd_step(params, bufs, x, y, lr=0.1, momentum=0.9):
        loss, grads = grads_of(params, x, y)
        bufs = [b * momentum + g for b, g in zip(bufs, grads)]
        return loss, [p - lr * b for p, b in zip(params, bufs)], bufs

    x, y = torch.randn(6, 3, 8, 8), torch.randint(0, 5, (6,))
    params = [p.detach().clone() for p in net.parameters()]
    zeros = [torch.zeros_like(p) for p in params]
    for kind in ("adam", "sgd"):
        if kind == "adam":
            state = [zeros, zeros, torch.tensor(0.0)]
            ep = export_function(adam_step, (params, *state, x, y))
        else:
            state = [zeros]
            ep = export_function(sgd_step, (params, *state, x, y))
        prog = exported_program_to_stablehlo(ep)
        ref = _small_net()
        ref.load_state_dict(net.state_dict())
        opt = torch.optim.Adam(ref.parameters(), lr=1e-2) if kind == "adam" else \
            torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
        to_tpu = lambda v: [t.to("tpu") for t in v] if isinstance(v, list) else v.to("tpu")  # noqa: E731
        cur = [to_tpu(params)] + [to_tpu(s) for s in state]
        for _ in range(3):
            opt.zero_grad()
            ref_loss = F.cross_entropy(ref(x), y)
            ref_loss.backward()
            opt.step()
            loss, *cur = prog(*cur, x.to("tpu"), y.to("tpu"))
            torch.testing.assert_close(loss.cpu(), ref_loss.detach())
            for p, r in zip(cur[0], ref.parameters()):
                torch.testing.assert_close(p.cpu(), r.detach())
        if kind == "adam":
            # the artifact's first step, from JAX alone: inputs are the flat tensors in order
            d = str(tmp_path / "adam_step")
            prog.save(d)
            flat = [t.numpy() for t in params + zeros + zeros] + [np.float32(0.0), x.numpy(),
                                                                   y.numpy()]
            (outs,) = _run_without_torch([(d, flat)])
            ref1 = adam_step(params, zeros, zeros, torch.tensor(0.0), x, y)
            torch.testing.assert_close(torch.from_numpy(outs[0]), ref1[0])
            for o, r in zip(outs[1:1 + len(params)], ref1[1]):
                torch.testing.assert_close(torch.from_numpy(o), r)


@torch.library.custom_op("torchtpu_export_test::host_only", mutates_args=())
def _host_only(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@_host_only.register_fake
def _(x):
    return torch.empty_like(x)


def test_op_without_lowering_fails_loudly():
    class M(nn.Module):
        def forward(self, x):
            return _host_only(x) + 1

    ep = torch.export.export(M(), (torch.randn(3),))
    with pytest.raises(ExportError, match="torchtpu_export_test::host_only.*host callback"):
        exported_program_to_stablehlo(ep)


def test_input_mutation_written_back():
    """An input the model writes in place is an output of the artifact (after the user
    outputs) and __call__ writes it back, as running the module would."""
    class Accumulate(nn.Module):
        def forward(self, x, acc):
            acc.add_(x)
            return x * 2

    x = torch.randn(3)
    prog = exported_program_to_stablehlo(torch.export.export(Accumulate(), (x, torch.zeros(3))))
    assert prog.output_names[1] == "user_input_mutation:acc"
    acc = torch.ones(3, device="tpu")
    out = prog(x.to("tpu"), acc)
    torch.testing.assert_close(out.cpu(), x * 2)
    torch.testing.assert_close(acc.cpu(), 1 + x)
