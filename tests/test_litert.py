"""LiteRT export of models trained on "tpu": ``torch.tpu.export.to_litert`` and
``litert_torch.convert``, run in the ``ai-edge-litert`` interpreter, compared with PyTorch CPU.

The LiteRT packages live in their own environment (``make venv-litert`` -> ``.venv-litert``;
``TORCHTPU_LITERT_PYTHON`` names another python): each check runs litert_runner.py there in a
subprocess, bounded in time, and the comparisons happen here. The models are trained a few
AdamW steps on "tpu" (litert_models.py).

Float models must match PyTorch CPU within float32 tolerance. The dynamic-int8 models
(ai-edge-quantizer's ``dynamic_wi8_afp32``) are held to what LiteRT documents for dynamic range
quantization, and nothing looser: weights are int8, symmetric per output channel (zero point 0,
values in [-127, 127], ``real = int8 * scale``), so with min-max scales ``scale = max|w| / 127``
and round-to-nearest each weight is within ``scale / 2``; activations are quantized to 8 bits
from their range at run time, so each input of a quantized op is within ``max|x| / 254`` (the
larger of the symmetric ``max|x| / 127 / 2`` and the asymmetric ``range / 255 / 2``). For a
quantized FULLY_CONNECTED/CONV_2D with weight W and input x this bounds the output error by
``max|x|/254 * sum|W_q| + sum|x| * scale/2`` (accumulation in int32 is exact; the float rescale
adds ~2^-24 relative, allowed as 2^-20 of ``|x| @ |W_q|``). Checked: every int8 weight against
its float original, and every quantized op of a run with the builtin kernels (intermediate
tensors kept) against its exact float result on its actual input; the other ops are float, as
in the float model checked against PyTorch. A bound carried through whole networks was tried
and dropped: worst-case, it came out ~300x the MLP's actual error, a check that could not
fail. The default runtime's (XNNPACK) int8 outputs are run, not bounded.
"""
from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import torchtpu  # noqa: F401
from torchtpu.export import exported_program_to_stablehlo, to_litert

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import litert_models  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LITERT_PY = os.environ.get("TORCHTPU_LITERT_PYTHON") or os.path.join(ROOT, ".venv-litert", "bin",
                                                                    "python")
RUNNER = os.path.join(ROOT, "tests", "litert_runner.py")
LLAMA_OUTPUTS = ["logits", "k0", "v0", "k1", "v1"]


def _need_env():
    if not os.access(LITERT_PY, os.X_OK):
        pytest.skip(f"the LiteRT environment is absent ({os.path.relpath(LITERT_PY, ROOT)}): "
                    "`make venv-litert` builds it (litert-torch, litert-converter, ai-edge-litert)")


def _run(job, tmp_path, timeout):
    _need_env()
    job = dict(job, workdir=str(tmp_path), result=str(tmp_path / f"result_{job['mode']}.npz"))
    jf = tmp_path / f"job_{job['mode']}.json"
    jf.write_text(json.dumps(job))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = ROOT  # this checkout's torchtpu (the torch mode imports it)
    r = subprocess.run([LITERT_PY, RUNNER, str(jf)], capture_output=True, text=True, env=env,
                       timeout=timeout, cwd=str(tmp_path))
    assert r.returncode == 0 and "litert_runner: ok" in r.stdout, \
        f"litert_runner failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-6000:]}"
    with np.load(job["result"]) as z:
        arrays = {k: z[k] for k in z.files}
    with open(job["result"] + ".json") as f:
        return arrays, json.load(f)


def _saved(name, tmp_path):
    """Train ``name`` on "tpu" here, export it (torch.export on "tpu", then
    exported_program_to_stablehlo), save it; (case for the runner, CPU reference outputs)."""
    model, args, losses = litert_models.trained(name, device="tpu")
    assert all(p.device.type == "tpu" for p in model.parameters())
    assert all(math.isfinite(v) for v in losses)
    prog = exported_program_to_stablehlo(torch.export.export(model, tuple(a.to("tpu")
                                                                          for a in args)))
    d = str(tmp_path / name)
    prog.save(d)
    inp = str(tmp_path / f"{name}_inputs.npz")
    np.savez(inp, **{k: a.numpy() for k, a in zip(prog.input_names, args)})
    with torch.no_grad():
        ref = model.to("cpu")(*args)
    ref = [r.numpy() for r in (ref if isinstance(ref, tuple) else (ref,))]
    names = LLAMA_OUTPUTS if name == "llama" else prog.output_names[:prog.n_user_outputs]
    case = {"name": name, "artifact": d, "inputs": inp}
    if name == "llama":
        case["output_names"] = LLAMA_OUTPUTS
    return case, dict(zip(names, ref)), model


