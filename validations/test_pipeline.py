"""The host/GPU pipeline (llm_anatomy/calculator/timing/pipeline.py), exact on synthetic kernel lists: where the GPU
idles behind the host, the launch order of the layers and of Liger's chunk loop, and steps run back to back."""
from __future__ import annotations


def _entry(name, phase, host, gpu, count=1, order=1, sync=False):
    from types import SimpleNamespace

    from llm_anatomy.calculator.timing.ops import Kernel

    return SimpleNamespace(kernel=Kernel(name, "other", phase, "memory", count, order=order, sync=sync),
                           host_s=host, gpu_s=gpu)


def test_pipeline_idles_the_gpu_where_the_host_is_behind():
    """k1 is issued at host 3 and runs 3-4; k2 is issued at 4 and runs 4-9: 9 in all, 6 of GPU work, 3
    idle, though the host's total (4) is below the GPU's (6), where max(GPU, host) says 6."""
    from llm_anatomy.calculator.timing import pipeline

    (seg,) = pipeline.simulate([_entry("k1", "forward", 3, 1), _entry("k2", "forward", 1, 5)], layers=1)
    assert (seg["time_s"], seg["gpu_s"], seg["host_s"], seg["idle_s"], seg["bound"]) == (9, 6, 4, 3, "gpu")
    # a host sync drains the queue: the host waits for the GPU (at 9), then issues k3 at 10, which runs 10-11
    segs = pipeline.simulate([_entry("k1", "forward", 3, 1), _entry("k2", "forward", 1, 5),
                              _entry("sync", "forward", 1, 0, sync=True, order=2), _entry("k3", "forward", 0, 1, order=2)],
                             layers=1)
    assert [(s["starts_at"], s["time_s"]) for s in segs] == [("k1", 9), ("sync", 2)]
    # the optimizer is its own segment, started when forward + backward has ended
    segs = pipeline.simulate([_entry("f", "forward", 0, 2), _entry("o", "optimizer", 5, 1)], layers=1)
    assert [(s["phase"], s["time_s"]) for s in segs] == [("forward", 2), ("optimizer", 6)]


def test_pipeline_launch_order_interleaves_the_layers():
    from llm_anatomy.calculator.timing import pipeline

    es = [_entry("pre", "forward", 0, 0, order=0), _entry("a", "forward", 0, 0, count=2),
          _entry("norm", "forward", 0, 0, count=3), _entry("post", "forward", 0, 0, order=2)]
    order = [(e.kernel.name, n) for e, n in pipeline.expand(pipeline.launch_order(es, "forward", layers=2))]
    assert order == [("pre", 1), ("a", 1), ("norm", 1), ("a", 1), ("norm", 1), ("norm", 1), ("post", 1)]
    bw = [_entry(e.kernel.name, "backward", 0, 0, e.kernel.count, e.kernel.order) for e in es]
    order = [(e.kernel.name, n) for e, n in pipeline.expand(pipeline.launch_order(bw, "backward", layers=2))]
    # backward: the final norm (the remainder) first, then the layers, each in reverse
    assert order == [("pre", 1), ("norm", 1), ("norm", 1), ("a", 1), ("norm", 1), ("a", 1), ("post", 1)]


def test_pipeline_runs_liger_chunk_by_chunk():
    """Consecutive loop entries of one count (Liger's chunk loop) run chunk by chunk, the last partial
    chunk's entries after; entries outside the loop keep their order, each count times in a row."""
    from types import SimpleNamespace

    from llm_anatomy.calculator.timing import pipeline
    from llm_anatomy.calculator.timing.ops import Kernel

    def e(name, count, loop=True):
        return SimpleNamespace(kernel=Kernel(name, "loss", "forward", "memory", count, order=2, loop=loop))

    es = [e("sync", 2, loop=False), e("cast", 3), e("mm", 3), e("ce", 3), e("cast", 1), e("mm", 1), e("sum", 1, loop=False)]
    order = [(x.kernel.name, n) for x, n in pipeline.expand(pipeline.launch_order(es, "forward", layers=4))]
    assert order == [("sync", 2)] + [("cast", 1), ("mm", 1), ("ce", 1)] * 3 + [("cast", 1), ("mm", 1), ("sum", 1)]


def test_steady_steps_overlap_the_next_forward_with_this_backward():
    """Two steps back to back, read as CUDA events read them (pipeline.steady), exact on a synthetic step:
    forward f (host 3, GPU 1), backward b (host 1, GPU 5), optimizer o (host 1, GPU 1). On an idle GPU
    (simulate) f is issued 0-3 and runs 3-4, b runs 4-9, and the clocks meet before o (issued at 10,
    running 10-11): 11. Back to back, the next f is issued at 5-8 while the GPU still runs b and o, so
    the step is the GPU's 7 (forward + backward 6). With a host sync before b, the host waits for f in
    every step: 8 (forward + backward 7), against 12 on an idle GPU."""
    from llm_anatomy.calculator.timing import pipeline

    es = [_entry("f", "forward", 3, 1), _entry("b", "backward", 1, 5), _entry("o", "optimizer", 1, 1)]
    assert sum(s["time_s"] for s in pipeline.simulate(es, layers=1)) == 11
    st = pipeline.steady(es, layers=1)
    assert (st["forward_backward_s"], st["step_s"]) == (6, 7)
    es[1] = _entry("b", "backward", 1, 5, sync=True)
    assert sum(s["time_s"] for s in pipeline.simulate(es, layers=1)) == 12
    st = pipeline.steady(es, layers=1)
    # step 2 starts at max(GPU 11, host 6) = 11 (its first event waits for the GPU); f, issued 6-9, runs
    # 11-12; the sync waits for it; b is issued at 13 and runs 13-18; o is issued at 14 and runs 18-19
    assert (st["forward_backward_s"], st["step_s"]) == (7, 8)
