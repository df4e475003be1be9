"""Claims: distributed/settled.py's boundaries count no collective's buffers once the caller has dropped them, its
own drains add no bytes, a collective's buffers (gloo's reduce-scatter clones its input) go the moment the caller
drops them, on the caller's thread, and it refuses a process group it cannot settle (more than one gloo worker).
One process, a process group of world size 1 (its FileStore in tmp_path), but for the two ranks of the caller's
thread claim. The settling itself is proven where it matters, on gloo ranks: validations/test_tp_memory.py's exact
TP phase ends."""
from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

from llm_anatomy.distributed.settled import BACKEND, SettledStorage, register_backend, settle


def _group(tmp_path, backend: str) -> None:
    if dist.is_initialized():
        pytest.fail("a process group is already initialized in this process")
    dist.init_process_group(backend, init_method=f"file://{tmp_path}/store", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))


def test_a_settled_boundary_holds_no_collective_buffer(tmp_path):
    """Tensors handed to collectives and dropped by the caller are gone at the next boundary; the boundary's
    drain leaves nothing counted."""
    register_backend()
    _group(tmp_path, BACKEND)
    try:
        live = SettledStorage()
        with live:
            start = live.phase("start")["allocated"]
            for n in range(1, 41):
                t = torch.ones(64 * n)
                out = torch.empty(64 * n)
                dist.all_reduce(t, async_op=True).wait()
                dist.all_gather_into_tensor(out, t, async_op=True).wait()
                del t, out
                assert live.phase(f"after {n}")["allocated"] == start, f"collective {n}'s buffers still counted"
    finally:
        dist.destroy_process_group()


def _reduce_scatters(calls: int) -> dict:
    """`calls` reduce-scatters under SettledStorage, each waited and dropped: the bytes still counted right after
    each drop (no boundary between), and how many frees ran off this thread."""
    import threading

    main, threads = threading.get_ident(), []

    class Recorded(SettledStorage):
        def _free(self, key: int) -> None:
            threads.append(threading.get_ident())
            super()._free(key)

    live, left = Recorded(), []
    with live:
        start = live.phase("start")["allocated"]
        for n in range(1, calls + 1):
            t, out = torch.ones(256 * n), torch.empty(256 * n // dist.get_world_size())
            dist.reduce_scatter_tensor(out, t, async_op=True).wait()
            del t, out
            left.append(live.allocated - start)
    return dict(left=left, frees=len(threads), off=sum(x != main for x in threads))


@pytest.mark.distributed
def test_a_collectives_buffers_go_when_the_caller_drops_them():
    """Two one-worker gloo ranks, 200 reduce-scatters each, waited and dropped: right after each drop, before any
    boundary, nothing of it is counted, and every free ran on the caller's thread. gloo's reduce-scatter clones
    its input into a Work that its worker thread also references; without the drain the worker drops the last
    reference when it is next scheduled (about 1 call in 17 here), and a peak read then counts the clone."""
    from llm_anatomy.distributed.settled import spawn_settled

    for rank, (res,) in enumerate(spawn_settled(2, [dict(calls=200)], _reduce_scatters)):
        late = [(n + 1, b) for n, b in enumerate(res["left"]) if b]
        assert not late, f"rank {rank}: {len(late)} calls still counted after the drop, first {late[:3]}"
        assert res["frees"] >= 400 and res["off"] == 0, f"rank {rank}: {res['off']} frees off the caller's thread"


class _Cycle:
    """An object that references itself: only the cycle collector frees it (and its tensor)."""

    def __init__(self, t: torch.Tensor):
        self.t, self.me = t, self


def test_a_boundary_frees_the_runs_cycles(tmp_path):
    """A tensor that only a reference cycle made inside the storage holds is gone at the next boundary, and a
    cycle made before it is collected too."""
    import gc
    import weakref

    register_backend()
    _group(tmp_path, BACKEND)
    try:
        before = _Cycle(torch.ones(8))
        old = weakref.ref(before)
        del before
        live = SettledStorage()
        with live:
            start = live.phase("start")["allocated"]
            cycle = _Cycle(torch.ones(256))
            assert live.phase("made")["allocated"] == start + 256 * 4
            del cycle
            assert live.phase("dropped")["allocated"] == start, "a cycle's tensor still counted at the boundary"
        gc.collect()
        assert old() is None, "a cycle made before the storage stays uncollectable after it exits"
    finally:
        dist.destroy_process_group()


def test_a_group_with_two_workers_is_refused(tmp_path):
    """Plain gloo runs two worker threads per group: one drain cannot prove both have dropped their Work."""
    _group(tmp_path, "gloo")
    try:
        with pytest.raises(RuntimeError, match="one gloo worker"):
            settle()
    finally:
        dist.destroy_process_group()
