"""Live storage on gloo ranks whose phase boundaries do not depend on thread timing: the measuring side of the mesh
claims (distributed/mesh_peak.py).

Three things free or count storage off the main thread's order, and each is waited for or serialised by design:
  - a gloo Work keeps its tensors (inputs, outputs, the future's value; a reduce-scatter's clone of its input)
    until its last strong reference goes AND its last weak one: c10's intrusive_ptr runs the destructor, which
    frees the tensors, only when both counts are zero. The worker thread that ran it drops its strong reference
    (runLoop's `work` and workInProgress_) after the Work's future is complete, when the main thread's wait() has
    already returned, and a gloo barrier keeps weak references to every Work in flight when it was issued until
    the worker drops the barrier. So a barrier cannot order these frees: after one (or two), a reduce-scatter's
    clone was still freed by the worker on 18 of 200 calls. drain() does: each process group here runs ONE worker
    thread (the backend BACKEND: ProcessGroupGloo with Options._threads = 1, for the default group and every
    DeviceMesh sub-group), which takes its queue in order and ends a Work's loop iteration before it takes the
    next, so when a one-element all-reduce on the group returns, the worker holds nothing of what came before
    (0 of 600 calls freed off the main thread). SettledStorage drains a collective's group right after the
    collective is issued (it completes there: gloo's CPU collectives have no overlap whose bytes differ), and
    settle() drains every group before a boundary is read: a collective's buffers go when the main thread drops
    them, as with a GPU's stream-ordered allocator, never when the worker is next scheduled (without it, one rank
    of a loaded machine read a peak 18% over). Point-to-point ops are not drained (their peers reach them at
    different points); the pipeline claims read phase ends;
  - Python's cycle collector frees what only a cycle references (autograd nodes and the tensors they save) when it
    happens to run: gc.collect() runs first. Each rank freezes (gc.freeze) what exists once its process group is
    up, and again after each scenario has returned and its garbage is collected (the imports, caches and groups
    a scenario leaves), so a boundary's collection walks only what the running scenario made: the settled
    files' spawns take 3.8-4.5x less time than with no freeze. Frozen objects are never collected, which cannot touch
    a count: a scenario counts only the storages its own SettledStorage saw allocated, and none of them is alive
    at the freeze after it;
  - the counters are updated from the worker thread too (a finalizer there, and any op gloo runs there under the
    caller's thread-local state, dispatch modes included), so every update holds one lock.

    from llm_anatomy.distributed.settled import SettledStorage, spawn_peaks, spawn_settled
    spawn_settled(2, [dict(...)], fn)        # fn(**scenario) on 2 one-worker gloo ranks; results[rank][scenario]
    spawn_peaks(2, [dict(cfg=..., run=..., strategy="fsdp")])   # distributed/peak.py's peaks(), settled
"""
from __future__ import annotations

import datetime
import gc
import json
import tempfile
import threading
from pathlib import Path

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroupGloo
from torch.utils._python_dispatch import _disable_current_modes

from llm_anatomy.distributed.counting import collective_group
from llm_anatomy.distributed.peak import RankStorage, peaks
from llm_anatomy.distributed.train_step import SPAWN_TIMEOUT_S
from llm_anatomy.io import write_atomic

BACKEND = "gloo-one-worker"


def _one_worker_gloo(store, rank: int, size: int, timeout) -> ProcessGroupGloo:
    opts = ProcessGroupGloo._Options()
    opts._timeout, opts._threads = timeout, 1
    opts._devices = [ProcessGroupGloo.create_default_device()]
    return ProcessGroupGloo(store, rank, size, opts)


def register_backend() -> None:
    """Make BACKEND known to torch.distributed (once per process)."""
    if BACKEND.upper() not in dist.Backend.backend_list and BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, _one_worker_gloo, devices=["cpu"])


def drain(group: dist.ProcessGroup) -> None:
    """Return once the group's one gloo worker holds no reference to any Work issued before: a one-element
    all-reduce (no barrier: it keeps weak references; module docstring), outside any dispatch mode."""
    workers = group._get_backend(torch.device("cpu")).options._threads
    if workers != 1:  # a second worker could still be ending an earlier Work's iteration
        raise RuntimeError(f"drain() needs one gloo worker per process group ({BACKEND}); "
                           f"group {group.group_name} has {workers}")
    with _disable_current_modes():
        dist.all_reduce(torch.zeros(1), group=group)


def settle() -> None:
    """Wait until every collective this rank ran has been dropped by the worker that ran it: drain() every
    process group the rank belongs to, in creation order (the same on every rank)."""
    for group in list(dist.distributed_c10d._world.pg_map):
        drain(group)


class SettledStorage(RankStorage):
    """RankStorage whose counters take one lock, whose collectives are drained as they are issued, and whose phase
    boundaries are read settled: the cycle collector run, then every process group drained (module docstring)."""

    def __init__(self):
        super().__init__()
        self._lock = threading.RLock()  # re-entered when a free happens inside an add (gc in the dict insert)

    def _add(self, t: torch.Tensor) -> None:
        with self._lock:
            super()._add(t)

    def _free(self, key: int) -> None:
        with self._lock:
            super()._free(key)

    def _resized(self, st, old: int) -> None:
        with self._lock:
            super()._resized(st, old)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        group = collective_group(func, args)
        if group is not None:
            drain(dist.distributed_c10d._resolve_process_group(group))
        return out

    def phase(self, name: str) -> dict:
        gc.collect()
        if dist.is_initialized():
            settle()
        with self._lock:
            return super().phase(name)


def _rank(rank: int, world: int, init_method: str, scenarios: list[dict], outdir: str, timeout_s: float,
          fn) -> None:
    torch.set_num_threads(1)  # the ranks share the cores
    register_backend()
    dist.init_process_group(BACKEND, rank=rank, world_size=world, init_method=init_method,
                            timeout=datetime.timedelta(seconds=timeout_s))
    gc.collect()
    gc.freeze()
    try:
        out = []
        for sc in scenarios:
            out.append(fn(**sc))
            gc.collect()
            gc.freeze()  # what this scenario left alive (module caches, groups): never walked again
        write_atomic(Path(outdir) / f"rank{rank}.json", json.dumps(out))
    finally:
        dist.destroy_process_group()


def spawn_settled(world: int, scenarios: list[dict], fn, *, timeout_s: float = SPAWN_TIMEOUT_S) -> list[list]:
    """fn(**scenario) for each scenario on `world` local processes of the one-worker gloo backend, a FileStore in a
    temporary folder for the rendezvous: results[rank][scenario]. A failing rank raises here."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_rank, args=(world, f"file://{d}/store", scenarios, d, timeout_s, fn), nprocs=world, join=True)
        return [json.loads((Path(d) / f"rank{r}.json").read_text()) for r in range(world)]


def _settled_peaks(**scenario) -> list[dict]:
    return peaks(**scenario, storage=SettledStorage)


def spawn_peaks(world: int, scenarios: list[dict], *, timeout_s: float = SPAWN_TIMEOUT_S) -> list[list[list[dict]]]:
    """Each scenario (keyword arguments of peak.peaks()) on `world` local one-worker gloo processes, read settled
    (a collective's buffers go when the caller drops them, not when gloo's worker thread is next scheduled):
    results[rank][scenario] = the last step's phases."""
    return spawn_settled(world, scenarios, _settled_peaks, timeout_s=timeout_s)
