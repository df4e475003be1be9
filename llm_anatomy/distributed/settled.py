"""Live storage on gloo ranks whose phase boundaries do not depend on thread timing: the measuring side of the mesh
claims (distributed/mesh_peak.py).

Three things free or count storage off the main thread's order, and each is waited for or serialised by design:
  - a gloo Work keeps its tensors (inputs, outputs, the future's value) until the last reference to it goes, and
    the worker thread that ran it drops its own reference (runLoop's `work` and workInProgress_) only after the
    Work's future is complete, when the main thread's wait() has already returned. Each process group here runs
    ONE worker thread (the backend BACKEND: ProcessGroupGloo with Options._threads = 1, for the default group and
    every DeviceMesh sub-group), and settle() runs a barrier on every group before a boundary is read: the one
    worker takes the barrier only after it has dropped every Work it ran before, so their buffers are freed (the
    storage's finalizer runs in the dropping thread, under the GIL) when the barrier's wait() returns;
  - Python's cycle collector frees what only a cycle references (autograd nodes and the tensors they save) when it
    happens to run: gc.collect() runs first (over every object: freezing what existed before a run, gc.freeze, made
    the walk shorter but left exact TP phase ends reading up to 1.7 KB over on gloo, so nothing is frozen);
  - the counters are updated from the worker thread too (a finalizer there, and any op gloo runs there under the
    caller's thread-local state, dispatch modes included), so every update holds one lock.

    from llm_anatomy.distributed.settled import SettledStorage, spawn_settled
    spawn_settled(2, [dict(...)], fn)        # fn(**scenario) on 2 one-worker gloo ranks; results[rank][scenario]
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

from llm_anatomy.distributed.peak import RankStorage
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


def settle() -> None:
    """Wait until every collective this rank ran has been dropped by the worker that ran it: a barrier on every
    process group the rank belongs to, in creation order (the same on every rank), outside any dispatch mode."""
    with _disable_current_modes():
        for group in list(dist.distributed_c10d._world.pg_map):
            workers = group._get_backend(torch.device("cpu")).options._threads
            if workers != 1:  # a second worker could still hold a Work when the barrier's is done
                raise RuntimeError(f"settle() needs one gloo worker per process group ({BACKEND}); "
                                   f"group {group.group_name} has {workers}")
            dist.barrier(group=group)


class SettledStorage(RankStorage):
    """RankStorage whose counters take one lock and whose phase boundaries are read settled: the cycle collector
    run, then every process group's barrier (module docstring). The peaks inside a phase still follow when gloo's
    worker frees a buffer (a peak is read after each op without the lock: it can miss a free that lands between
    the op and the read, never an allocation)."""

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
    try:
        write_atomic(Path(outdir) / f"rank{rank}.json", json.dumps([fn(**sc) for sc in scenarios]))
    finally:
        dist.destroy_process_group()


def spawn_settled(world: int, scenarios: list[dict], fn, *, timeout_s: float = SPAWN_TIMEOUT_S) -> list[list]:
    """fn(**scenario) for each scenario on `world` local processes of the one-worker gloo backend, a FileStore in a
    temporary folder for the rendezvous: results[rank][scenario]. A failing rank raises here."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_rank, args=(world, f"file://{d}/store", scenarios, d, timeout_s, fn), nprocs=world, join=True)
        return [json.loads((Path(d) / f"rank{r}.json").read_text()) for r in range(world)]
