from __future__ import annotations
class SingleTraceTrainer:  # placeholder while writing
    pass
