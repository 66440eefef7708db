"""``torch.tpu.export``: ``torch.export`` programs as StableHLO artifacts (see stablehlo.py)."""
from .stablehlo import (  # noqa: F401
    ExportError,
    StableHLOExportOptions,
    StableHLOGraphModule,
    export_function,
    exported_program_to_stablehlo,
    load,
)
