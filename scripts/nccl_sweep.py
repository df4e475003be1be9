"""nccl-tests-style sweep through torch.distributed: all-reduce, all-gather, reduce-scatter over message sizes.

torchrun --nproc_per_node N scripts/nccl_sweep.py > sweep.json   (rank 0 prints JSON; NCCL_NVLS_ENABLE=0)
Bus bandwidth uses NCCL's factors: all-reduce 2(n-1)/n, all-gather and reduce-scatter (n-1)/n.
"""
import json
import os
import statistics
import time

import torch
import torch.distributed as dist


def main():
    assert os.environ.get("NCCL_NVLS_ENABLE") == "0", "keep NVLink multicast off: NCCL_NVLS_ENABLE=0"
    dist.init_process_group("nccl")
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank % torch.cuda.device_count())
    rows = []
    for size in [2 ** k for k in range(20, 31, 2)]:  # bytes per rank's buffer: 1 MiB .. 1 GiB
        numel = size // 2  # bf16
        x = torch.randn(numel, device="cuda", dtype=torch.bfloat16)
        out_ag = torch.empty(numel * n, device="cuda", dtype=torch.bfloat16)
        out_rs = torch.empty(numel // n, device="cuda", dtype=torch.bfloat16)
        ops = {"all_reduce": (lambda: dist.all_reduce(x), 2 * (n - 1) / n),
               "all_gather": (lambda: dist.all_gather_into_tensor(out_ag, x), (n - 1) / n),
               "reduce_scatter": (lambda: dist.reduce_scatter_tensor(out_rs, x), (n - 1) / n)}
        for name, (fn, factor) in ops.items():
            for _ in range(3):
                fn()
            times = []
            for _ in range(10):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                fn()
                e.record()
                torch.cuda.synchronize()
                times.append(s.elapsed_time(e) / 1e3)
            t = statistics.median(times)
            # nccl-tests' sizes: all-reduce and reduce-scatter count the input, all-gather the output
            nbytes = size * (n if name == "all_gather" else 1)
            rows.append(dict(op=name, bytes=nbytes, time_s=t, algbw_GBps=nbytes / t / 1e9,
                             busbw_GBps=nbytes / t / 1e9 * factor))
    if rank == 0:
        print(json.dumps(dict(world=n, gpu=torch.cuda.get_device_name(0), torch=torch.__version__,
                              nccl=".".join(map(str, torch.cuda.nccl.version())),
                              date=time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                              command=f"torchrun --nproc_per_node {n} scripts/nccl_sweep.py", rows=rows), indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
