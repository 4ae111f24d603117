"""torch.distributed on tpu: the ``tpu_dist`` backend.

Importing torch_tpu registers ``tpu_dist`` with ``torch.distributed`` for the ``tpu``
device, so ``dist.init_process_group()`` (no backend named) gives tpu tensors to it, and
``backend="cpu:gloo,tpu:tpu_dist"`` adds gloo for CPU tensors (as ``"cpu:gloo,cuda:nccl"``
does on GPUs). DDP, FSDP2, DTensor and pipelining call it through c10d like any backend.

The backend itself is C++ (``csrc/distributed``), with two transports:

- host staging (``tpu_dist.cpp``), for processes whose plugin has no cross-process
  collectives (the CPU plugin): each collective copies the tpu tensors to the host, runs
  PyTorch's own gloo collective on the copies and copies the results back
  (``torch_tpu.metrics()`` counts ``dist_collectives`` and ``dist_staged_bytes``). This
  module builds the inner gloo group for each process group c10d creates (the default
  group and every ``new_group`` or ``DeviceMesh`` dimension) from that group's store,
  rank, size and timeout;
- XLA collectives (``xla_transport.cpp``): each collective is an XLA program with one
  replica per rank, the data moving device to device (``dist_xla_collectives``,
  ``dist_xla_bytes``). Used for every group when the plugin's client spans torchrun's
  processes (the CUDA plugin; ``process_span.cpp`` creates it so), and by ``local_group``
  for ranks that are threads of one process, each on its own device.

``TORCH_TPU_DIST_TRANSPORT=staged`` keeps host staging where XLA could run; ``=xla``
makes its absence an error.
"""

from __future__ import annotations

import itertools

BACKEND = "tpu_dist"
ALIAS = "tpu"  # init_process_group("tpu"): the same backend
_local_names = itertools.count()  # c10d keeps group names for the process's life


def _transport() -> str:
    """``"xla"`` where the plugin's client spans the job's processes, else ``"staged"``."""
    from . import _C, _env

    wanted = _env.get("TORCH_TPU_DIST_TRANSPORT", "auto") or "auto"
    if wanted not in ("auto", "xla", "staged"):
        raise ValueError(f"TORCH_TPU_DIST_TRANSPORT must be auto, xla or staged, not {wanted!r}")
    if wanted == "staged":
        return "staged"
    if _C._client_spans_processes():
        return "xla"
    if wanted == "xla":
        raise RuntimeError(
            "TORCH_TPU_DIST_TRANSPORT=xla, but the plugin's client does not span this job's processes: "
            "the plugin has no cross-process collectives (the CPU plugin), or the job was not started "
            "by torchrun. Unset it to stage collectives through the host over gloo.")
    return "staged"


def _create_backend(opts, backend_options=None):
    import torch.distributed as dist

    from . import _C

    # Its own key space in the group's store, so the inner group's keys meet no other's.
    store = dist.PrefixStore(f"{BACKEND}/", opts.store)
    devices = getattr(_rank_thread, "devices", None)
    if devices is not None:
        # A group made in a rank's thread (new_group, a DeviceMesh dimension): its ranks are
        # threads too, each on its world rank's device.
        mine = [devices[g] for g in opts.global_ranks_in_group]
        return _C._tpu_dist_xla_backend(store, opts.group_rank, opts.group_size, opts.timeout, mine[opts.group_rank],
                                        mine, devices)
    if _transport() == "xla":
        # Each rank runs on the device of its first collective's tensors.
        return _C._tpu_dist_xla_backend(store, opts.group_rank, opts.group_size, opts.timeout, -1)
    host = dist.ProcessGroupGloo(store, opts.group_rank, opts.group_size, opts.timeout)
    return _C._tpu_dist_backend(host, store, opts.group_rank, opts.group_size, opts.timeout)


def _devices_of(world_size: int, devices) -> list[int]:
    """Each rank's device index: ``devices`` as ints, default rank r on tpu:r."""
    return list(range(world_size)) if devices is None else [int(d) for d in devices]


