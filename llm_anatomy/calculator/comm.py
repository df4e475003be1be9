"""Collectives of one data-parallel training step (DDP or FSDP2), their time, and what stays exposed.

Pure Python: no torch. `estimate_distributed()` is the entry point; per-rank memory, and the buffers the collectives
use (dtypes, DDP's buckets), are in sharding.py, which never imports this module.

Byte convention (NCCL-tests', so times compare with their bus bandwidth): `bytes_each` is the size
of the full buffer of one call: all-gather -> its output (W x the input), reduce-scatter -> its
input (W x the output), all-reduce and broadcast -> the buffer. This is exactly what the
measured side reads off the c10d op's tensors.

DDP (torch 2.13, nn/parallel/distributed.py + c10d reducer.cpp), find_unused_parameters=False:
  step 1   one all-reduce of every gradient: the initial bucket limit is sys.maxsize, "we don't do
           bucketing [before] the parameters are in the real execution order";
  step 2   the reducer rebuilds buckets in gradient-ready order, and rank 0 broadcasts them: two
           int32 broadcasts, (n_tensors + 1) indices then (n_buckets) sizes. Then the new buckets;
  step 3+  the rebuilt buckets only.
  Rebuilt buckets (compute_bucket_assignment_by_size): walk the gradients in ready order, add
  each one's bytes, close the bucket once it reaches the limit; limits are [1 MiB, 25 MiB] by
  default (first bucket small so the first all-reduce starts early), [cap, cap] when
  bucket_cap_mb is given. The ready order of these models is exactly the reverse of
  registration order (validated by the claims: a wrong order would move the bucket edges).
FSDP2 (fully_shard per Block, then the root; torch 2.13 _fsdp_collectives.py):
  forward   one all-gather per unit (root first), dtype = mp param_dtype (else the storage dtype);
  backward  one all-gather per Block when reshard_after_forward (the root is never resharded
            after forward: it would be gathered again at once), one reduce-scatter per unit,
            dtype = mp reduce_dtype, else the param_dtype. No all-reduce (that is HSDP).
  Each unit's buffer is the sum of its padded shards (sharding.py) x W. On one rank, none at all.
"""
from __future__ import annotations

from llm_anatomy.calculator import gpus
from llm_anatomy.calculator.fsdp_shards import shard_numel
from llm_anatomy.calculator.sharding import (DEFAULT_BUCKET_CAP_MB, DTYPE_BYTES, FIRST_BUCKET_BYTES,  # noqa: F401
                                         REDUCE_DTYPES, check_world, ddp_bucket_limits, ddp_bucket_runs, fsdp_dtypes,
                                         fsdp_unit_shapes, n_tensors, param_dtype_name, per_rank_memory, per_rank_peak,
                                         shape_counts)
from llm_anatomy.config import ConfigError, ModelConfig, Run


# ---- links: per-direction bandwidth and collective latency per GPU come from the one GPU table
# (llm_anatomy/calculator/gpus.py), each with its source.


def bus_factor(op: str, world: int) -> float:
    """NCCL-tests' busBw / algBw: the fraction of `bytes_each` that crosses each GPU's slowest link
    in a ring (doc/PERFORMANCE.md of nccl-tests): all-reduce 2(n-1)/n; all-gather and
    reduce-scatter (n-1)/n; broadcast 1."""
    n = world
    return {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n,
            "broadcast": 1.0}[op]


def link(gpu: str, world: int, gpus_per_node: int = 8) -> dict:
    """The ring's slowest link for `world` ranks of `gpu`, `gpus_per_node` to a node: inside a node NVLink
    where the part has it, else its PCIe link; once the ring spans nodes, the slower of that and the GPU's
    inter-node NIC (a DGX's per-GPU NIC, or an assumed one: gpus.NIC_ASSUMED). {name, GBps, alpha_us, source}."""
    e = _profile(gpu)
    if e["nvlink_GBps"]:
        intra = dict(name="nvlink", GBps=e["nvlink_GBps"], source=e["link_source"])
    else:
        intra = dict(name="pcie", GBps=e["pcie_GBps"], source=e["pcie_source"])
    if world <= gpus_per_node:
        return dict(intra, alpha_us=e["alpha_intra_us"])
    nic = dict(name="ib", GBps=e["ib_GBps"], source=e["link_source"]) if e["ib_GBps"] else \
        dict(name="network", GBps=25.0, source=gpus.NIC_ASSUMED)
    slow = min((nic, intra), key=lambda x: x["GBps"])
    return dict(slow, name=f"{slow['name']} (across nodes)", alpha_us=e["alpha_inter_us"])


