"""``torch.tpu.export`` programs -> LiteRT flatbuffers (``.tflite``) with litert-converter.

``to_litert(program_or_saved_dir, path, quantize=None)`` takes a ``torch.export``
``ExportedProgram`` (lowered first with ``exported_program_to_stablehlo``), or the StableHLO
that ``exported_program_to_stablehlo`` made (a ``StableHLOGraphModule``, or the directory its
``save`` wrote), parses it into litert-converter's MLIR context (the StableHLO portable artifact
``jax.export`` serializes), makes the program's state (parameters, buffers) constants of the
function, and runs the converter's StableHLO -> TFLite passes: the result is a model of native
TFLite ops (FULLY_CONNECTED, CONV_2D, ...) with one signature, ``serving_default``, whose inputs
and outputs carry the exported program's names. ``quantize="dynamic_int8"`` then applies
ai-edge-quantizer's dynamic range recipe (``dynamic_wi8_afp32``: int8 per-channel symmetric
weights, float32 activations quantized to int8 on the fly by the kernels).

This module imports neither torch nor the rest of torchtpu: given a saved directory nothing here
needs torch, and the file also runs as a script where torch is absent
(``python litert.py ARTIFACT_DIR OUT.tflite [--quantize dynamic_int8]``). The converter is an
optional extra (``pip install 'torchtpu[litert]'``, pinned: its Python API is marked unstable
upstream).
"""
from __future__ import annotations

import os
import warnings

try:
    from .artifact import ExportError, read as _read_artifact
except ImportError:  # run as a script, outside the package
    from artifact import ExportError, read as _read_artifact  # type: ignore[no-redef]

__all__ = ["to_litert", "QUANTIZE_MODES"]

# quantize= modes -> ai-edge-quantizer recipe functions (ai_edge_quantizer.recipe)
QUANTIZE_MODES = {"dynamic_int8": "dynamic_wi8_afp32"}
# the litert-converter versions this module was tested with (its Python API is unstable)
TESTED_CONVERTER = ("0.5.",)
_INSTALL = "pip install 'torchtpu[litert]'"


def _converter():
    try:
        import litert_converter
        from litert_converter.mlir import ir, passmanager
        from litert_converter.mlir._mlir_libs import converter_api_ext
        from litert_converter.mlir.dialects import stablehlo
    except ImportError as e:
        raise ImportError(
            f"torch.tpu.export.to_litert needs litert-converter, which is not installed ({e}); "
            f"install the LiteRT extra: {_INSTALL}") from e
    version = getattr(litert_converter, "__version__", "?")
    if not version.startswith(TESTED_CONVERTER):
        warnings.warn(f"torch.tpu.export.to_litert was tested with litert-converter "
                      f"{'/'.join(v + '*' for v in TESTED_CONVERTER)}, not {version} (its Python "
                      "API is unstable upstream)", stacklevel=3)
    return ir, passmanager, converter_api_ext, stablehlo


def _parts(src):
    """(exported, meta, state arrays) of a StableHLOGraphModule or a saved directory."""
    if isinstance(src, (str, os.PathLike)):
        return _read_artifact(os.fspath(src))
    if _is_exported_program(src):
        # a torch.export program: lowered here as exported_program_to_stablehlo would (the
        # caller holds torch already; a saved directory or a StableHLO program never needs it)
        from .stablehlo import exported_program_to_stablehlo

        src = exported_program_to_stablehlo(src)
    if not all(hasattr(src, a) for a in ("exported", "state", "state_names", "input_names",
                                         "output_names", "n_user_outputs")):
        raise TypeError("to_litert expects a torch.export ExportedProgram, a torch.tpu.export "
                        "program (exported_program_to_stablehlo's result) or the directory its "
                        f"save() wrote, got {type(src).__name__}")
    import jax
    import numpy as np

    state = [np.asarray(jax.device_get(a)) for a in src.state]
    meta = {"state_names": src.state_names, "input_names": src.input_names,
            "output_names": src.output_names, "n_user_outputs": src.n_user_outputs}
    return src.exported, meta, state


