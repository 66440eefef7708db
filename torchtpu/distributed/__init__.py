"""``torch.distributed`` on "tpu": the "tpu_dist" process group (also registered as "tpu").

One process per device; the processes form a JAX cluster (``bootstrap.py``) and every
collective is a cached SPMD XLA program over a mesh of the group's devices (``collectives.py``,
``process_group.py``). ``register()`` runs at ``import torch`` (autoload) and is cheap: it
registers the backend and the lazy-bootstrap hook; nothing joins a cluster until
``init_process_group`` or the first device use in a job with ``WORLD_SIZE`` > 1.
"""
__all__ = ["register", "auto_parallelize", "Plan"]  # the last two: imported on first use

_done = [False]


def _create(opts, backend_options=None):
    """The c10d backend creator (``extended_api=True``)."""
    from . import bootstrap
    from .process_group import ProcessGroupTPU

    ranks = list(opts.global_ranks_in_group)
    if not ranks:  # the default group: join the cluster first
        bootstrap.join(opts.store, opts.group_rank, opts.group_size, opts.timeout)
        ranks = list(range(opts.group_size))
    pg = ProcessGroupTPU(opts.store, opts.group_rank, opts.group_size, opts.timeout, ranks,
                         opts.group_id)
    from .groups import bound_device

    dev = bound_device(bool(opts.global_ranks_in_group))
    if dev is not None:
        pg.bound_device_id = dev
    return pg


_libs: list = []


def _record_stream(tensor, stream) -> None:
    """Every tpu stream is in order and buffers are reference counted: nothing to record."""


def _install_record_stream() -> None:
    """DDP copies its inputs on a side stream and calls ``record_stream`` (a PrivateUse1 op
    with no CPU kernel, so the CPU fallback cannot run it)."""
    import torch

    from ..eager.dynamo_skip import skip

    lib = torch.library.Library("aten", "IMPL")
    lib.impl("record_stream", skip(_record_stream), "PrivateUse1")
    _libs.append(lib)


def register() -> None:
    """Register backends "tpu" and "tpu_dist" (the default for device "tpu") with c10d."""
    if _done[0]:
        return
    _done[0] = True
    import torch
    import torch.distributed as dist

    from . import bootstrap

    bootstrap.install()
    _install_record_stream()
    if not dist.is_available():
        return
    from . import functional

    functional.install()  # _c10d_functional kernels on "tpu" and their graph lowerings
    from . import tpu_ops

    tpu_ops.install()  # graph lowerings of torch.tpu.ops' collectives
    from . import ddp

    ddp.install()  # DDP find_unused_parameters / static_graph: C++ pinned hooks on demand
    from . import mpmd

    mpmd.install()  # collectives compared across ranks before a program's first launch
    from . import groups

    groups.install()  # split_group, bound_device_id (DeviceMesh over a device-bound group)
    from .mesh import topology_aware_mesh

    torch.tpu.topology_aware_mesh = topology_aware_mesh  # TorchTPU's name
    for name in ("tpu", "tpu_dist"):  # the last one registered is the default for "tpu"
        if name.upper() not in dist.Backend._plugins:
            dist.Backend.register_backend(name, _create, extended_api=True, devices=["tpu"])
    dist.Backend.default_device_backend_map["tpu"] = "tpu_dist"


def __getattr__(name):
    """``auto_parallelize`` / ``Plan`` (``auto_parallel/``), imported on first use: the
    search pulls in PuLP, which ``import torch`` should not pay for."""
    if name in ("auto_parallelize", "Plan"):
        from . import auto_parallel

        return getattr(auto_parallel, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
