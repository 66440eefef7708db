"""Import transformers / accelerate in one order, then check torchtpu's integration patches.

Run by tests/test_integration_compat.py in a fresh process (the installed release may come
first on PYTHONPATH). ``python integration_probe.py ORDER [--model] [--accelerate]``; prints
"ALL OK" when every check passed. ORDER is one of ORDERS below; orders named ``explicit_*``
expect ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` in the environment.
"""
from __future__ import annotations

import importlib
import inspect
import sys


def _imp(*names):
    for n in names:
        importlib.import_module(n)


ORDERS = {
    # the torch autoload runs while transformers.generation.utils is half-initialised
    "submodule_first": lambda: _imp("transformers.generation.utils"),
    "cb_first": lambda: _imp("transformers.generation.continuous_batching"),
    "transformers_first": lambda: _imp("transformers", "torch"),
    "model_first": lambda: exec("from transformers import LlamaForCausalLM"),
    "torch_first": lambda: _imp("torch", "transformers"),
    "accelerate_first": lambda: _imp("accelerate.state", "transformers"),
    # TORCH_DEVICE_BACKEND_AUTOLOAD=0: torchtpu imported explicitly, after the library
    "explicit_after": lambda: _imp("transformers.generation.utils", "accelerate",
                                   "transformers.generation.continuous_batching.continuous_api",
                                   "transformers.integrations.accelerate", "torchtpu"),
    "explicit_before": lambda: _imp("torch", "torchtpu", "transformers"),
}

CB = "transformers.generation.continuous_batching"


def check_patches():
    import torch
    import transformers
    from transformers import LlamaForCausalLM  # noqa: F401  (the issue's failing import)

    # the modules the patches target, imported (a no-op where the order already did)
    _imp(f"{CB}.continuous_api", f"{CB}.cache", "transformers.generation.utils",
         "accelerate.state", "accelerate.utils.modeling", "accelerate.utils.dataclasses")
    from torchtpu import integrations

    status = integrations.STATUS
    for target, what in sorted(status.items()):
        print(f"  {target}: {what}")
    bad = {t: w for t, w in status.items()
           if w != "applied" and not w.startswith(("skipped: not found",
                                                   "skipped: its signature has no"))}
    assert not bad, f"patches that failed: {bad}"
    need = ["transformers.generation.utils.GenerationMixin._prefill",
            "transformers.generation.utils.GenerationMixin._prepare_static_cache",
            f"{CB}.initialization.resolve_max_memory_percent",
            "accelerate.state.PartialState.default_device",
            "accelerate.state.PartialState._prepare_backend",
            "accelerate.state.PartialState.set_device",
            "accelerate.utils.modeling.get_max_memory"]
    init = sys.modules[f"{CB}.initialization"]
    if "device" in inspect.signature(init.resolve_continuous_batching_config).parameters:
        need.append(f"{CB}.initialization.resolve_continuous_batching_config")
    for t in need:
        assert status.get(t) == "applied", (t, status.get(t))
    where = [m for m in ("utils", "requests")
             if status.get(f"{CB}.{m}.get_device_and_memory_breakdown") == "applied"]
    assert where, "the memory breakdown was patched nowhere"
    # every module that imported a patched function by name holds the patched one
    originals = {}
    for t, what in status.items():
        if what != "applied":
            continue
        mod, _, attr = t.rpartition(".")
        if mod in sys.modules:
            fn = getattr(sys.modules[mod], attr)
            if getattr(fn, "__wrapped__", None) is not None:
                originals[id(fn.__wrapped__)] = t
    stale = [(name, k, originals[id(v)]) for name, m in list(sys.modules.items())
             if name.split(".")[0] in ("transformers", "accelerate")
             for k, v in list(getattr(m, "__dict__", {}).items()) if id(v) in originals]
    assert not stale, f"modules still holding an unpatched original: {stale}"
    # continuous batching sizes its cache from the tpu's memory, by default a fraction that
    # suits the CPU platform (through the names cache.py imported, old and new signatures)
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    from torchtpu.integrations.transformers import CPU_PLATFORM_MEMORY_PERCENT
    from torchtpu.runtime import devices

    dev, total, _, _ = sys.modules[f"{CB}.cache"].get_device_and_memory_breakdown()
    assert dev.type == "tpu" and total > 0, dev
    cb = ContinuousBatchingConfig()
    resolve = sys.modules[f"{CB}.initialization"].resolve_max_memory_percent
    kw = {"device": torch.device("tpu", 0)} if "device" in inspect.signature(
        resolve).parameters else {}
    resolve(cb, False, **kw)
    if devices.platform() == "cpu":
        assert cb.max_memory_percent == CPU_PLATFORM_MEMORY_PERCENT, cb.max_memory_percent
    from accelerate.utils import DynamoBackend

    assert DynamoBackend("TPU") is DynamoBackend.TPU
    print(f"transformers {transformers.__version__}, torch {torch.__version__}: patches ok")


def check_model():
    """A tiny Llama on "tpu": forward logits and greedy tokens (dynamic and static cache)
    equal CPU's; accelerate's default device is "tpu"."""
    import torch
    from accelerate import PartialState
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    cpu = LlamaForCausalLM(cfg).eval()
    tpu = LlamaForCausalLM(cfg).eval()
    tpu.load_state_dict(cpu.state_dict())
    tpu.to("tpu")
    ids = torch.randint(3, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(tpu(ids.to("tpu")).logits.cpu(), cpu(ids).logits,
                                   rtol=1e-4, atol=1e-4)
        for cache in (None, "static"):
            kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=0,
                      cache_implementation=cache)
            got = tpu.generate(ids.to("tpu"), **kw).cpu()
            torch.testing.assert_close(got, cpu.generate(ids, **kw))
    assert PartialState().default_device.type == "tpu", PartialState().default_device
    print("tiny Llama on tpu: forward and generate equal CPU's")


def main():
    order = sys.argv[1]
    ORDERS[order]()
    check_patches()
    if "--model" in sys.argv:
        check_model()
    print("ALL OK")


if __name__ == "__main__":
    main()