def _is_exported_program(src) -> bool:
    """``src`` is a ``torch.export.ExportedProgram``, checked without importing torch (a
    program object exists only where torch was imported)."""
    import sys

    torch = sys.modules.get("torch")
    return torch is not None and isinstance(src, torch.export.ExportedProgram)


def _dense_attr(ir, a, mlir_type):
    import numpy as np

    a = np.ascontiguousarray(a)
    if type(a.dtype).__module__.startswith("ml_dtypes"):
        # bfloat16/float8: numpy's buffer protocol has no format for them; their bits are laid
        # out as MLIR expects, so pass them as same-width unsigned ints with the typed shape
        a = a.view(np.dtype(f"uint{a.dtype.itemsize * 8}"))
    return ir.DenseElementsAttr.get(a, type=mlir_type)


def _clamp_inf(a):
    """+-inf -> the largest finite value of the dtype (numpy), for the state: what the
    converter's CanonicalizeBoundaryValuePass does to constants, and what litert-torch does
    before turning that pass off (it walks every element of every constant in MLIR: 18 of 28 s
    converting a 78M-parameter Llama)."""
    import numpy as np

    if a.dtype.kind != "f" and not type(a.dtype).__module__.startswith("ml_dtypes"):
        return a
    try:
        inf = np.isinf(a)
    except TypeError:  # an ml_dtypes integer type
        return a
    if not inf.any():
        return a
    import ml_dtypes

    fi = ml_dtypes.finfo(a.dtype)
    return np.where(inf, np.where(a > 0, fi.max, fi.min), a).astype(a.dtype)


def _main_func(module):
    for op in module.body.operations:
        if op.operation.name == "func.func" and str(op.attributes["sym_name"]) == '"main"':
            return op
    raise ExportError("torch.tpu.export.to_litert: the program has no public @main function")


def _bind_constants(ir, stablehlo, main, consts, results_kept):
    """Replace ``main``'s leading arguments by constants (``consts``: index -> numpy array) and
    keep only the results at ``results_kept``."""
    block = main.regions[0].blocks[0]
    args = list(block.arguments)
    ip = ir.InsertionPoint.at_block_begin(block)
    for i, a in consts.items():
        c = stablehlo.ConstantOp(_dense_attr(ir, _clamp_inf(a), args[i].type), ip=ip)
        args[i].replace_all_uses_with(c.result)
    for i in sorted(consts, reverse=True):
        block.erase_argument(i)
    ftype = ir.FunctionType(ir.TypeAttr(main.attributes["function_type"]).value)
    inputs = [t for i, t in enumerate(ftype.inputs) if i not in consts]
    results = [t for i, t in enumerate(ftype.results) if i in results_kept]
    main.attributes["function_type"] = ir.TypeAttr.get(ir.FunctionType.get(inputs, results))
    if "arg_attrs" in main.attributes:
        attrs = list(ir.ArrayAttr(main.attributes["arg_attrs"]))
        main.attributes["arg_attrs"] = ir.ArrayAttr.get(
            [a for i, a in enumerate(attrs) if i not in consts])
    if "res_attrs" in main.attributes:
        attrs = list(ir.ArrayAttr(main.attributes["res_attrs"]))
        main.attributes["res_attrs"] = ir.ArrayAttr.get(
            [a for i, a in enumerate(attrs) if i in results_kept])
    if len(results) != len(ftype.results):
        from litert_converter.mlir.dialects import func

        ret = block.operations[len(block.operations) - 1]
        operands = [v for i, v in enumerate(ret.operands) if i in results_kept]
        func.ReturnOp(operands, ip=ir.InsertionPoint.at_block_terminator(block))
        ret.erase()


