"""Group plumbing c10d does in C++ for its own backends: ``dist.split_group`` for "tpu_dist"
groups, and the device a group is bound to (``init_process_group(device_id=...)``).

c10d replaces its own ProcessGroup by a backend that is a Python ProcessGroup subclass, and
sets ``bound_device_id`` on the one it drops: ours is set here instead (the default group's
after ``init_process_group``, a subgroup's from the default group's when it is created), so
``dist.group.WORLD.bound_device_id`` is the device_id, as with NCCL.

Splitting:
c10d splits a group through the C++ ``Backend::split`` (``ncclCommSplit`` for NCCL), which a
process group written in Python cannot implement. A split produces the same subgroups that
``new_group`` makes, so for a "tpu_dist" parent each rank creates the one subgroup it belongs
to with ``new_group(..., use_local_synchronization=True)``: only that subgroup's members take
part, and its name is the hash of its ranks, as ``split_group`` names it. Ranks in no split get
None, as from ``split_group``. DeviceMesh calls ``split_group`` for every mesh dimension once
the default group is bound to a device (``init_process_group(device_id=...)``), so 2-D meshes
depend on it. Other backends reach PyTorch's own ``split_group``.
"""
from __future__ import annotations

import functools

_done = [False]


def _is_ours(pg) -> bool:
    import torch

    from .process_group import ProcessGroupTPU

    try:
        return isinstance(pg._get_backend(torch.device("tpu")), ProcessGroupTPU)
    except Exception:  # noqa: BLE001 - no tpu backend in that group
        return False


def _split(orig, parent_pg=None, split_ranks=None, timeout=None, pg_options=None,
           group_desc=None, backend=None):
    import torch.distributed.distributed_c10d as c10d

    if not c10d.is_initialized():
        return orig(parent_pg, split_ranks, timeout, pg_options, group_desc, backend)
    default = c10d._get_default_group()
    parent = parent_pg or default
    if not _is_ours(parent):
        return orig(parent_pg, split_ranks, timeout, pg_options, group_desc, backend)
    # the same argument checks and messages as PyTorch's split_group
    if split_ranks is None or len(split_ranks) == 0:
        raise ValueError("split_ranks cannot be None or empty")
    if parent not in c10d._world.pg_group_ranks:
        raise ValueError(f"Group {parent} is not registered")
    to_group = c10d._world.pg_group_ranks[parent]
    me = default.rank()
    if me not in to_group:
        raise ValueError(f"Global rank {me} is not part of the parent group {parent}")
    mine = None
    for ranks in split_ranks:
        if len(ranks) == 0:
            raise ValueError("the split group cannot be empty")
        if len(ranks) > default.size():
            raise ValueError("the split group's size should be less or equal to the world_size "
                             "set by init_process_group")
        if len(ranks) != len(set(ranks)):
            raise ValueError("the split group cannot have duplicate ranks")
        if mine is None and to_group[me] in ranks:
            mine = sorted(ranks)
    if mine is None:
        return None
    to_global = {g: r for r, g in to_group.items()}
    pg = c10d.new_group([to_global[r] for r in mine], timeout=timeout, backend=backend,
                        pg_options=pg_options, group_desc=group_desc,
                        use_local_synchronization=True)
    pg.bound_device_id = default.bound_device_id
    return pg


def bound_device(ranks_given: bool):
    """The device a new "tpu_dist" group is bound to: a subgroup inherits the default group's
    (as c10d's new_group does); the default group is bound after init_process_group."""
    import torch.distributed.distributed_c10d as c10d

    if ranks_given and c10d.is_initialized():
        return c10d._get_default_group().bound_device_id
    return None


def _init(orig, *args, **kwargs):
    out = orig(*args, **kwargs)
    import torch
    import torch.distributed.distributed_c10d as c10d

    dev = kwargs.get("device_id")
    if dev is not None and c10d.is_initialized():
        pg = c10d._get_default_group()
        if pg.bound_device_id is None and _is_ours(pg):
            if isinstance(dev, int):
                dev = torch.device("tpu", dev)
            pg.bound_device_id = dev
    return out


def install() -> None:
    if _done[0]:
        return
    _done[0] = True
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    orig_init = c10d.init_process_group
    init = functools.wraps(orig_init)(functools.partial(_init, orig_init))
    c10d.init_process_group = init
    dist.init_process_group = init

    orig = c10d.split_group
    wrapped = functools.wraps(orig)(functools.partial(_split, orig))
    c10d.split_group = wrapped
    dist.split_group = wrapped
    try:  # DeviceMesh imported the name itself
        import torch.distributed.device_mesh as dm

        if getattr(dm, "split_group", None) is orig:
            dm.split_group = wrapped
    except ImportError:
        pass
