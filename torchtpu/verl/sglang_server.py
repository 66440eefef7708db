"""VeRL 0.9.1's SGLang server (``SGLangHttpServer.launch_server``) over SGLang 0.5.23, on "tpu".

VeRL 0.9.1 starts SGLang's HTTP server in its own Ray actor, written against SGLang 0.5.12.
Two of the SGLang interfaces it uses have since changed; each shim below checks its target and
applies only where that target is what it expects (otherwise it says so in a warning and leaves
VeRL as it is), and changes behaviour only when VeRL's platform is "tpu":

- ``dataclasses.fields(ServerArgs)``: SGLang's ``ServerArgs`` is a ``msgspec.Struct`` now, not
  a dataclass, and ``dataclasses.fields`` raises ``TypeError`` on it. VeRL's module gets a
  ``dataclasses`` whose ``fields`` answers a ``msgspec.Struct`` with ``msgspec.structs.fields``
  (records with the same ``name``); everything else is the standard module.
- ``Engine._launch_subprocesses``: VeRL unpacks ``tokenizer_manager, template_manager,
  scheduler_info, *_``; SGLang returns ``(tokenizer_manager, template_manager, port_args,
  scheduler_init_result, watchdog, ...)``, so VeRL's HTTP state would hold ``PortArgs`` as the
  scheduler's info. While VeRL's ``launch_server`` runs (a context variable set around it, so
  SGLang's own callers are untouched), the result is handed back in VeRL's order, the
  scheduler's info being ``scheduler_init_result.scheduler_infos[0]`` (what SGLang's own HTTP
  server publishes); the watchdog is given to the tokenizer manager as SGLang's server does, and
  the full result is kept on VeRL's server actor (``_torchtpu_sglang_launch``).
"""
from __future__ import annotations

import contextvars
import dataclasses
import functools
import inspect
import types
import warnings

from ..integrations import STATUS, patch, skipped, when_imported

SERVER = "verl.workers.rollout.sglang_rollout.async_sglang_server"
ENGINE = "sglang.srt.entrypoints.engine"
# what VeRL passes to SGLang's launcher
LAUNCHER_PARAMS = ("server_args", "init_tokenizer_manager_func", "run_scheduler_process_func",
                   "run_detokenizer_process_func")

# the VeRL server actor whose launch_server is running, or None (SGLang's own callers)
_verl_launch: contextvars.ContextVar = contextvars.ContextVar("torchtpu_verl_sglang_launch",
                                                              default=None)


def _on_tpu() -> bool:
    from verl.plugin.platform import get_platform

    return get_platform().device_name == "tpu"


def not_patched(target: str, why: str) -> None:
    """A shim whose target moved: VeRL runs unpatched there (recorded, and said in a warning,
    since GRPO with SGLang rollouts on "tpu" then fails where the shim would have helped)."""
    skipped(target, why)
    warnings.warn(f"torchtpu.verl: not patching {target} ({why}); VeRL's SGLang rollout runs "
                  "unpatched there", RuntimeWarning, stacklevel=2)


def _is_struct(obj) -> bool:
    import msgspec

    cls = obj if isinstance(obj, type) else type(obj)
    return issubclass(cls, msgspec.Struct)


def _fields(class_or_instance):
    if _is_struct(class_or_instance) and _on_tpu():
        import msgspec

        return msgspec.structs.fields(class_or_instance)
    return dataclasses.fields(class_or_instance)


class _Dataclasses(types.ModuleType):
    """The standard ``dataclasses`` module with a ``fields`` that also answers msgspec
    structs (see the module docstring)."""

    fields = staticmethod(_fields)

    def __getattr__(self, name):
        return getattr(dataclasses, name)


def _install_fields(module) -> None:
    target = f"{SERVER}.dataclasses"
    server_args = getattr(module, "ServerArgs", None)
    launch = getattr(getattr(module, "SGLangHttpServer", None), "launch_server", None)
    if isinstance(getattr(module, "dataclasses", None), _Dataclasses):
        return
    if getattr(module, "dataclasses", None) is not dataclasses or launch is None:
        return not_patched(target, "VeRL's SGLang server no longer uses the dataclasses module")
    if server_args is None or not _is_struct(server_args):
        # a dataclass ServerArgs (the SGLang VeRL was written for) needs nothing
        skipped(target, "SGLang's ServerArgs is not a msgspec struct: nothing to adapt")
        return
    if "fields" not in launch.__code__.co_names:
        return not_patched(target, "launch_server no longer reads dataclasses.fields")
    module.dataclasses = _Dataclasses("dataclasses", dataclasses.__doc__)
    STATUS[target] = "applied"


def _verl_order(result, server):
    """SGLang 0.5.23's launcher result in VeRL 0.9.1's order (module docstring), or None when
    the result is not the expected one (then VeRL gets it unchanged)."""
    if not isinstance(result, tuple) or len(result) < 5:
        return None
    tokenizer_manager, template_manager, port_args, init_result, watchdog, *rest = result
    infos = getattr(init_result, "scheduler_infos", None)
    if type(port_args).__name__ != "PortArgs" or not infos:
        return None
    server._torchtpu_sglang_launch = result
    if tokenizer_manager is not None and watchdog is not None:
        tokenizer_manager._subprocess_watchdog = watchdog
    return (tokenizer_manager, template_manager, infos[0], port_args, init_result, watchdog,
            *rest)


def _wrap_launcher(orig):
    func = orig.__func__

    @functools.wraps(func)
    def _launch_subprocesses(cls, *args, **kwargs):
        result = func(cls, *args, **kwargs)
        server = _verl_launch.get()
        if server is None:
            return result
        ordered = _verl_order(result, server)
        if ordered is None:
            not_patched(f"{ENGINE}.Engine._launch_subprocesses",
                        "its result is no longer (tokenizer manager, template manager, port args,"
                        " scheduler init result, watchdog, ...)")
            return result
        return ordered

    return classmethod(_launch_subprocesses)


def _wrap_launch_server(orig):
    @functools.wraps(orig)
    async def launch_server(self, *args, **kwargs):
        if not _on_tpu():
            return await orig(self, *args, **kwargs)
        token = _verl_launch.set(self)
        try:
            return await orig(self, *args, **kwargs)
        finally:
            _verl_launch.reset(token)

    return launch_server


def _install_launcher(module) -> None:
    server = getattr(module, "SGLangHttpServer", None)
    launch = getattr(server, "launch_server", None)
    if launch is None:
        return not_patched(f"{SERVER}.SGLangHttpServer.launch_server", "not found")
    if "_launch_subprocesses" not in launch.__code__.co_names:
        return not_patched(f"{SERVER}.SGLangHttpServer.launch_server",
                           "it no longer calls SGLang's _launch_subprocesses")
    import importlib

    engine = importlib.import_module(ENGINE)
    launcher = getattr(getattr(engine, "Engine", None), "__dict__", {}).get("_launch_subprocesses")
    if not isinstance(launcher, classmethod):
        return not_patched(f"{ENGINE}.Engine._launch_subprocesses", "not a classmethod of Engine")
    missing = set(LAUNCHER_PARAMS) - set(inspect.signature(launcher.__func__).parameters)
    if missing:
        return not_patched(f"{ENGINE}.Engine._launch_subprocesses",
                           f"its signature has no {', '.join(sorted(missing))}")
    patch(engine, "Engine._launch_subprocesses", _wrap_launcher)
    patch(module, "SGLangHttpServer.launch_server", _wrap_launch_server)


def install() -> None:
    when_imported(SERVER, _install_fields)
    when_imported(SERVER, _install_launcher)