def collective_time(op: str, nbytes: int, world: int, gpu: str = "h200-sxm", gpus_per_node: int = 8,
                    span: int | None = None) -> float:
    """Seconds of one collective: alpha + bytes x bus factor / link bandwidth (alpha-beta model), over
    the ring's slowest link (link()). span: the consecutive ranks the group's ring covers (a strided group, as
    expert parallel's efsdp, covers more than its world), world by default."""
    if world == 1:
        return 0.0
    lk = link(gpu, world if span is None else span, gpus_per_node)
    return lk["alpha_us"] * 1e-6 + nbytes * bus_factor(op, world) / (lk["GBps"] * 1e9)


def _profile(gpu: str) -> dict:
    """The GPU table's entry for a name, an alias or a profile name (a ConfigError in one line if none)."""
    k = gpus.base_key(gpu)
    if k is None:
        raise ConfigError(f"unknown gpu {gpu!r}; choose from {', '.join(gpus.GPUS)}")
    return gpus.entry(k)


# ---- which collectives ------------------------------------------------------------------------
def _row(op, phase, units, count, nbytes, dtype) -> dict:
    return dict(op=op, phase=phase, units=units, count=count, bytes_each=nbytes, dtype=dtype)


def ddp_collectives(cfg: ModelConfig, run: Run, *, step: int | None = None,
                    bucket_cap_mb: float | None = None) -> list[dict]:
    """DDP's collectives in training step `step` (1-based; None = steady state, step 3 on)."""
    dt = param_dtype_name(run)
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 1):
        raise ConfigError(f"step must be a positive integer, got {step!r}")
    if step == 1:
        total = sum(_numel(s) * k for s, k in shape_counts(cfg)) * DTYPE_BYTES[dt]
        return [_row("all_reduce", "backward", "all", 1, total, dt)]
    runs = ddp_bucket_runs(cfg, run, bucket_cap_mb)  # consecutive equal buckets: one run, one row
    rows = []
    if step == 2:
        rows += [_row("broadcast", "forward", "bucket indices", 1, (n_tensors(cfg) + 1) * 4, "int32"),
                 _row("broadcast", "forward", "bucket sizes", 1, sum(k for _, k in runs) * 4, "int32")]
    first = 0
    for b, k in runs:
        units = f"bucket {first}" if k == 1 else f"buckets {first}..{first + k - 1}"
        rows.append(_row("all_reduce", "backward", units, k, b, dt))
        first += k
    return rows


def fsdp_collectives(cfg: ModelConfig, run: Run, world_size: int, *, param_dtype: str | None = None,
                     reduce_dtype: str | None = None, reshard_after_forward: bool = True,
                     unit_shapes=None) -> list[dict]:
    """FSDP2's collectives in one training step (every step is the same). unit_shapes: the units' tensors as
    fsdp_unit_shapes gives them (default: the model's; tensor parallel passes its TP-local shapes)."""
    dts = fsdp_dtypes(run, param_dtype, reduce_dtype)
    W = world_size
    if W == 1:  # FSDP2 skips its collectives when there is no one to talk to
        return []
    numel = {name: sum(shard_numel(s, W, 0)[1] for _, s in ps)  # padded
             for name, ps in (unit_shapes or fsdp_unit_shapes(cfg))}
    ag, rs = DTYPE_BYTES[dts["all_gather"]], DTYPE_BYTES[dts["reduce"]]
    root, block, L = numel["root"], numel["block"], cfg.layers
    rows = [_row("all_gather", "forward", "root", 1, W * root * ag, dts["all_gather"]),
            _row("all_gather", "forward", "layers.*", L, W * block * ag, dts["all_gather"])]
    if reshard_after_forward:
        rows.append(_row("all_gather", "backward", "layers.*", L, W * block * ag, dts["all_gather"]))
    rows += [_row("reduce_scatter", "backward", "layers.*", L, W * block * rs, dts["reduce"]),
             _row("reduce_scatter", "backward", "root", 1, W * root * rs, dts["reduce"])]
    return rows


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def collective_counts(rows: list[dict]) -> dict[tuple[str, str, int], int]:
    """{(op, dtype, bytes_each): count}: the form the measured side is compared in."""
    out: dict[tuple[str, str, int], int] = {}
    for r in rows:
        key = (r["op"], r["dtype"], r["bytes_each"])
        out[key] = out.get(key, 0) + r["count"]
    return out


# ---- time and overlap -------------------------------------------------------------------------
def _compute_seconds(cfg: ModelConfig, run: Run, gpu: str, mfu: float, variant: str = "baseline") -> dict:
    """Forward and backward seconds of one rank's micro-batch at `mfu` of the bf16 peak (model FLOPs)."""
    from llm_anatomy.calculator import estimate

    f = estimate(cfg, run, variant).to_dict()["flops"]["model"]
    peak = _profile(gpu)["bf16_tflops"] * 1e12 * mfu  # the GPU table's dense bf16 peak
    return dict(forward=f["forward"] / peak, backward=f["backward"] / peak)


