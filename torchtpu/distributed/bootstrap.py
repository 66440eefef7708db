"""Joining a multi-process job: one process per device, JAX's coordination service.

A process joins the cluster (``jax.distributed`` semantics: coordination service, heartbeats,
then every process's devices in ``jax.devices()``) before the JAX backend exists, at the first
of: ``init_process_group`` (the backend creator calls :func:`join` with the c10d store), or the
first device use when ``WORLD_SIZE`` > 1 (:func:`join_from_env`, a hook of
``runtime.devices``).

The coordinator listens on its own port, never torchrun's ``MASTER_PORT`` (the agent's
TCPStore owns it): ``TORCHTPU_COORDINATOR_ADDRESS`` (``host:port``) when set, else rank 0
picks a free port on ``MASTER_ADDR``, binds the service to that address only and publishes it
through the c10d store. JAX's preemption service is off (it swallows torchrun's SIGTERM), and a
missed heartbeat is recorded instead of aborting the process (JAX's default), so a dead peer
surfaces as a RuntimeError of the collective that saw it.
"""
from __future__ import annotations

import atexit
import datetime
import os
import socket
import threading

import jax

from ..runtime import devices as _devices
from ..runtime import working_set as _working_set

_KEY = "torchtpu_coordinator"
_EPOCH_KEY = "torchtpu/epoch"

state = {"joined": False, "rank": 0, "world_size": 1, "local_rank": 0, "errors": [],
         "failed": False, "epoch": "0"}
_lock = threading.Lock()


def _env_int(name: str, default: int) -> int:
    v = os.environ.get(name, "")
    return int(v) if v.strip() else default