def local_group(rank: int, world_size: int, store=None, devices=None, timeout=None):
    """A process group for ``world_size`` ranks that are threads of this process, rank r
    on ``tpu:devices[r]`` (default: ``tpu:r``), whose collectives run as XLA programs.

    Every rank's thread calls this with the same ``store`` (a ``dist.HashStore`` shared
    by the threads) and then uses the group like any other: ``dist.all_reduce(t,
    group=pg)``, DTensor, ... CPU tensors in the group go to gloo, as with
    ``"cpu:gloo,tpu:tpu_dist"``. Collectives check that every rank arrived within ``timeout``
    (default 5 minutes) and agree on the tensors, so a missing rank is an error, not a
    hang."""
    import datetime

    import torch
    import torch.distributed as dist

    from . import _C

    if store is None:
        raise ValueError("local_group: pass the dist.HashStore every rank's thread shares")
    devices = _devices_of(world_size, devices)
    if len(devices) != world_size or len(set(devices)) != world_size:
        raise ValueError(f"local_group: {world_size} ranks need {world_size} distinct devices, got {devices}")
    if not 0 <= rank < world_size:
        raise ValueError(f"local_group: rank {rank} is not in [0, {world_size})")
    count = torch.tpu.device_count()
    if max(devices) >= count:
        raise ValueError(f"local_group: tpu:{max(devices)} does not exist ({count} devices; with the CPU plugin "
                         "TORCH_TPU_CPU_DEVICES=N gives N)")
    timeout = timeout or datetime.timedelta(minutes=5)
    import sys

    if "torch._dynamo" in sys.modules:  # else init_local_process_group does it
        from . import _compile

        _compile._register()  # before the ranks' threads compile at once
    prefixed = dist.PrefixStore(f"{BACKEND}_local/", store)
    backend = _C._tpu_dist_xla_backend(prefixed, rank, world_size, timeout, devices[rank], devices)
    pg = dist.ProcessGroup(prefixed, rank, world_size)
    kind = dist.ProcessGroup.BackendType.CUSTOM
    pg._register_backend(torch.device("tpu"), kind, backend)
    gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", prefixed), rank, world_size, timeout)
    pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
    pg._set_default_backend(kind)
    # Known to c10d as new_group would make it (its ranks numbered as in the group), so
    # that recv, batch_isend_irecv and functional collectives accept it; each rank's
    # thread has its own group object, under its own name.
    from torch.distributed import distributed_c10d as c10d

    name = f"{BACKEND}_local_{next(_local_names)}_rank{rank}"
    pg._set_group_name(name)
    c10d._register_process_group(name, pg)
    c10d._world.pg_map[pg] = (BACKEND, prefixed)
    c10d._world.pg_names[pg] = name
    c10d._world.pg_group_ranks[pg] = {r: r for r in range(world_size)}
    c10d._world.pg_backend_config[pg] = f"cpu:gloo,tpu:{BACKEND}"
    return pg


_thread_worlds_lock = __import__("threading").Lock()
_rank_thread = __import__("threading").local()  # in a rank's thread: `devices`, its world's ranks' devices


def _thread_local_world() -> None:
    """Gives each thread its own c10d world (default group, group names, ranks), as
    PyTorch's own threaded test groups do (``torch.testing._internal.distributed.
    multi_threaded_pg``): once per process, before any thread makes its group."""
    from torch.distributed import distributed_c10d as c10d

    with _thread_worlds_lock:
        if type(c10d._world).__name__ == "ThreadLocalWorld":
            return
        if c10d._world.default_pg is not None:
            raise RuntimeError("init_local_process_group: this process already has a default process group "
                               "(init_process_group); ranks as threads need a world of their own each")
        from torch.testing._internal.distributed.multi_threaded_pg import ThreadLocalWorld

        c10d._world = ThreadLocalWorld()
        # DTensor derives its outputs' shapes in a FakeTensorMode that threads would enter at
        # once (one rank's fake tensors on another's device: "Expected all tensors to be on the
        # same device"); PyTorch's knob for ranks as threads serializes it, as its own threaded
        # DTensor tests do.
        from torch.distributed.tensor._sharding_prop import ShardingPropagator

        ShardingPropagator._fake_mode_lock = __import__("threading").Lock()
        register = c10d._register_pg_in_world

        def register_pg_in_world(pg, *args, group_name, **kwargs):
            # c10d's registry of group names is the process's: the threads' worlds name their
            # groups alike ("2", ...), so a group made in a rank's thread is registered under
            # a name of that thread's (its store keys keep the shared name: the ranks meet there).
            if getattr(_rank_thread, "devices", None) is not None:
                group_name = f"{group_name}_rank{_rank_thread.rank}"
                pg._set_group_name(group_name)
            return register(pg, *args, group_name=group_name, **kwargs)

        c10d._register_pg_in_world = register_pg_in_world


