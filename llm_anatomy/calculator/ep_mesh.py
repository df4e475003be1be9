"""One rank of an expert-parallel mesh as `anatomy plan` prices it: its step time and its heaviest rank's peak.
Pure Python: no torch.

The mesh, distributed/expert_parallel.py's: dp ranks, FSDP2 over all of them on every tensor but the experts; the
experts split over ep ranks (ep divides dp and the experts), ep innermost (consecutive ranks: an ep group stays
inside a node whenever ep divides the GPUs per node). ep = dp is the 1-D composition; ep < dp the 2-D mesh
(efsdp, ep), efsdp = dp / ep: each ep rank's El = E / ep experts FSDP2-sharded over its efsdp group (ranks ep apart,
spanning (efsdp - 1) ep + 1 consecutive ranks: one node only when dp fits in one).

Time of one step of a rank (T = micro-batch x seq tokens, N = T K rows sent, R the rows received: N under the
balanced histogram, the default):
  compute        the timing model's forward + backward of the one-process efficient model on the rank's T tokens
                 (its grouped GEMMs on N rows over all E experts: the same FLOPs as R = N rows over El experts, and
                 the weight reads of E experts where the rank reads El: an over-estimate, stated)
  all-to-all     per MoE layer, forward: the row counts (E int32), the routed rows (N H c), the expert outputs
                 (R H c); backward: the two row all-to-alls in reverse, and under recompute the checkpoint's
                 re-run of the forward's three; c the compute dtype (bf16 under amp). Each over the ep group's
                 slowest link (calculator/comm.py link(): NVLink inside a node, the NIC across), alpha + bytes
                 (ep - 1) / ep /
                 bandwidth (NCCL-tests' all-to-all bus factor). The engine runs them on the compute stream with
                 compute waiting for them: all exposed
  host sync      per MoE layer, forward: the split sizes are read on the host (all_to_all takes ints), so the
                 launch queue drains; the GPU then idles while the host issues the next op: the profile's host_op_s
                 + launch_s
  FSDP2          expert_parallel.collectives' FSDP rows: the units without the experts over dp, and (ep < dp) the
                 experts units' all-gathers (forward, backward) and reduce-scatters over efsdp, on their group's
                 link (its span), all overlapped with the compute by comm.overlap's FSDP rule (one comm stream:
                 they serialize)
  optimizer      the whole model's optimizer time / dp (each rank steps 1 / dp of the rest and of the experts: 1 / ep
                 of them sharded over efsdp)
Memory: ep_memory.ep_phases of rank 0 on device "cuda" (the heaviest under any routing the planner fits: the
default balanced histogram, the same on every rank; `skewed_peak` is the worst rank's under skewed routing).
"""
from __future__ import annotations

from functools import lru_cache

from llm_anatomy.calculator import comm
from llm_anatomy.calculator.sharding import BYTES
from llm_anatomy.config import ConfigError, ModelConfig, Run


def check(cfg: ModelConfig, run: Run, ep: int, dp: int) -> None:
    """mesh_rules.check_ep (via expert_parallel.check), ep dividing the FSDP ranks, and what ep_memory models
    (ep_memory.check_modelled: every dtype and recompute the engine runs, the plain block)."""
    from llm_anatomy.calculator.ep_memory import check_modelled
    from llm_anatomy.calculator.expert_parallel import check as check_ep

    check_ep(cfg, run, ep)
    check_modelled(run)
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < ep or dp % ep:
        raise ConfigError(f"ep={ep} must divide the ranks FSDP shards over, dp={dp}")


def all_to_all_time(nbytes: int, ep: int, gpu: str, gpus_per_node: int) -> float:
    """Seconds of one all-to-all of `nbytes` (its input) over ep consecutive ranks: alpha-beta over the group's
    slowest link, (ep - 1) / ep of the buffer leaving each rank."""
    if ep == 1:
        return 0.0
    lk = comm.link(gpu, ep if ep <= gpus_per_node else gpus_per_node + 1, gpus_per_node)
    return lk["alpha_us"] * 1e-6 + nbytes * (ep - 1) / ep / (lk["GBps"] * 1e9)


def all_to_alls(cfg: ModelConfig, run: Run, ep: int, gpu: str, gpus_per_node: int, hist=None) -> dict:
    """Seconds of one step's all-to-alls on the rank that receives the most rows, forward and backward (rows in the
    compute dtype: bf16 under amp, FSDP2's gathered parameters; under recompute the checkpoint's re-run sends the
    forward's three again in backward)."""
    from llm_anatomy.calculator.dtypes import dtypes
    from llm_anatomy.calculator.expert_parallel import received_rows

    c, H, L = BYTES[dtypes(run).compute], cfg.hidden, cfg.layers
    N, R = run.tokens * cfg.experts_per_token, max(received_rows(cfg, run, ep, hist))
    t = lambda n: all_to_all_time(n, ep, gpu, gpus_per_node)  # noqa: E731
    fwd = L * (t(cfg.experts * 4) + t(N * H * c) + t(R * H * c))
    bwd = L * (t(R * H * c) + t(N * H * c)) + (fwd if run.recompute != "none" else 0.0)
    return dict(forward_s=fwd, backward_s=bwd)


