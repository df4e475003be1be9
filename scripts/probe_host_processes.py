"""Is a host-bound step's speed a property of the process? (issue 5: host-bound rows ran 15% under their
prediction in one run and 25% over in the next, on the same code, calibrate and probe being two processes)

Times calibrate's tiny host step (calibrate_host.measure_host_step: the probe's unmarked steps, 4 blocks
of 8 per variant) in one process, and prints one JSON line with the process's CPU affinity and the CPU
it ran on; run it in several processes in a row, each appending a line, and compare the spread between
processes with the spread within one (the blocks):

    for i in 1 2 3 4 5; do PYTHONPATH=. python3 scripts/probe_host_processes.py >> $OUT/host_processes.jsonl; done
    PYTHONPATH=. taskset -c 0-7 python3 scripts/probe_host_processes.py --tag pinned >> ...   # a CPU set
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch


def _cpu() -> int | None:
    """The CPU this thread last ran on (/proc/self/stat field 39)."""
    try:
        return int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[36])
    except (OSError, IndexError, ValueError):
        return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="probe_host_processes")
    ap.add_argument("--tag", default="")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_host_processes: error: needs a CUDA GPU", file=sys.stderr)
        return 2
    from anatomy.measure.calibrate_host import measure_host_step

    t0 = time.time()
    hs = measure_host_step()
    print(json.dumps(dict(tag=a.tag, pid=os.getpid(), affinity=sorted(os.sched_getaffinity(0)),
                          cpu=_cpu(), start=t0,
                          date=time.strftime("%Y-%m-%d %H:%M:%S %Z", time.gmtime(t0)), gpu=torch.cuda.get_device_name(0),
                          torch=torch.__version__, cuda=torch.version.cuda,
                          command="PYTHONPATH=. python3 scripts/probe_host_processes.py " + " ".join(sys.argv[1:]),
                          **{v: hs[v] for v in ("baseline", "efficient")})), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
