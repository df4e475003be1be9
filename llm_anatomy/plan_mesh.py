"""`anatomy plan` over device meshes: dp x tp x pp, with micro-batch, recompute and pipeline schedule.

The meshes searched (calculator/mesh.py lays them out, times them and prices their heaviest rank):
  tp   a divisor of the GPUs per node that divides heads, kv heads and the MLP width: tensor parallel's
       per-layer collectives stay on NVLink;
  pp   a divisor of the rest, at most the layers; schedules 1F1B and interleaved 1F1B with 2 chunks per rank
       (where the layers allow);
  dp   the rest, FSDP2 over it on every stage.
Meshes with tp = pp = 1 are plain data parallelism, which llm_anatomy/plan.py plans (DDP and FSDP); this
module adds the others. Each mesh keeps the largest micro-batch whose heaviest rank fits the budget, then is
timed; the ranking is by tokens/s. Without a global batch, a pipeline runs 4 x pp micro-batches per step (a
1F1B bubble of at most 1/5) and the rest one micro-batch per step.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import lru_cache

from llm_anatomy.calculator import mesh as mesh_model
from llm_anatomy.config import ConfigError, ModelConfig, Run

PARTS = ("compute", "bubble", "tp_comm", "p2p", "ep_comm", "host_sync", "dp_exposed", "optimizer")
NAMES = dict(compute="compute", bubble="pipeline bubble", tp_comm="tensor-parallel comm", p2p="stage sends",
             ep_comm="expert-parallel all-to-alls", host_sync="MoE host syncs",
             dp_exposed="exposed data-parallel comm", optimizer="optimizer")
MICROBATCHES_PER_STAGE = 4  # micro-batches per pipeline stage without a global batch


@dataclass(frozen=True)
class MeshCandidate:
    mesh: str
    dp: int
    tp: int
    pp: int
    ep: int
    schedule: str | None
    virtual: int
    recompute: str
    lean: bool
    micro_batch: int
    microbatches: int  # per optimizer step and pipeline (per dp rank)
    peak_bytes: int
    step_s: float
    tokens_per_s: float
    mfu: float
    parts: dict  # seconds: compute, bubble, tp_comm, p2p, ep_comm, host_sync, dp_exposed, optimizer
    skewed_peak_bytes: int | None = None  # expert parallel: the worst rank's peak under skewed routing


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def meshes(cfg: ModelConfig, gpus_n: int, gpus_per_node: int) -> list[mesh_model.Mesh]:
    """Every dp x tp x pp mesh of gpus_n GPUs the model can be split over, except plain data parallelism; for a
    mixture of experts the expert-parallel meshes instead: dp = gpus_n and every ep >= 2 dividing both the GPUs and
    the experts, largest first, the layouts the engine runs (distributed/expert_parallel.py: ep = dp its 1-D
    composition, ep < dp the (efsdp, ep) mesh, the experts FSDP2-sharded over efsdp = dp / ep)."""
    if cfg.moe:
        return [mesh_model.Mesh(gpus_n, ep=ep) for ep in reversed(_divisors(gpus_n))
                if ep > 1 and cfg.experts % ep == 0]
    out = []
    for tp in _divisors(min(gpus_per_node, gpus_n)):
        if gpus_n % tp or cfg.heads % tp or cfg.kv_heads % tp or cfg.intermediate % tp or (cfg.moe and tp > 1):
            continue
        for pp in _divisors(gpus_n // tp):
            if pp > cfg.layers or (tp == 1 and pp == 1):
                continue
            dp = gpus_n // (tp * pp)
            if pp == 1:
                out.append(mesh_model.Mesh(dp, tp, 1))
                continue
            out.append(mesh_model.Mesh(dp, tp, pp, "1f1b", 1))
            if 2 * pp <= cfg.layers:
                out.append(mesh_model.Mesh(dp, tp, pp, "interleaved-1f1b", 2))
    return out


@lru_cache(maxsize=4096)
def _time(cfg, run, variant, gpu, m, microbatches, gpus_per_node, optimizer) -> dict:
    return mesh_model.step_time(cfg, run, variant, gpu, m, microbatches, gpus_per_node=gpus_per_node,
                                optimizer=optimizer)


def _microbatches(m: mesh_model.Mesh, b: int, global_batch: int | None) -> int:
    if global_batch is None:
        return MICROBATCHES_PER_STAGE * m.pp if m.pp > 1 else 1
    return global_batch // m.dp // b


def _fitting_micro_batch(cfg, m, mk, variant, budget, optimizer, global_batch, largest) -> int:
    """The largest micro-batch whose heaviest rank fits (dividing the rank's share of a global batch, with at
    least pp micro-batches), 0 if none."""
    def need(b):
        return mesh_model.rank_peak(cfg, mk(b), variant, m, _microbatches(m, b, global_batch), optimizer=optimizer)

    if global_batch is None:
        return largest(lambda b: need(b) <= budget)
    share = global_batch // m.dp
    for b in sorted((d for d in _divisors(share) if share // d >= m.pp), reverse=True):
        try:
            if need(b) <= budget:
                return b
        except ConfigError:
            continue  # a micro-batch count the schedule refuses (interleaved 1F1B's rounds)
    return 0


def search(cfg: ModelConfig, *, gpu: str, seq: int, gpus_n: int, gpus_per_node: int, budget: int, variant: str,
           dtype: str, optimizer: str, recomputes: tuple[str, ...], lean: bool, global_batch: int | None,
           peak_flops: float, largest, untimed: list | None = None) -> list[dict]:
    """Every mesh candidate that fits and the profile times, fastest first. JSON-able. largest(fits): the largest
    micro-batch for which fits() holds, 0 if none (plan.py's search, bounded by its ceiling). untimed: where the
    reason a fitting mesh has no time on this profile goes (it is left out of the rows)."""
    rows = []
    for m in meshes(cfg, gpus_n, gpus_per_node):
        if global_batch is not None and global_batch % m.dp:
            continue
        for rc in recomputes:
            # the lean block runs without recompute on one process's layout only: tp, pp and ep build the plain
            # block (mesh_rules.check_efficient_tp, train/mesh.py, expert_parallel.build)
            lb = lean and variant == "efficient" and rc == "none" and m.tp == m.pp == m.ep == 1
            mk = lambda b: Run(batch=b, seq=seq, dtype=dtype, recompute=rc, lean=lb)  # noqa: E731
            try:
                b = _fitting_micro_batch(cfg, m, mk, variant, budget, optimizer, global_batch, largest)
            except ConfigError:
                continue  # a split the calculator refuses (e.g. a shard narrower than a head)
            if b == 0:
                continue
            k = _microbatches(m, b, global_batch)
            try:
                t = _time(cfg, mk(b), variant, gpu, m, k, gpus_per_node, optimizer)
            except ConfigError as e:  # it fits; the profile cannot time it (e.g. no masked-attention rows)
                if untimed is not None:
                    untimed.append(str(e))
                continue
            tokens = m.dp * k * b * seq / t["step_s"]
            parts = {p: t.get(f"{p}_s", 0.0) for p in PARTS}
            rows.append(MeshCandidate(m.label(), m.dp, m.tp, m.pp, m.ep, m.schedule if m.pp > 1 else None,
                                      m.virtual, rc,
                                      lb, b, k, mesh_model.rank_peak(cfg, mk(b), variant, m, k, optimizer=optimizer),
                                      t["step_s"], tokens, t["model_flops"] / t["step_s"] / peak_flops, parts,
                                      _skewed(cfg, mk(b), m, optimizer)))
    rows.sort(key=lambda r: -r.tokens_per_s)
    return [asdict(r) for r in rows]


def _skewed(cfg: ModelConfig, run: Run, m: mesh_model.Mesh, optimizer: str) -> int | None:
    if m.ep == 1:
        return None
    from llm_anatomy.calculator.ep_mesh import skewed_peak

    return skewed_peak(cfg, run, m.ep, m.dp, optimizer=optimizer)


def ep_refusals(cfg: ModelConfig, gpus_n: int, seq: int, dtype: str, variant: str, recomputes: tuple[str, ...],
                lean: bool) -> list[str]:
    """Why expert parallel was skipped, one line each (ep_mesh.check's words, or the rank's memory phases'):
    empty when some setting runs."""
    from llm_anatomy.calculator.ep_mesh import check, rank_peak

    eps = [m.ep for m in meshes(cfg, gpus_n, gpus_n)] if cfg.moe else []
    if not cfg.moe or not eps:
        return [] if not cfg.moe else [f"no ep >= 2 divides both --gpus {gpus_n} and experts={cfg.experts}"]
    why = []
    for rc in recomputes:
        run = Run(batch=1, seq=seq, dtype=dtype, recompute=rc)  # ep builds the plain block (search's lb)
        try:
            if variant != "efficient":
                raise ConfigError(f"expert parallel runs the efficient variant's MoE block, not {variant!r}")
            check(cfg, run, eps[0], gpus_n)
            rank_peak(cfg, run, eps[0], gpus_n)  # what the phases refuse (e.g. the loop of mm)
            return []
        except ConfigError as e:
            why.append(str(e))
    return list(dict.fromkeys(why))


def why(best: dict, others: list[dict]) -> list[str]:
    """Why the winner wins: where its step goes, and what the runner-up of another shape loses."""
    parts = best["parts"]
    total = best["step_s"]
    spent = ", ".join(f"{NAMES[k]} {parts.get(k, 0.0) / total:.0%}" for k in PARTS
                      if parts.get(k, 0.0) / total >= 0.005)
    lines = [f"its step: {spent}" + (f"; recompute {best['recompute']}" if best["recompute"] != "none" else "")]
    shape = lambda r: (r["tp"], r["pp"], r.get("ep", 1))  # noqa: E731
    rival = next((o for o in others if shape(o) != shape(best)), None)
    if rival is not None:
        share = lambda r, k: r["parts"].get(k, 0.0) / r["step_s"]  # noqa: E731
        loss = max(PARTS[1:-1] + ("compute",), key=lambda k: share(rival, k) - share(best, k))
        names = dict(bubble="its pipeline bubble", tp_comm="tensor-parallel communication", p2p="stage sends",
                     ep_comm="expert-parallel all-to-alls", host_sync="the MoE layers' host syncs",
                     dp_exposed="exposed data-parallel communication", compute="compute (a smaller micro-batch)")
        lines.append(f"next other shape, {rival['mesh']} ({rival['tokens_per_s']:,.0f} tokens/s, micro-batch "
                     f"{rival['micro_batch']}), loses most to {names[loss]} "
                     f"({share(rival, loss):.0%} of its step)")
    return lines
