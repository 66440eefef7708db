"""tests/test_litert.py's worker, run by the LiteRT environment's python (``make venv-litert``).

``python litert_runner.py JOB.json``; the job's ``mode``:
- ``"saved"``: converts saved ``torch.tpu.export`` directories with ``to_litert`` (float and
  dynamic int8) in a process that never imports torch (torchtpu/export/litert.py is imported
  from its folder, not through the torchtpu package; asserted at the end), runs both models in
  the ``ai-edge-litert`` interpreter, and gathers what the int8 checks need: every int8 weight
  with its float original, and every quantized op's input, output and exact float result
  (builtin kernels, intermediate tensors kept).
- ``"torch"``: trains a model of litert_models.py on "tpu" in this process and converts it
  two ways: ``to_litert(exported_program_to_stablehlo(ep))`` (from the "tpu" model) and
  ``litert_torch.convert`` of the model still on "tpu"; runs each in the interpreter.
- ``"exported"``: ``to_litert`` of a ``torch.export.ExportedProgram`` against ``to_litert`` of
  its ``exported_program_to_stablehlo`` (bytes and outputs), for a "tpu" and a CPU model.
Results go to ``JOB["result"]`` (npz); the test compares them with PyTorch on CPU.
"""
from __future__ import annotations

import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _quiet():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def run_signature(path, inputs, resolver=None):
    """Outputs (dict) of the model's one signature for ``inputs`` (name -> array, cast to the
    signature's dtypes); with ``resolver`` set, builtin kernels and all tensors kept (the
    interpreter is returned too)."""
    from ai_edge_litert.interpreter import Interpreter, OpResolverType

    kw = {}
    if resolver:
        kw = dict(experimental_op_resolver_type=OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES,
                  experimental_preserve_all_tensors=True)
    it = Interpreter(model_path=path, **kw)
    run = it.get_signature_runner()
    det = run.get_input_details()
    assert sorted(det) == sorted(inputs), (sorted(det), sorted(inputs))
    out = run(**{k: np.asarray(v).astype(det[k]["dtype"]) for k, v in inputs.items()})
    return (out, it) if resolver else out


def _model(path):
    from ai_edge_litert import schema_py_generated as schema

    with open(path, "rb") as f:
        return schema.ModelT.InitFromPackedBuf(bytearray(f.read()), 0)


def _const(model, t, dtype):
    data = model.buffers[t.buffer].data
    return np.frombuffer(bytes(bytearray(data)), dtype).reshape(t.shape)