def _convert(exported, meta, state, *, enable_x64, signature_name, input_names, output_names,
             path=None):
    """The float .tflite flatbuffer: written to ``path``, else returned (bytes). ``state`` (a
    list) is consumed: emptied once the constants hold it, to keep one copy of the weights."""
    ir, passmanager, cx, stablehlo = _converter()
    n_state = len(meta["state_names"])
    platforms = tuple(exported.platforms)
    lead = 0
    if len(platforms) > 1:
        # a multi-platform export takes the platform index first: bind it to the CPU lowering
        if "cpu" not in platforms:
            raise ExportError(
                "torch.tpu.export.to_litert: the program was lowered for "
                f"{', '.join(platforms)}; LiteRT needs the CPU lowering (export with "
                "StableHLOExportOptions(platforms=[..., 'cpu']))")
        lead = 1
    if exported.ordered_effects or exported.unordered_effects:
        raise ExportError("torch.tpu.export.to_litert: programs with side effects cannot be "
                          "converted")
    n_out = len(exported.out_avals)
    n_user = meta["n_user_outputs"]
    names = list(meta["output_names"])
    kept = list(range(n_user))
    dropped = []
    for i in range(n_user, n_out):
        # an input the model writes in place comes back as an output (LiteRT inputs are
        # read-only); a buffer's new value has nowhere to go: the buffer is a constant
        (kept if names[i].startswith("user_input_mutation:") else dropped).append(i)
    if dropped:
        warnings.warn("torch.tpu.export.to_litert: the program updates buffers ("
                      + ", ".join(names[i].partition(":")[2] for i in dropped)
                      + "); a LiteRT model holds them as constants, so the updates are dropped "
                      "(export the model in eval mode, or pass such state as inputs)",
                      stacklevel=3)
    in_names = list(input_names) if input_names is not None else list(meta["input_names"])
    out_names = list(output_names) if output_names is not None else [names[i] for i in kept]
    if len(in_names) != len(meta["input_names"]):
        raise ValueError(f"input_names: expected {len(meta['input_names'])} names, "
                         f"got {len(in_names)}")
    if len(out_names) != len(kept):
        raise ValueError(f"output_names: expected {len(kept)} names, got {len(out_names)}")

    ctx = ir.Context()
    cx.prepare_mlir_context(ctx)
    with ctx, ir.Location.unknown():
        try:
            module = stablehlo.deserialize_portable_artifact(
                ctx, bytes(exported.mlir_module_serialized))
        except Exception as e:  # noqa: BLE001
            raise ExportError("torch.tpu.export.to_litert: litert-converter cannot read the "
                              f"program's StableHLO: {e}") from e
        main = _main_func(module)
        # jax.export drops the arguments the function never reads: @main takes the platform
        # index (several platforms), then the flat arguments at module_kept_var_idx
        kept_args = sorted(exported.module_kept_var_idx)
        n_args = len(main.regions[0].blocks[0].arguments)
        if n_args != lead + len(kept_args):
            raise ExportError(f"torch.tpu.export.to_litert: @main takes {n_args} arguments, "
                              f"expected {lead + len(kept_args)} (platform index, state, "
                              "inputs)")
        consts = {lead + j: state[i] for j, i in enumerate(kept_args) if i < n_state}
        if lead:  # tensor<i32>, or tensor<i64> under jax_enable_x64
            import numpy as np

            arg0 = main.regions[0].blocks[0].arguments[0]
            width = ir.IntegerType(ir.RankedTensorType(arg0.type).element_type).width
            consts[0] = np.asarray(platforms.index("cpu"), f"int{width}")
        unused = [meta["input_names"][i - n_state] for i in range(n_state, len(exported.in_avals))
                  if i not in exported.module_kept_var_idx]
        if unused:
            # the LiteRT signature takes only what the program reads
            in_names = [n for n in in_names if n not in unused] if input_names is None else \
                [n for n, m in zip(in_names, meta["input_names"]) if m not in unused]
        _bind_constants(ir, stablehlo, main, consts, set(kept))
        consts.clear()
        state.clear()
        try:
            module.operation.verify()
            cx.set_signature(module.operation, signature_name=signature_name,
                             input_names=in_names, output_names=out_names)
            config = cx.ConvertToTFLConfig()
            config.model_origin_framework = "JAX"
            config.enable_x64 = enable_x64
            # +-inf in the state became +-max float above (_clamp_inf), as litert-torch does
            # with its constants; the program's own scalars stay (reduction inits that the
            # legalization to REDUCE_MAX matches, -inf masks)
            config.canonicalizing_inf_as_min_max_float = False
            cx.run_convert_to_tfl_passes(module, passmanager.PassManager(), config)
            if path is not None:
                cx.export_flatbuffer_to_file(module.operation, path)
                return None
            return cx.export_flatbuffer_to_bytes(module.operation)
        except Exception as e:  # noqa: BLE001  (MLIRError, RuntimeError: the diagnostics)
            hint = ""
            if any(str(a.dtype) == "bfloat16" for a in exported.in_avals):
                hint = (" (LiteRT's kernels have no bfloat16: export the model in float32, "
                        "e.g. model.float())")
            raise ExportError("torch.tpu.export.to_litert: litert-converter could not convert "
                              f"the program{hint}: {e}") from e