def init_local_process_group(rank: int, world_size: int, store=None, devices=None, timeout=None):
    """``local_group`` as this thread's default process group: ``dist.get_rank()``,
    ``DeviceMesh``, DTensor, FSDP2 and DDP then run with ranks as threads of this process,
    rank r on ``tpu:devices[r]``. Each thread sees a c10d world of its own (the process's
    first call sets that up; a process that already called ``init_process_group``
    cannot). Inside ``torch.compile(backend="tpu")`` the group's functional collectives
    become ops of the compiled program (docs/distributed.md, "Inside torch.compile")."""
    from torch.distributed import distributed_c10d as c10d

    from . import _compile

    _compile._register()  # the ranks' threads compile at once: Dynamo's lazy registration raced
    _thread_local_world()
    if c10d._world.default_pg is not None:
        raise RuntimeError(f"init_local_process_group: rank {rank}'s thread already has a default process group")
    pg = local_group(rank, world_size, store, devices=devices, timeout=timeout)
    c10d._world.default_pg = pg
    c10d._world.group_count = 1
    _rank_thread.rank = rank
    _rank_thread.devices = _devices_of(world_size, devices)
    import torch
    import torch._dynamo

    torch.tpu.set_device(_rank_thread.devices[rank])
    # FakeTensor's dispatch cache keys a factory's device as written ("tpu", no index): a fake
    # made in one rank's thread came back with another rank's device from the cache (DTensor's
    # sharding propagation builds its fake arguments so: "found at least two devices, tpu:0
    # and tpu:2"). Off in ranks' threads (the setting is the thread's own).
    torch._dynamo.config.fake_tensor_cache_enabled = False
    return pg


def register() -> bool:
    """Registers ``tpu_dist`` with torch.distributed (once). False where torch was built
    without distributed support."""
    try:
        import torch.distributed as dist
    except ImportError:
        return False
    if not dist.is_available():
        return False
    if getattr(dist.Backend, BACKEND.upper(), None) is not None:
        return True
    # "tpu" too, as Google's TorchTPU registers both; tpu_dist is the device's default.
    dist.Backend.register_backend(ALIAS, _create_backend, extended_api=True, devices=["tpu"])
    dist.Backend.register_backend(BACKEND, _create_backend, extended_api=True, devices=["tpu"])
    dist.Backend.default_device_backend_map["tpu"] = BACKEND  # the first registered would stay
    _keep_the_default_backend_registered()
    return True


def _keep_the_default_backend_registered() -> None:
    """``init_process_group()`` with no backend builds a group with the accelerator's backend
    only (``tpu:tpu_dist``), then names gloo its default because it sees no nccl; DDP asks the
    group for its default backend ("Could not find backend type 1 ... gloo"). On CUDA the
    default is the nccl it built. Each group whose backends are tpu_dist alone gets tpu_dist
    as its default, as nccl is on CUDA (every group: the default one, new_group, DeviceMesh)."""
    from torch.distributed import distributed_c10d as c10d

    helper = c10d._new_process_group_helper
    if getattr(helper, "_torch_tpu", False):
        return

    def new_process_group_helper(*args, **kwargs):
        pg, store = helper(*args, **kwargs)
        config = c10d._world.pg_backend_config.get(pg, "") if isinstance(pg, c10d.ProcessGroup) else ""
        if config in (f"tpu:{BACKEND}", f"tpu:{ALIAS}"):
            pg._set_default_backend(c10d.ProcessGroup.BackendType.CUSTOM)
        return pg, store

    new_process_group_helper._torch_tpu = True
    c10d._new_process_group_helper = new_process_group_helper


__all__ = ["ALIAS", "BACKEND", "local_group", "register"]