def _conv_patches(x, kh, kw, stride, dil, same):
    """NHWC x -> [N, OH, OW, KH*KW*C] windows (TFLite's SAME/VALID padding)."""
    n, h, w, c = x.shape
    eh, ew = (kh - 1) * dil[0] + 1, (kw - 1) * dil[1] + 1
    if same:
        oh, ow = -(-h // stride[0]), -(-w // stride[1])
        ph = max((oh - 1) * stride[0] + eh - h, 0)
        pw = max((ow - 1) * stride[1] + ew - w, 0)
        x = np.pad(x, ((0, 0), (ph // 2, ph - ph // 2), (pw // 2, pw - pw // 2), (0, 0)))
    else:
        oh, ow = (h - eh) // stride[0] + 1, (w - ew) // stride[1] + 1
    cols = [x[:, i * dil[0]: i * dil[0] + (oh - 1) * stride[0] + 1: stride[0],
              j * dil[1]: j * dil[1] + (ow - 1) * stride[1] + 1: stride[1], :]
            for i in range(kh) for j in range(kw)]
    return np.concatenate(cols, axis=-1)


def quantized_ops(float_path, int8_path, inputs):
    """For every op of the int8 model with an int8 weight (FULLY_CONNECTED, CONV_2D): its
    actual float input x and output y (builtin kernels), the exact float64 result with the
    float model's weight, and the terms of the documented error bound."""
    from ai_edge_litert import schema_py_generated as schema

    fm, qm = _model(float_path), _model(int8_path)
    fs, qs = fm.subgraphs[0], qm.subgraphs[0]
    _, it = run_signature(int8_path, inputs, resolver=True)
    ops = []
    for op in qs.operators:
        code = qm.operatorCodes[op.opcodeIndex]
        code = max(code.builtinCode, code.deprecatedBuiltinCode)
        if len(op.inputs) < 2 or qs.tensors[op.inputs[1]].type != schema.TensorType.INT8:
            continue
        wt = qs.tensors[op.inputs[1]]
        assert fs.tensors[op.inputs[1]].name == wt.name  # the quantizer keeps tensor indices
        w = _const(fm, fs.tensors[op.inputs[1]], np.float32).astype(np.float64)
        q = _const(qm, wt, np.int8).astype(np.float64)
        s = np.asarray(wt.quantization.scale, np.float64)
        wq = q * s.reshape((-1,) + (1,) * (q.ndim - 1))
        x = it.get_tensor(op.inputs[0]).astype(np.float64)
        y = it.get_tensor(op.outputs[0]).astype(np.float64)
        b = it.get_tensor(op.inputs[2]).astype(np.float64) if len(op.inputs) > 2 and \
            op.inputs[2] >= 0 else 0.0
        o = op.builtinOptions
        if code == schema.BuiltinOperator.FULLY_CONNECTED:
            xs = x.reshape(-1, w.shape[1])
            exact = xs @ w.T + b
            sum_abs_wq = np.abs(wq).sum(1)  # [out]
            sum_abs_x = np.abs(xs).sum(1, keepdims=True)  # [rows, 1]
            mag = np.abs(xs) @ np.abs(wq).T + np.abs(b)
        elif code == schema.BuiltinOperator.CONV_2D:
            same = o.padding == schema.Padding.SAME
            p = _conv_patches(x, w.shape[1], w.shape[2], (o.strideH, o.strideW),
                              (o.dilationHFactor, o.dilationWFactor), same)
            wf = w.reshape(w.shape[0], -1)
            exact = p @ wf.T + b
            sum_abs_wq = np.abs(wq).reshape(w.shape[0], -1).sum(1)
            sum_abs_x = np.abs(p).sum(-1, keepdims=True)
            mag = np.abs(p) @ np.abs(wq).reshape(w.shape[0], -1).T + np.abs(b)
        else:
            raise AssertionError(f"unexpected quantized op {code}")
        act = o.fusedActivationFunction
        if act == schema.ActivationFunctionType.RELU:
            exact = np.maximum(exact, 0)
        elif act == schema.ActivationFunctionType.RELU6:
            exact = np.clip(exact, 0, 6)
        else:
            assert act == schema.ActivationFunctionType.NONE, act
        ops.append({"op": "FULLY_CONNECTED" if code == schema.BuiltinOperator.FULLY_CONNECTED
                    else "CONV_2D", "y": y.reshape(exact.shape), "exact": exact,
                    "x_absmax": np.abs(x).max(), "sum_abs_wq": sum_abs_wq,
                    "sum_abs_x": sum_abs_x, "scale": s, "mag": mag})
    return ops


def int8_weights(float_path, int8_path):
    """(name, float weight, int8 values, scales, zero points, quantized dimension) of every
    int8 tensor of the quantized model."""
    from ai_edge_litert import schema_py_generated as schema

    fm, qm = _model(float_path), _model(int8_path)
    out = []
    for i, t in enumerate(qm.subgraphs[0].tensors):
        data = qm.buffers[t.buffer].data if t.buffer > 0 else None
        if t.type != schema.TensorType.INT8 or data is None or not len(data):
            continue
        ft = fm.subgraphs[0].tensors[i]
        assert ft.name == t.name
        out.append((t.name, _const(fm, ft, np.float32), _const(qm, t, np.int8),
                    np.asarray(t.quantization.scale, np.float32),
                    np.asarray(t.quantization.zeroPoint, np.int64),
                    t.quantization.quantizedDimension))
    return out


def _save(path, arrays, meta):
    np.savez(path, **arrays)
    with open(path + ".json", "w") as f:
        json.dump(meta, f)


def saved_mode(job):
    sys.path.insert(0, os.path.join(ROOT, "torchtpu", "export"))
    import litert  # noqa: E402  (the module file, not the torchtpu package: no torch)

    arrays, meta = {}, {}
    for case in job["cases"]:
        name, d = case["name"], case["artifact"]
        with np.load(case["inputs"]) as z:
            inputs = {k: z[k] for k in z.files}
        paths = {}
        if case.get("float_only"):  # conversions checked for warnings, errors and outputs
            import warnings

            p = os.path.join(job["workdir"], f"{name}.tflite")
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    litert.to_litert(d, p)
                except Exception as e:  # noqa: BLE001
                    meta[name] = {"error": f"{type(e).__name__}: {e}"}
                    continue
            meta[name] = {"warnings": [str(w.message) for w in caught]}
            for k, v in run_signature(p, inputs).items():
                arrays[f"{name}/float/out/{k}"] = v
            continue
        for q in (None, "dynamic_int8"):
            p = os.path.join(job["workdir"], f"{name}{'_int8' if q else ''}.tflite")
            litert.to_litert(d, p, quantize=q, output_names=case.get("output_names"))
            paths[q] = p
            out = run_signature(p, inputs)
            for k, v in out.items():
                arrays[f"{name}/{q or 'float'}/out/{k}"] = v
        meta[name] = {"size_float": os.path.getsize(paths[None]),
                      "size_int8": os.path.getsize(paths["dynamic_int8"]),
                      "ops": sorted({o["op_name"] for o in _op_details(paths[None])})}
        for j, (tname, w, q, s, zp, dim) in enumerate(int8_weights(paths[None],
                                                                   paths["dynamic_int8"])):
            pre = f"{name}/w{j}/"
            arrays.update({pre + "float": w, pre + "q": q, pre + "scale": s, pre + "zp": zp,
                           pre + "dim": np.asarray(dim)})
        for j, o in enumerate(quantized_ops(paths[None], paths["dynamic_int8"], inputs)):
            for k, v in o.items():
                if k != "op":
                    arrays[f"{name}/op{j}/{k}"] = np.asarray(v)
            meta[name].setdefault("qops", []).append(o["op"])
    meta["torch_imported"] = "torch" in sys.modules
    _save(job["result"], arrays, meta)


def _op_details(path):
    from ai_edge_litert.interpreter import Interpreter

    it = Interpreter(model_path=path)
    return it._get_ops_details()


def torch_mode(job):
    import torch

    import litert_models
    import litert_torch
    import torchtpu  # noqa: F401
    from torchtpu.export import exported_program_to_stablehlo, to_litert

    name = job["model"]
    model, args, losses = litert_models.trained(name, device="tpu")
    assert next(model.parameters()).device.type == "tpu"
    tpu_args = tuple(a.to("tpu") for a in args)
    arrays = {f"in{i}": a.numpy() for i, a in enumerate(args)}
    meta = {"losses": losses, "params_device": next(model.parameters()).device.type}
    # 1. torch.tpu.export -> to_litert, in this process, from the program object
    prog = exported_program_to_stablehlo(torch.export.export(model, tpu_args))
    p = os.path.join(job["workdir"], f"{name}_export.tflite")
    to_litert(prog, p, output_names=job.get("output_names"))
    feeds = dict(zip(prog.input_names, (a.numpy() for a in args)))
    names = job.get("output_names") or prog.output_names[:prog.n_user_outputs]
    out = run_signature(p, feeds)
    for i, k in enumerate(names):
        arrays[f"export/out{i}"] = out[k]
    # 2. litert_torch.convert of the model still on "tpu", with "tpu" inputs (litert-torch
    # 0.10.0 baked one parameter's values in for another's there: integrations/litert_torch.py
    # hands it a CPU copy); the user's model stays on "tpu"
    edge = litert_torch.convert(model, tpu_args)
    assert next(model.parameters()).device.type == "tpu"
    # its inputs are 32-bit as the warning it logs says (enable_x64=False, as to_litert's)
    res = edge(*[a.numpy().astype(np.int32) if a.dtype == torch.int64 else a.numpy()
                 for a in args])
    res = res if isinstance(res, (tuple, list)) else [res]
    for i, r in enumerate(res):
        arrays[f"litert_torch/out{i}"] = np.asarray(r)
    path = os.path.join(job["workdir"], f"{name}_litert_torch.tflite")
    edge.export(path)
    meta["litert_torch_ops"] = sorted({o["op_name"] for o in _op_details(path)})
    # the reference: the trained model on PyTorch CPU
    with torch.no_grad():
        ref = model.to("cpu")(*args)
    ref = ref if isinstance(ref, tuple) else (ref,)
    for i, r in enumerate(ref):
        arrays[f"ref/out{i}"] = r.numpy()
    _save(job["result"], arrays, meta)


def exported_mode(job):
    """``to_litert`` of a ``torch.export.ExportedProgram`` against ``to_litert`` of its
    ``exported_program_to_stablehlo``: a model trained on "tpu" and a CPU one."""
    import torch

    import litert_models
    import torchtpu  # noqa: F401
    from torchtpu.export import exported_program_to_stablehlo, to_litert

    arrays, meta = {}, {}
    for dev in ("tpu", "cpu"):
        model, args, _ = litert_models.trained("mlp", device=dev, steps=2)
        ep = torch.export.export(model, tuple(a.to(dev) for a in args))
        p_ep = os.path.join(job["workdir"], f"{dev}_ep.tflite")
        p_sh = os.path.join(job["workdir"], f"{dev}_stablehlo.tflite")
        assert to_litert(ep, p_ep) == p_ep
        prog = exported_program_to_stablehlo(ep)
        to_litert(prog, p_sh)
        with open(p_ep, "rb") as f, open(p_sh, "rb") as g:
            same = f.read() == g.read()
        feeds = dict(zip(prog.input_names, (a.numpy() for a in args)))
        (key,) = prog.output_names[:prog.n_user_outputs]
        arrays[f"{dev}/ep"] = run_signature(p_ep, feeds)[key]
        arrays[f"{dev}/stablehlo"] = run_signature(p_sh, feeds)[key]
        with torch.no_grad():
            arrays[f"{dev}/ref"] = model.to("cpu")(*args).numpy()
        meta[dev] = {"same_bytes": same,
                     "ops": sorted({o["op_name"] for o in _op_details(p_ep)})}
    _save(job["result"], arrays, meta)


def main():
    _quiet()
    with open(sys.argv[1]) as f:
        job = json.load(f)
    sys.path.insert(0, HERE)
    {"saved": saved_mode, "torch": torch_mode, "exported": exported_mode}[job["mode"]](job)
    print("litert_runner: ok")


if __name__ == "__main__":
    main()