def _check_float(name, arrays, ref):
    for k, r in ref.items():
        out = arrays[f"{name}/float/out/{k}"]
        assert out.shape == r.shape, (k, out.shape, r.shape)
        torch.testing.assert_close(torch.from_numpy(out), torch.from_numpy(r))


def _check_int8_weights(name, arrays):
    """Every int8 weight: symmetric per-channel, min-max scale, within scale/2 of its float."""
    n = 0
    while f"{name}/w{n}/q" in arrays:
        pre = f"{name}/w{n}/"
        w, q, s, zp = (arrays[pre + k].astype(np.float64) for k in ("float", "q", "scale", "zp"))
        dim = int(arrays[pre + "dim"])
        assert np.all(zp == 0) and np.abs(q).max() <= 127, "weights are symmetric int8"
        wc = np.moveaxis(w, dim, 0).reshape(w.shape[dim], -1)
        qc = np.moveaxis(q, dim, 0).reshape(q.shape[dim], -1)
        assert s.shape == (w.shape[dim],), "one scale per output channel"
        np.testing.assert_allclose(s, np.abs(wc).max(1) / 127, rtol=1e-6)
        err = np.abs(wc - qc * s[:, None])
        assert np.all(err <= s[:, None] / 2 * (1 + 1e-6)), (name, n, (err / s[:, None]).max())
        n += 1
    assert n > 0, f"{name}: no int8 weights in the quantized model"
    return n


def _check_quantized_ops(name, arrays, meta):
    """Each quantized op's output is within the documented bound of its exact float result."""
    worst = 0.0
    for j, op in enumerate(meta[name]["qops"]):
        a = {k: arrays[f"{name}/op{j}/{k}"] for k in ("y", "exact", "x_absmax", "sum_abs_wq",
                                                         "sum_abs_x", "scale", "mag")}
        bound = (a["x_absmax"] / 254 * a["sum_abs_wq"] + a["sum_abs_x"] * a["scale"] / 2
                 + 2.0 ** -20 * a["mag"])
        err = np.abs(a["y"] - a["exact"])
        assert np.all(err <= bound), (name, j, op, float((err / bound).max()))
        worst = max(worst, float((err / bound).max()))
    return worst


def test_mlp_to_litert_from_saved_dir_without_torch(tmp_path):
    """Trained on "tpu", exported, saved; converted by a process that never imports torch
    (float and dynamic int8); both run in the interpreter. With it, a model whose constants
    hold +-inf (stored as +-max float: same outputs)."""
    case, ref, _ = _saved("mlp", tmp_path)
    inf_case, inf_ref, _ = _saved("infnet", tmp_path)
    assert np.isinf(np.load(os.path.join(inf_case["artifact"], "state.npz"))["hi"]).any()
    arrays, meta = _run({"mode": "saved", "cases": [case, inf_case]}, tmp_path, timeout=300)
    assert meta["torch_imported"] is False
    _check_float("infnet", arrays, inf_ref)
    (out,) = inf_ref.values()
    assert (out == 0).any() and np.isfinite(out).all()  # the masked entries
    assert "FULLY_CONNECTED" in meta["mlp"]["ops"], meta["mlp"]["ops"]  # native TFLite ops
    _check_float("mlp", arrays, ref)
    assert _check_int8_weights("mlp", arrays) == 3
    assert meta["mlp"]["qops"] == ["FULLY_CONNECTED"] * 3
    _check_quantized_ops("mlp", arrays, meta)
    (key,) = ref
    assert np.abs(arrays[f"mlp/dynamic_int8/out/{key}"] - ref[key]).max() > 0  # quantized
    assert meta["mlp"]["size_int8"] < meta["mlp"]["size_float"] / 2


