"""The runtime layer: PJRT devices, buffers, programs and their caches, metrics (the bottom layer)."""