def host_syncs(cfg: ModelConfig, gpu: str) -> float:
    """Seconds the GPU idles per step at the MoE layers' host syncs: one per layer, the next op's host issue time
    and launch (the profile's host_op_s and launch_s)."""
    from llm_anatomy.calculator.timing import lookup

    prof = lookup.get(gpu)
    return cfg.layers * (prof["host_op_s"] + prof["launch_s"])


def step_time(cfg: ModelConfig, run: Run, gpu: str, ep: int, dp: int, *, gpus_per_node: int = 8,
              optimizer: str = "adamw") -> dict:
    """Seconds of one step of a rank and where they go (module docstring). run is the rank's micro-batch."""
    check(cfg, run, ep, dp)
    return dict(_step(cfg, run, gpu, ep, dp, gpus_per_node, optimizer))


@lru_cache(maxsize=1024)
def _step(cfg, run, gpu, ep, dp, gpus_per_node, optimizer) -> tuple:
    from llm_anatomy.calculator.expert_parallel import expert_collectives, units

    t = _compute(cfg, run, gpu, optimizer)
    fb = t["steady"]["forward_backward_s"]
    ph = t["phases"]
    a2a = all_to_alls(cfg, run, ep, gpu, gpus_per_node)
    sync = host_syncs(cfg, gpu)
    rows = comm.fsdp_collectives(cfg, run, dp, unit_shapes=units(cfg))
    f = dp // ep  # efsdp
    rows += [dict(r, world=f, span=(f - 1) * ep + 1) for r in expert_collectives(cfg, run, ep, dp if f > 1 else None)]
    compute = dict(forward=ph["forward"]["gpu_s"], backward=ph["backward"]["gpu_s"])
    fsdp = comm.overlap("fsdp", rows, dp, compute, gpu, gpus_per_node)["exposed_s"] if dp > 1 else 0.0
    opt = t["optimizer_s"] / dp
    step = fb + a2a["forward_s"] + a2a["backward_s"] + sync + fsdp + opt
    return tuple(dict(step_s=step, compute_s=fb, ep_comm_s=a2a["forward_s"] + a2a["backward_s"], host_sync_s=sync,
                      dp_exposed_s=fsdp, optimizer_s=opt, model_flops=t["mfu"]["model"]
                      * t["forward_backward_s"] * t["mfu"]["peak_flops"]).items())


@lru_cache(maxsize=256)
def _compute(cfg: ModelConfig, run: Run, gpu: str, optimizer: str) -> dict:
    """The timing model's step of the one-process efficient model on the rank's tokens (the same for every ep)."""
    from llm_anatomy.calculator.timing import estimate_time

    return estimate_time(cfg, run, "efficient", gpu=gpu, optimizer=optimizer)


def rank_peak(cfg: ModelConfig, run: Run, ep: int, dp: int, *, optimizer: str = "adamw", hist=None) -> dict:
    """{peak, peak_at} of the heaviest rank on CUDA: ep_memory.ep_phases of rank 0 (the FSDP shards' first rank, of
    the rest over dp and of the experts over efsdp, holds the most rows; under a skewed histogram rank 0 receives
    the most), FSDP2 over dp ranks."""
    check(cfg, run, ep, dp)
    return dict(_peak(cfg, run, ep, dp, optimizer, None if hist is None else tuple(hist)))


@lru_cache(maxsize=4096)
def _peak(cfg, run, ep, dp, optimizer, hist) -> tuple:
    from llm_anatomy.calculator.ep_memory import ep_phases

    ph = ep_phases(cfg, run, ep, rank=0, hist=None if hist is None else list(hist), optimizer=optimizer,
                   device="cuda", dp=dp)
    return tuple(dict(peak=ph["peak"], peak_at=ph["peak_at"]).items())


def skewed_peak(cfg: ModelConfig, run: Run, ep: int, dp: int, *, optimizer: str = "adamw") -> int:
    """The worst rank's peak when every token routes to experts 0..K-1 (calculator/moe.py skewed): rank 0 receives
    ep x N rows."""
    from llm_anatomy.calculator.moe import skewed

    return rank_peak(cfg, run, ep, dp, optimizer=optimizer, hist=skewed(cfg, run))["peak"]