@pytest.mark.slow
@pytest.mark.parametrize("name", ["cnn", "llama"])
def test_to_litert_from_saved_dir(name, tmp_path):
    """The CNN and one decode step of a tiny Llama (KV cache in and out), trained on "tpu":
    float within float32 tolerance of PyTorch CPU; int8 weights and quantized ops within the
    documented error."""
    case, ref, _ = _saved(name, tmp_path)
    arrays, meta = _run({"mode": "saved", "cases": [case]}, tmp_path, timeout=600)
    assert meta["torch_imported"] is False
    _check_float(name, arrays, ref)
    _check_int8_weights(name, arrays)
    _check_quantized_ops(name, arrays, meta)
    want = {"cnn": {"CONV_2D", "FULLY_CONNECTED"},
            "llama": {"FULLY_CONNECTED", "BATCH_MATMUL", "SOFTMAX", "RSQRT"}}[name]
    assert want <= set(meta[name]["ops"]), meta[name]["ops"]
    if name == "cnn":
        assert sorted(set(meta[name]["qops"])) == ["CONV_2D", "FULLY_CONNECTED"]
    else:  # q/k/v/o, gate/up/down of 2 layers and the LM head
        assert meta[name]["qops"] == ["FULLY_CONNECTED"] * 15


def test_to_litert_of_an_exported_program(tmp_path):
    """``to_litert(torch.export.export(m, args), path)`` (was: TypeError) writes the same model
    as ``to_litert(exported_program_to_stablehlo(ep), path)``: the same flatbuffer bytes, the
    same outputs in the interpreter, those of PyTorch CPU; for a model trained on "tpu" and for
    a CPU model exported with CPU inputs."""
    arrays, meta = _run({"mode": "exported"}, tmp_path, timeout=300)
    for dev in ("tpu", "cpu"):
        assert meta[dev]["same_bytes"], meta
        assert meta[dev]["ops"] and "FULLY_CONNECTED" in meta[dev]["ops"], meta
        ref = torch.from_numpy(arrays[f"{dev}/ref"])
        for way in ("ep", "stablehlo"):
            torch.testing.assert_close(torch.from_numpy(arrays[f"{dev}/{way}"]), ref)
        assert torch.equal(torch.from_numpy(arrays[f"{dev}/ep"]),
                           torch.from_numpy(arrays[f"{dev}/stablehlo"]))


def _check_torch_mode(name, arrays, meta):
    assert meta["params_device"] == "tpu"
    n = sum(1 for k in arrays if k.startswith("ref/out"))
    assert n >= 1
    for way in ("export", "litert_torch"):
        for i in range(n):
            out, r = arrays[f"{way}/out{i}"], arrays[f"ref/out{i}"]
            assert out.shape == r.shape, (way, i, out.shape, r.shape)
            torch.testing.assert_close(torch.from_numpy(out), torch.from_numpy(r),
                                       msg=lambda m: f"{way} output {i}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mlp", "cnn", "llama"])
def test_trained_on_tpu_converts_two_ways(name, tmp_path):
    """In one process of the LiteRT environment: trained on "tpu", then
    to_litert(exported_program_to_stablehlo(ep)) of the "tpu" model, and litert_torch.convert
    of the model still on "tpu" (was: wrong weights in 3 of 4 CNN conversions); each matches the model on PyTorch CPU."""
    job = {"mode": "torch", "model": name}
    if name == "llama":
        job["output_names"] = LLAMA_OUTPUTS
    arrays, meta = _run(job, tmp_path, timeout=600)
    _check_torch_mode(name, arrays, meta)


class _BoolBuffer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("keep", torch.tensor([True, False, True, False]))

    def forward(self, x):
        return torch.where(self.keep, self.lin(x), -x)