def _free_port(host: str) -> int:
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(fam, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _coordinator(store, rank: int, timeout: datetime.timedelta) -> tuple[str, str | None]:
    """(address to connect to, address the service binds to (rank 0 only))."""
    addr = os.environ.get("TORCHTPU_COORDINATOR_ADDRESS", "").strip()
    if addr:
        host = addr.rsplit(":", 1)[0]
        return addr, addr if host not in ("", "0.0.0.0", "[::]") else None
    host = os.environ.get("MASTER_ADDR", "127.0.0.1").strip() or "127.0.0.1"
    if store is None:
        raise RuntimeError(
            "torchtpu: the tpu device was used before init_process_group in a job with "
            f"WORLD_SIZE={state['world_size']} and no c10d store to find the JAX coordinator: "
            "call torch.distributed.init_process_group('tpu_dist') first, or set "
            "TORCHTPU_COORDINATOR_ADDRESS=host:port (a free port, the same on every rank)")
    key = f"{_KEY}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    if rank == 0:
        port = _free_port(host.strip("[]"))
        addr = f"{host}:{port}"
        store.set(key, addr)
        return addr, addr
    store.wait([key], timeout)
    return store.get(key).decode(), None


def _agent_store(timeout: datetime.timedelta):
    """torchrun's agent TCPStore (it runs before any rank), else None."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "") != "True":
        return None
    import torch.distributed as dist

    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                         is_master=False, timeout=timeout)


def _on_missed_heartbeat(*args) -> None:
    """Replaces JAX's abort on a missed heartbeat: remember it; collectives in flight fail
    and name themselves. (jaxlib 0.10.2 cannot pass the error status to Python: when the
    coordination service reports a dead peer, the call fails with std::bad_cast and the
    process terminates, as JAX's default handler would abort it: the collective that lost
    the peer has raised its RuntimeError by then.)"""
    state["errors"].append("the JAX coordination service lost a peer (missed heartbeats): "
                           + " ".join(str(a) for a in args))


def _initialize(coordinator: str, bind: str | None, world_size: int, rank: int,
                timeout: datetime.timedelta) -> None:
    """``jax.distributed.initialize`` with our heartbeat callback and no preemption service."""
    from jax._src import distributed as jd
    from jax._src.lib import _jax

    jax.config.update("jax_enable_preemption_service", False)
    gs = jd.global_state
    if gs.client is not None:
        raise RuntimeError("torchtpu: jax.distributed was initialized by someone else")
    init_s = max(int(timeout.total_seconds()), 1)
    hb = _env_int("TORCHTPU_HEARTBEAT_TIMEOUT", 100)
    shutdown_s = _env_int("TORCHTPU_SHUTDOWN_TIMEOUT", min(init_s, 300))
    if rank == 0:
        if bind is None:
            bind = "[::]:" + coordinator.rsplit(":", 1)[1]
        gs.service = _jax.get_distributed_runtime_service(
            bind, world_size, heartbeat_timeout=hb, shutdown_timeout=shutdown_s)
    gs.client = _jax.get_distributed_runtime_client(
        coordinator, rank, init_timeout=init_s, heartbeat_timeout=hb,
        shutdown_timeout=shutdown_s, missed_heartbeat_callback=_on_missed_heartbeat,
        use_compression=True, shutdown_on_destruction=False)
    atexit.register(_skip_shutdown_after_failure)  # runs before JAX's own (LIFO)
    gs.client.connect()
    gs.coordinator_address = coordinator
    gs.process_id = rank
    gs.num_processes = world_size
    gs.initialize_preemption_sync_manager()  # a no-op with the service off
    # this cluster's epoch: rank 0 draws it, the others read it from the coordination service
    # (new with every cluster): the MPMD check keys its c10d store entries by it, so entries
    # left in a store that outlived an earlier run can never be read as this run's
    if rank == 0:
        state["epoch"] = os.urandom(6).hex()
        gs.client.key_value_set(_EPOCH_KEY, state["epoch"])
    else:
        state["epoch"] = gs.client.blocking_key_value_get(_EPOCH_KEY, init_s * 1000)


def _skip_shutdown_after_failure() -> None:
    """After a collective failed (a peer died), JAX's exit-time shutdown barrier would wait
    for the dead peer (up to the shutdown timeout): leave without it."""
    if state["failed"]:
        from jax._src import distributed as jd

        jd.global_state.client = None
        jd.global_state.service = None


def join(store, rank: int, world_size: int, timeout: datetime.timedelta | None = None) -> None:
    """Join the cluster as ``rank`` of ``world_size`` (idempotent; checks consistency)."""
    timeout = timeout or datetime.timedelta(minutes=30)
    with _lock:
        if state["joined"]:
            if (state["rank"], state["world_size"]) != (rank, world_size):
                raise RuntimeError(
                    f"torchtpu: this process joined the JAX cluster as rank {state['rank']} of "
                    f"{state['world_size']}, not rank {rank} of {world_size}")
            return
        if world_size > 1 and _devices.backend_created():
            raise RuntimeError(
                "torchtpu: init_process_group must run before the first use of the tpu device "
                "(the JAX backend was already created without the other processes). Call "
                "torch.distributed.init_process_group first, or launch with WORLD_SIZE set "
                "(torchrun does) so that the first device use joins the job"
                + (" (it was created at import, to load the programs this command line's last "
                   "run used ahead: set MASTER_ADDR or RANK before starting a process that "
                   "joins a job later, or TORCHTPU_WORKING_SET=0)"
                   if _working_set.created_backend[0] else ""))
        state.update(rank=rank, world_size=world_size,
                     local_rank=_env_int("LOCAL_RANK", rank))
        if world_size > 1:
            coord, bind = _coordinator(store, rank, timeout)
            _initialize(coord, bind, world_size, rank, timeout)
            # tpu:0 .. tpu:{local_world_size - 1} all name this process's one device, whose
            # tensors report tpu:0 (runtime/devices.py says why)
            _devices.alias_count[0] = _env_int("LOCAL_WORLD_SIZE", world_size)
        state["joined"] = True


def join_from_env() -> None:
    """The ``before_backend`` hook: a first device use in a multi-process job joins it."""
    ws = _env_int("WORLD_SIZE", 1)
    if ws <= 1 or state["joined"]:
        return
    timeout = datetime.timedelta(seconds=_env_int("TORCHTPU_INIT_TIMEOUT", 1800))
    store = None if os.environ.get("TORCHTPU_COORDINATOR_ADDRESS") else _agent_store(timeout)
    join(store, _env_int("RANK", 0), ws, timeout)


def rank_device(global_rank: int):
    """The jax device of ``global_rank`` (its process's first device)."""
    return _rank_devices()[global_rank]


_rank_devs: list = []


def _rank_devices() -> dict:
    if not _rank_devs:
        _devices.devices()  # creates the backend (joins first)
        by_rank: dict = {}
        for d in jax.devices(_devices.platform()):
            by_rank.setdefault(d.process_index, d)
        _rank_devs.append(by_rank)
    return _rank_devs[0]


def install() -> None:
    _devices.before_backend.append(join_from_env)