def overlap(strategy: str, rows: list[dict], world: int, compute_s: dict, gpu: str, gpus_per_node: int) -> dict:
    """Comm time, and the part of it compute does not hide. One comm stream, so collectives serialize.

    DDP: buckets all-reduce while backward runs, except the last (it is ready only when backward
    ends); warm-up broadcasts are exposed. FSDP: the root's forward all-gather has nothing to hide
    behind; Block all-gathers are prefetched under forward (and backward) compute; the root's
    reduce-scatter runs after the last gradient. exposed = those tails + whatever comm exceeds the
    compute of its phase. A row may carry its own group: "world" (its ranks) and "span" (collective_time's)."""
    t = [(r, collective_time(r["op"], r["bytes_each"], r.get("world", world), gpu, gpus_per_node, r.get("span")))
         for r in rows]
    total = sum(x * r["count"] for r, x in t)
    fwd_c, bwd_c = compute_s["forward"], compute_s["backward"]
    if strategy == "ddp":
        ar = [(x, r["count"]) for r, x in t if r["op"] == "all_reduce"]  # a row per run of equal buckets
        other = sum(x * r["count"] for r, x in t if r["op"] != "all_reduce")
        tail = ar[-1][0] if ar else 0.0
        exposed = other + tail + max(0.0, sum(x * k for x, k in ar) - tail - bwd_c)
    else:
        head = sum(x for r, x in t if r["phase"] == "forward" and r["units"] == "root")
        tail = sum(x for r, x in t if r["op"] == "reduce_scatter" and r["units"] == "root")
        fwd = sum(x * r["count"] for r, x in t if r["phase"] == "forward" and r["units"] != "root")
        bwd = sum(x * r["count"] for r, x in t if r["phase"] == "backward" and r["units"] != "root")
        exposed = head + tail + max(0.0, fwd - fwd_c) + max(0.0, bwd - bwd_c)
    return dict(time_s=total, exposed_s=exposed, compute_s=dict(compute_s))


# ---- the entry point --------------------------------------------------------------------------
def estimate_distributed(cfg: ModelConfig, run: Run, world_size: int, strategy: str, *, rank: int = 0,
                         optimizer: str = "adamw", param_dtype: str | None = None, reduce_dtype: str | None = None,
                         reshard_after_forward: bool = True, bucket_cap_mb: float | None = None,
                         step: int | None = None, gpu: str = "h200-sxm", gpus_per_node: int = 8, mfu: float = 0.4,
                         compute_s: dict | None = None, variant: str = "baseline", device: str = "cuda") -> dict:
    """Per-rank memory and per-step communication of data-parallel training. JSON-able.

    run is one rank's micro-batch. param_dtype / reduce_dtype are FSDP's MixedPrecisionPolicy
    (None: the policy's default, see fsdp_dtypes); bucket_cap_mb and step are DDP's. compute_s
    ({"forward": s, "backward": s}) overrides the FLOPs / (peak x mfu) compute-time estimate used
    by the overlap model. `peak` is sharding.per_rank_peak (the step's largest bytes on this rank, with
    activations and communication buffers) for the setup llm_anatomy.distributed.wrap() makes by default;
    None under other FSDP or DDP options. `summary` is what render_distributed() prints.
    """
    check_world(cfg, world_size, strategy)
    if not isinstance(reshard_after_forward, bool):
        raise ConfigError(f"reshard_after_forward must be true or false, got {reshard_after_forward!r}")
    if isinstance(gpus_per_node, bool) or not isinstance(gpus_per_node, int) or gpus_per_node < 1:
        raise ConfigError(f"gpus_per_node must be a positive integer, got {gpus_per_node!r}")
    if strategy == "ddp" and (param_dtype is not None or reduce_dtype is not None):
        raise ConfigError("param_dtype and reduce_dtype are fsdp options; ddp follows the run's dtype policy")
    if strategy == "fsdp" and bucket_cap_mb is not None:
        raise ConfigError("bucket_cap_mb is a ddp option; fsdp communicates one buffer per unit")
    mem = per_rank_memory(cfg, run, world_size, strategy, rank=rank, optimizer=optimizer)
    if strategy == "ddp":
        rows = ddp_collectives(cfg, run, step=step, bucket_cap_mb=bucket_cap_mb)
        dts = dict(param=param_dtype_name(run), all_reduce=param_dtype_name(run))
        # with gradient_as_bucket_view=False (the default) the reducer's buckets are a second copy
        mem["ddp_bucket_buffers"] = mem["grads"]
    else:
        rows = fsdp_collectives(cfg, run, world_size, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                                reshard_after_forward=reshard_after_forward)
        dts = fsdp_dtypes(run, param_dtype, reduce_dtype)
    if compute_s is None:
        if not 0 < mfu <= 1:
            raise ConfigError(f"mfu must be in (0, 1], got {mfu!r}")
        compute_s = _compute_seconds(cfg, run, gpu, mfu, variant)
    comm = overlap(strategy, rows, world_size, compute_s, gpu, gpus_per_node)
    lk = link(gpu, world_size, gpus_per_node)
    comm.update(count_total=sum(r["count"] for r in rows), bytes_total=sum(r["count"] * r["bytes_each"] for r in rows),
                gpu=gpus.base_key(gpu), link=lk["name"], link_GBps=lk["GBps"], link_source=lk["source"],
                gpus_per_node=gpus_per_node)
    defaults = param_dtype is None and reduce_dtype is None and reshard_after_forward and bucket_cap_mb is None
    peak = per_rank_peak(cfg, run, variant, world_size, strategy, optimizer=optimizer, rank=rank,
                         device=device) if defaults else None
    out = dict(config=cfg.name, run=dict(batch=run.batch, seq=run.seq, dtype=run.dtype), world_size=world_size,
               strategy=strategy, rank=rank, optimizer=optimizer, dtypes=dts,
               memory={**{k: mem[k] for k in ("params", "grads", "optimizer")},
                       "total": mem["params"] + mem["grads"] + mem["optimizer"],
                       **({"ddp_bucket_buffers": mem["ddp_bucket_buffers"]} if strategy == "ddp" else {})},
               collectives=rows, comm=comm, peak=peak)
    out["summary"] = summarize(out)
    return out


