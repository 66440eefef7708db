"""Reading a saved ``torch.tpu.export`` directory with JAX and numpy alone (no torch).

``StableHLOGraphModule.save`` (stablehlo.py) writes the layout; ``read(d)`` returns its parts,
for ``stablehlo.load`` and for the LiteRT converter (litert.py), which must not import torch.
This module imports nothing from torch or the rest of torchtpu.
"""
from __future__ import annotations

import json
import os

import numpy as np

FORMAT = "torchtpu.export/1"


class ExportError(RuntimeError):
    """The program cannot become a self-contained artifact (an op without a lowering, a
    construct the target format cannot hold...)."""


def read(directory):
    """``(exported, meta, state)`` of a saved export: the ``jax.export.Exported``, the parsed
    ``meta.json`` and the state arrays (numpy, in ``meta["state_names"]`` order, with the
    function's dtypes: bfloat16/float8 restored from the bits ``save`` stores)."""
    import jax

    files = [os.path.join(directory, f) for f in ("program.jaxexport", "meta.json", "state.npz")]
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        raise FileNotFoundError(f"{directory} is not a saved torch.tpu.export program (missing "
                                f"{', '.join(os.path.basename(f) for f in missing)})")
    with open(files[0], "rb") as f:
        exported = jax.export.deserialize(bytearray(f.read()))
    with open(files[1]) as f:
        meta = json.load(f)
    with np.load(files[2]) as z:
        state = [z[n].view(a.dtype) for n, a in zip(meta["state_names"], exported.in_avals)]
    return exported, meta, state
