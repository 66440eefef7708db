"""torchtpu.verl's shims for VeRL 0.9.1's SGLang rollout over SGLang 0.5.23 (run in
``.venv-verl-sglang``; prints one JSON line):

- ``loader``: VeRL's SGLang replica class and rollout config on "tpu" (SGLang imported for
  torchtpu's SGLang platform, torchtpu's attention backend, no memory saver);
- ``applied``: every shim's status once VeRL's SGLang modules are imported (all "applied");
- ``moved``: each shim given a module whose target moved (a module object without it, or with it
  in another form): skipped, with a RuntimeWarning that names the target;
- ``weights``: the weight handoff: "tpu" tensors through ``host_copy`` + ``serialize`` (in a
  process where SGLang's CUDA-IPC reduction patch is installed, as VeRL's actor has it), read
  back by SGLang's own ``MultiprocessingSerializer.deserialize`` in an unrelated process (a new
  interpreter, as the SGLang server's scheduler is), compared value for value.
"""
from __future__ import annotations

import base64
import json
import subprocess
import sys
import types
import warnings


def receive(payload: str) -> None:
    """The receiving side: SGLang's deserializer, then each tensor onto "tpu" as SGLang's weight
    updater does (``tensor.to(current_device)``)."""
    import torch
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

    import torchtpu  # noqa: F401

    monkey_patch_torch_reductions()  # as the server's TP worker does before deserialising
    got = MultiprocessingSerializer.deserialize(base64.b64decode(payload))
    out = {name: t.to(torch.tpu.current_device()).cpu().tolist() for name, t in got}
    print(json.dumps({"devices": [str(t.device) for _, t in got], "values": out}))


def moved():
    from torchtpu.integrations import STATUS
    from torchtpu.verl import sglang_server, sglang_weights

    cases = {
        # VeRL's server module without the classes the shims look for
        f"{sglang_server.SERVER}.dataclasses":
            lambda: sglang_server._install_fields(types.ModuleType(sglang_server.SERVER)),
        f"{sglang_server.SERVER}.SGLangHttpServer.launch_server":
            lambda: sglang_server._install_launcher(types.ModuleType(sglang_server.SERVER)),
        # VeRL's sync module whose sgl_update_weights is something else
        f"{sglang_weights.SYNC}.sgl_update_weights":
            lambda: sglang_weights._install(_module(sglang_weights.SYNC, sgl_update_weights=print)),
        f"{sglang_weights.HTTP}.HttpServerAdapter":
            lambda: sglang_weights._install_http(types.ModuleType(sglang_weights.HTTP)),
    }
    saved = dict(STATUS)
    out = {}
    for target, run in cases.items():
        STATUS.pop(target, None)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            run()
        said = [str(x.message) for x in w if issubclass(x.category, RuntimeWarning)]
        out[target] = {"status": STATUS.get(target, ""),
                       "warned": any(target in s for s in said)}
    STATUS.clear()
    STATUS.update(saved)
    return out


def _module(name, **attrs):
    m = types.ModuleType(name)
    m.__dict__.update(attrs)
    return m


def weights():
    import torch
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

    import torchtpu  # noqa: F401
    from torchtpu.verl.sglang_weights import host_copy, serialize

    monkey_patch_torch_reductions()  # SGLang's CUDA-IPC reduction, installed in this process
    g = torch.Generator().manual_seed(0)
    want = {"model.embed_tokens.weight": torch.randn(256, 64, generator=g),  # 64 KiB
            "model.norm.weight": torch.randn(7, generator=g).to(torch.bfloat16)}
    on_tpu = [(name, t.to("tpu")) for name, t in want.items()]
    payload = serialize([(name, host_copy(t)) for name, t in on_tpu])
    del on_tpu  # the handles keep the shared memory alive, not this process's tensors
    p = subprocess.run([sys.executable, __file__, "receive", base64.b64encode(payload).decode()],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    return {"devices": got["devices"], "bytes": len(payload),
            "equal": {name: got["values"][name] == t.tolist() for name, t in want.items()}}


def loader():
    """VeRL's SGLang loader and rollout config on "tpu" (imports VeRL's SGLang server module)."""
    import os

    from verl.workers.config import RolloutConfig
    from verl.workers.rollout.replica import get_rollout_replica_class

    cfg = RolloutConfig(name="sglang")
    cls = get_rollout_replica_class("sglang")
    from sglang.srt.platforms import current_platform as p

    return {"sglang": dict(cfg.engine_kwargs["sglang"]), "replica": cls.__name__,
            "platform": type(p).__name__, "device": p.device_name,
            "cpu_engine": os.environ.get("SGLANG_USE_CPU_ENGINE")}


def main():
    import verl  # noqa: F401  (loads torchtpu.verl, VeRL's "tpu" platform plugin)

    out = {"loader": loader()}
    import verl.workers.rollout.sglang_rollout.sglang_rollout  # noqa: F401  (weight sync)
    from torchtpu.integrations import STATUS

    out["applied"] = {k: v for k, v in STATUS.items() if "sglang" in k}
    out.update(moved=moved(), weights=weights())
    print(json.dumps(out))


if __name__ == "__main__":
    if sys.argv[1:2] == ["receive"]:
        receive(sys.argv[2])
    else:
        main()