def _saved_module(name, model, args, tmp_path, **options):
    from torchtpu.export import StableHLOExportOptions

    prog = exported_program_to_stablehlo(
        torch.export.export(model, tuple(a.to("tpu") for a in args)),
        StableHLOExportOptions(**options) if options else None)
    d = str(tmp_path / name)
    prog.save(d)
    inp = str(tmp_path / f"{name}_inputs.npz")
    np.savez(inp, **{k: a.float().numpy() for k, a in zip(prog.input_names, args)})
    return {"name": name, "artifact": d, "inputs": inp, "float_only": True}, prog


def test_to_litert_state_kinds_platforms_and_refusals(tmp_path):
    """A bool buffer (was baked in as one splat value: wrong outputs), an export lowered for
    two platforms (the platform index, i64 under x64, bound to CPU's), a BatchNorm exported in
    training mode (its buffer updates are dropped with a warning; outputs use the batch's
    statistics, as PyTorch's do), and a bfloat16 program (no LiteRT kernels: a clear error)."""
    torch.manual_seed(0)
    x = torch.randn(3, 4)
    boolnet = _BoolBuffer().eval()
    bool_ref = boolnet(x).detach().numpy()
    bn = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)).train()
    bn_ref = copy.deepcopy(bn)(x).detach().numpy()  # with the batch's statistics
    bf = torch.nn.Sequential(torch.nn.Linear(4, 3)).to(torch.bfloat16).eval()
    cases = [
        _saved_module("boolnet", boolnet.to("tpu"), (x,), tmp_path)[0],
        _saved_module("twoplatforms", boolnet.to("tpu"), (x,), tmp_path,
                      platforms=["cpu", "cuda"])[0],
        _saved_module("bn_train", bn.to("tpu"), (x,), tmp_path)[0],
        _saved_module("bf16", bf.to("tpu"), (x.to(torch.bfloat16),), tmp_path)[0],
    ]
    arrays, meta = _run({"mode": "saved", "cases": cases}, tmp_path, timeout=300)
    assert meta["torch_imported"] is False
    for name, ref in [("boolnet", bool_ref), ("twoplatforms", bool_ref), ("bn_train", bn_ref)]:
        assert "error" not in meta[name], meta[name]
        (out,) = [v for k, v in arrays.items() if k.startswith(f"{name}/float/out/")]
        torch.testing.assert_close(torch.from_numpy(out), torch.from_numpy(ref))
    assert meta["boolnet"]["warnings"] == []
    (w,) = meta["bn_train"]["warnings"]
    assert "updates buffers (1.running_mean, 1.running_var, 1.num_batches_tracked)" in w
    assert meta["bf16"]["error"].startswith("ExportError: torch.tpu.export.to_litert: "
                                            "litert-converter could not convert the program "
                                            "(LiteRT's kernels have no bfloat16"), meta["bf16"]


def test_errors_without_converter_and_bad_arguments(tmp_path, monkeypatch):
    """Clear errors: the missing extra (an ImportError naming the install), a bad quantize mode,
    a directory that is not a saved export, an object that is not a program."""
    import builtins

    real_import = builtins.__import__

    def no_litert(name, *a, **k):
        if name.startswith(("litert_converter", "ai_edge_quantizer")):
            raise ModuleNotFoundError(f"No module named '{name}'")
        return real_import(name, *a, **k)

    model = torch.nn.Linear(4, 2).to("tpu").eval()
    prog = exported_program_to_stablehlo(torch.export.export(model, (torch.randn(1, 4,
                                                                                  device="tpu"),)))
    monkeypatch.setattr(builtins, "__import__", no_litert)
    with pytest.raises(ImportError, match=r"torchtpu\[litert\]"):
        to_litert(prog, tmp_path / "m.tflite")
    monkeypatch.setattr(builtins, "__import__", real_import)
    with pytest.raises(ValueError, match="quantize must be None or one of"):
        to_litert(prog, tmp_path / "m.tflite", quantize="int4")
    with pytest.raises(FileNotFoundError, match="not a saved torch.tpu.export program"):
        to_litert(str(tmp_path), tmp_path / "m.tflite")
    with pytest.raises(TypeError, match="to_litert expects a torch.export ExportedProgram, a "
                       "torch.tpu.export program"):
        to_litert(model, tmp_path / "m.tflite")
    assert not (tmp_path / "m.tflite").exists()
