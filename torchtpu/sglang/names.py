"""Names the SGLang platform and its attention backend share (a module of its own: the platform
imports the backend lazily, so the backend cannot import the platform)."""
ATTENTION_BACKEND = "torchtpu"  # torchtpu/sglang/attention.py registers it
