"""The eager layer: the executors that run aten ops on "tpu" one at a time (Strict, Fused, Async)."""