def _quantize(model: bytes, mode: str) -> bytes:
    try:
        from ai_edge_quantizer import quantizer, recipe
    except ImportError as e:
        raise ImportError(f"to_litert(quantize={mode!r}) needs ai-edge-quantizer, which is not "
                          f"installed ({e}); install the LiteRT extra: {_INSTALL}") from e
    q = quantizer.Quantizer(bytearray(model), getattr(recipe, QUANTIZE_MODES[mode])())
    return bytes(q.quantize(enable_progress_bar=False, enable_progress_report=False).quantized_model)


def to_litert(program_or_saved_dir, path, quantize=None, *, enable_x64=False,
              signature_name="serving_default", input_names=None, output_names=None):
    """Convert a ``torch.tpu.export`` program to a LiteRT model and write it to ``path``.

    ``program_or_saved_dir``: a ``torch.export.ExportedProgram`` (``torch.export.export(m,
    args)``; lowered with ``exported_program_to_stablehlo``, the same program as that path),
    ``exported_program_to_stablehlo``'s result, or the directory its ``save`` wrote (read with
    JAX and numpy: no torch). The state becomes constants of the
    model; its one signature (``signature_name``) takes the program's tensor inputs and returns
    its outputs (then the new values of inputs the model writes in place), named as in the
    export unless ``input_names``/``output_names`` are given.
    ``quantize``: None (float) or ``"dynamic_int8"`` (ai-edge-quantizer's dynamic range
    recipe: int8 per-channel symmetric weights, activations quantized to int8 at run time).
    ``enable_x64``: keep 64-bit tensors (int64 token ids, float64); by default LiteRT's
    converter narrows them to 32 bits (inputs included), as litert-torch does.
    Returns ``path``.
    """
    if quantize is not None and quantize not in QUANTIZE_MODES:
        raise ValueError(f"quantize must be None or one of {sorted(QUANTIZE_MODES)}, "
                         f"got {quantize!r}")
    exported, meta, state = _parts(program_or_saved_dir)
    path = os.fspath(path)
    model = _convert(exported, meta, state, enable_x64=enable_x64,
                     signature_name=signature_name, input_names=input_names,
                     output_names=output_names, path=None if quantize else path)
    if quantize is not None:
        model = _quantize(model, quantize)
        with open(path, "wb") as f:
            f.write(model)
    return path


def main(argv=None):
    import argparse

    p = argparse.ArgumentParser(description="Convert a saved torch.tpu.export program to a "
                                "LiteRT model (.tflite)")
    p.add_argument("artifact", help="directory written by StableHLOGraphModule.save")
    p.add_argument("output", help="the .tflite file to write")
    p.add_argument("--quantize", choices=sorted(QUANTIZE_MODES))
    p.add_argument("--enable-x64", action="store_true",
                   help="keep int64/float64 tensors (default: narrowed to 32 bits)")
    a = p.parse_args(argv)
    to_litert(a.artifact, a.output, quantize=a.quantize, enable_x64=a.enable_x64)
    print(a.output)


if __name__ == "__main__":
    main()