def summarize(d: dict) -> dict:
    """The short form of estimate_distributed's result: per-rank bytes by kind at the step's peak, the
    collectives per step by op and phase, comm time, exposed and overlapped."""
    by: dict[tuple[str, str], list] = {}
    for r in d["collectives"]:
        k = (r["op"], r["phase"])
        calls, nbytes = by.get(k, [0, 0])
        by[k] = [calls + r["count"], nbytes + r["count"] * r["bytes_each"]]
    c, pk = d["comm"], d["peak"]
    return dict(strategy=d["strategy"], world_size=d["world_size"], rank=d["rank"], gpu=c["gpu"],
                gpus_per_node=c["gpus_per_node"], link=c["link"], link_GBps=c["link_GBps"],
                peak_bytes=pk["peak"] if pk else None, peak_at=pk["peak_at"] if pk else None,
                per_rank=pk["by_kind"] if pk else {k: d["memory"][k] for k in ("params", "grads", "optimizer")},
                collectives=[dict(op=op, phase=ph, calls=n, bytes=b) for (op, ph), (n, b) in by.items()],
                comm_s=c["time_s"], exposed_s=c["exposed_s"], overlapped_s=c["time_s"] - c["exposed_s"],
                compute_s=c["compute_s"]["forward"] + c["compute_s"]["backward"])


def render_distributed(d: dict) -> str:
    """estimate_distributed's result as a short text table (GiB = 2^30 B, GB = 1e9 B); the full list of
    collectives is in the JSON."""
    s = d["summary"] if "summary" in d else summarize(d)
    gib = lambda n: f"{n / 2**30:,.2f}"  # noqa: E731
    lines = [f"{s['strategy']} on {s['world_size']} ranks, rank {s['rank']}: {s['gpu']}, {s['gpus_per_node']} per node, "
             f"ring over {s['link']} at {s['link_GBps']:g} GB/s per direction"]
    title = f"per-rank memory at the step's peak ({s['peak_at']})" if s["peak_bytes"] else "per-rank memory (model states)"
    lines += [title, f"  {'kind':<22}{'GiB':>10}"]
    lines += [f"  {k.replace('_', ' '):<22}{gib(v):>10}" for k, v in s["per_rank"].items() if v]
    lines.append(f"  {'total':<22}{gib(s['peak_bytes'] or sum(s['per_rank'].values())):>10}")
    lines += ["collectives per step", f"  {'op':<16}{'phase':<10}{'calls':>7}{'GB':>10}"]
    lines += [f"  {r['op']:<16}{r['phase']:<10}{r['calls']:>7}{r['bytes'] / 1e9:>10,.3f}" for r in s["collectives"]]
    lines.append(f"comm {s['comm_s'] * 1e3:,.1f} ms per step: {s['exposed_s'] * 1e3:,.1f} ms exposed, "
                 f"{s['overlapped_s'] * 1e3:,.1f} ms under compute ({s['compute_s'] * 1e3:,.1f} ms, alpha-beta model)")
    return "\n".join(lines)
