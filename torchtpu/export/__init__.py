"""``torch.tpu.export``: ``torch.export`` programs as StableHLO artifacts (see stablehlo.py),
and those as LiteRT models (litert.py, with the optional litert-converter)."""
from .litert import to_litert  # noqa: F401
from .stablehlo import (  # noqa: F401
    ExportError,
    StableHLOExportOptions,
    StableHLOGraphModule,
    export_function,
    exported_program_to_stablehlo,
    load,
)

__all__ = ["ExportError", "StableHLOExportOptions", "StableHLOGraphModule", "export_function",
           "exported_program_to_stablehlo", "load", "to_litert"]
