"""The memory phases of one rank under expert parallel over ep ranks, FSDP2 over the same ranks on the rest
(llm_anatomy/distributed/expert_parallel.py). Pure Python: no torch.

Notation as calculator/expert_parallel.py's: T = batch x seq tokens per rank, K experts per token, N = T K rows
a rank sends per MoE layer, E experts, El = E / ep per rank, c the compute dtype's bytes, R_d the rows rank d
receives per MoE layer (received_rows: N on every rank under the balanced histogram; ep x N on rank 0 under the
skewed one, every token to experts 0..K-1, which is the worst rank of any routing). Each tensor is rounded to the
allocator's 512-byte blocks on device "cuda" and counted at its storage bytes on "cpu" (what live storage counts).

Phase boundaries of a step after the first (the optimizer state exists), exact on gloo (validations/
test_ep_memory.py):
  state           parameters: FSDP2's padded dim-0 shards of every non-expert tensor, each its own storage, and the
                  El local experts' rows of each stacked tensor; optimizer state: AdamW's two moments and a step per
                  tensor (of the shards' real rows, calculator/sharding.py), SGD none; the (B, S) int64 ids and
                  targets; the DeviceMesh's rank tensor (ep int32: the DTensors keep the mesh alive)
  forward end     state + every tensor the rank saves for backward (expert_parallel.moe_saved on R_d rows and El
                  experts; the other components the one-process efficient model's on T tokens) + the loss (an fp32
                  scalar) + the root's unsharded parameters (FSDP2 does not reshard the root after forward)
  backward end    state + the gradients: one flat reduce-scatter output per FSDP unit (the padded shards) and the
                  local experts' gradients, each its own tensor
  optimizer end   the gradients set to None: state
The step's peak is an upper bound (peak_bound below), stated with its measured slack in the test.
"""
from __future__ import annotations

from math import prod

from llm_anatomy.calculator import expert_parallel as ep_calc
from llm_anatomy.calculator.sharding import BYTES, param_dtype_name, shard_numel
from llm_anatomy.calculator.tp_memory import MESH_RANK_BYTES, _rounder, _state
from llm_anatomy.config import ConfigError, ModelConfig, Run


def _units(cfg: ModelConfig, ep: int, rank: int, rnd, pb: int) -> dict:
    """Per FSDP unit ("root", "block"), one instance: P the padded shards (each its own tensor), S the flat
    gradient, G the unsharded parameters, F the all-gather's flat output, R the reduce-scatter's flat input, U the
    unsharded gradients, n the shards' real elements per tensor (the optimizer state's)."""
    out = {}
    for unit, shapes in ep_calc.units(cfg):
        sh = [shard_numel(s, ep, rank) for _, s in shapes]
        padded = sum(pa for _, pa in sh)
        out[unit] = dict(P=sum(rnd(pa * pb) for _, pa in sh), S=rnd(padded * pb),
                         G=sum(rnd(ep * pa * pb) for _, pa in sh), F=rnd(ep * padded * pb), R=rnd(ep * padded * pb),
                         U=sum(rnd(prod(s) * pb) for _, s in shapes), n=[lo for lo, _ in sh])
    return out


def _saved(cfg: ModelConfig, run: Run, ep: int, rank: int, hist, rnd) -> dict[str, int]:
    """{component: bytes} the rank saves for backward, each tensor rounded (without the ids and targets, which are
    the inputs themselves)."""
    from llm_anatomy.calculator import estimate
    from llm_anatomy.calculator.backward import INPUTS

    out = {}
    for name, comp in estimate(cfg, run, "efficient", device="cpu").components.items():
        ss = ep_calc.moe_saved(cfg, run, ep, rank, hist, "cpu") if name == "moe" else comp.saved
        out[name] = sum(rnd(prod(s.shape) * BYTES[s.dtype]) * s.count for s in ss if s.name not in INPUTS)
    return out


def check_modelled(run: Run) -> None:
    """ConfigError (one line) for what these phases do not model: the engine runs amp and recompute under expert
    parallel (distributed/expert_parallel.py), but a rank's phases here are fp32 or bf16 without recompute."""
    if run.dtype == "amp" or run.recompute != "none":
        raise ConfigError(f"expert parallel's per-rank memory is modelled for fp32 and bf16 without recompute, not "
                          f"dtype={run.dtype}, recompute={run.recompute}")


def ep_phases(cfg: ModelConfig, run: Run, ep: int, *, rank: int = 0, hist=None, optimizer: str = "adamw",
              device: str = "cuda", dp: int | None = None) -> dict:
    """Bytes rank `rank` holds at each phase boundary of a training step after the first, and the step's peak (an
    upper bound: peak_bound). run is the rank's batch; hist as expert_parallel.received_rows takes it (None:
    balanced). dp: the ranks FSDP2 shards the rest over, ep by default (the engine's composition); a multiple of
    ep prices the planner's replicated expert groups (calculator/ep_mesh.py), rank then the FSDP rank."""
    ep_calc.check(cfg, run, ep, rank if dp is None else 0)
    check_modelled(run)
    dp = ep if dp is None else dp
    if isinstance(dp, bool) or not isinstance(dp, int) or dp % ep or not 0 <= rank < dp:
        raise ConfigError(f"dp={dp!r} must be a multiple of ep={ep}, and rank={rank!r} in [0, dp)")
    rnd = _rounder(device)
    pb = BYTES[param_dtype_name(run)]
    u = _units(cfg, dp, rank, rnd, pb)
    L = cfg.layers
    experts = [prod(s) for _, s in ep_calc.local_experts(cfg, ep)]
    params = u["root"]["P"] + L * u["block"]["P"] + L * sum(rnd(n * pb) for n in experts)
    grads = u["root"]["S"] + L * u["block"]["S"] + L * sum(rnd(n * pb) for n in experts)
    opt = sum(_state(optimizer, n, pb, rnd) for n in u["root"]["n"]) + L * sum(
        _state(optimizer, n, pb, rnd) for n in u["block"]["n"] + experts)
    inputs = 2 * rnd(8 * run.tokens)
    mesh = rnd(MESH_RANK_BYTES * dp)
    base = params + opt + inputs + mesh
    saved = _saved(cfg, run, ep, rank % ep, hist, rnd)
    fwd_end = base + sum(saved.values()) + rnd(4) + u["root"]["G"]
    out = dict(params=params, grads=grads, optimizer=opt, inputs=inputs, mesh=mesh, saved=saved,
               gathered=u["root"]["G"], received=ep_calc.received_rows(cfg, run, ep, hist)[rank % ep],
               forward_end=fwd_end, backward_end=base + grads, optimizer_end=base)
    out.update(peak_bound(cfg, run, ep, dp, rank, out, u, device))
    return out



def peak_bound(cfg: ModelConfig, run: Run, ep: int, dp: int, rank: int, ph: dict, u: dict, device: str) -> dict:
    """The step's peak on the rank, an upper bound: the largest of three candidates, each the exact bytes it starts
    from plus the transients of the one-process efficient model on the rank's local view (local_view: El experts,
    min(K, El) per token, the same T tokens, memory.phases with optimizer None) and of the rows it receives:
      forward   forward end + one Block's gathered parameters and all-gather buffer twice where there are two
                Blocks (the Block running and the one prefetched) + the larger of the loss's transients (the
                one-process forward peak over its forward end on CUDA; on CPU, where that is not modelled, three
                (T, V) fp32 tensors: the logits, their exp and their gradient) and the MoE block's on R_d rows
                (moe_transients);
      backward  the exact state, the root's gathered parameters, every saved tensor (the most activations a
                backward moment holds), the larger of the local view's largest gradient / backward buffers over its
                walk's stages (every gradient autograd has made by then, unsharded: FSDP2's unsharded gradients are
                those) and every gradient of the rank, FSDP2's buffers (two Blocks' gathered parameters where there
                are two, a unit's reduce-scatter input, twice on CPU where gloo reduces a copy), the router's
                (T, E) tensors the local view prices at El columns, and the MoE backward's transients on the rows
                past the local view's (moe_transients);
      optimizer backward end + the optimizer step's temporaries (torch's per-tensor AdamW on CPU: two of the
                largest local tensor; fused AdamW on CUDA: none)."""
    from llm_anatomy.calculator.memory import phases

    rnd = _rounder(device)
    T, E = run.tokens, cfg.experts
    one = phases(local_view(cfg, ep), run, "efficient", optimizer=None, device=device)
    loss = ((one["forward_peak"] - one["forward_end"]) if one["forward_peak"] is not None
            else 3 * rnd(T * cfg.vocab * 4))
    fwd_moe, bwd_moe = moe_transients(cfg, run, ep, ph["received"], rnd)
    blk, root = u["block"], u["root"]
    held = min(2, cfg.layers)  # the Block running and the one prefetched
    forward = ph["forward_end"] + held * (blk["G"] + blk["F"]) + max(loss, fwd_moe)
    copy = 2 if device == "cpu" else 1
    fsdp = held * blk["G"] + copy * max(root["R"], blk["R"])
    router = 4 * rnd(T * E * 4)
    walk = max(st["by_kind"]["gradient / backward buffer"] for st in one["backward_stages"])
    grads = max(walk, ph["grads"])
    backward = (ph["optimizer_end"] + ph["gathered"] + sum(ph["saved"].values()) + rnd(4) + grads + fsdp + router
                + bwd_moe)
    optimizer = ph["backward_end"] + _optimizer_temporaries(cfg, run, ep, dp, rank, device, rnd)
    cands = dict(forward=forward, backward=backward, optimizer=optimizer)
    at = max(cands, key=cands.get)
    return dict(peak=cands[at], peak_at=at, peak_candidates=cands)


def local_view(cfg: ModelConfig, ep: int) -> ModelConfig:
    """The one-process model whose walk prices a rank's non-expert transients: El experts, min(K, El) per token."""
    from dataclasses import replace

    El = cfg.experts // ep
    return replace(cfg, experts=El, experts_per_token=min(cfg.experts_per_token, El), name=f"{cfg.name} ep-local")


def moe_transients(cfg: ModelConfig, run: Run, ep: int, R: int, rnd) -> tuple[int, int]:
    """(forward, backward) bytes one MoE layer makes beyond its saved tensors on a rank receiving R rows, c the
    compute dtype, f the folded bias's columns (moe_efficient.FOLD where the grouped GEMM folds a bias):
      forward   the one-process block's routing state and router logits (moe_efficient.efficient_moe_transients on
                the rank's T tokens), the received rows xr and their local sort xl (R, H + f) each, the expert
                output yl and its arrival-order copy yr (R, H), the combined y (N, H) and the row counts;
      backward  the same gradients on the R rows past the local view's T min(K, El): d(y) (R, H), d(h)
                (R, I + f), d(xs) (R, H + f), and the all-to-alls' buffers d(yr), d(xl), d(xr) (R, H) and d(y),
                d(xs) (N, H) on the send side."""
    from llm_anatomy.calculator.moe_efficient import FOLD, efficient_moe_transients, grouped_path

    c = BYTES[param_dtype_name(run)]
    T, H, I, K = run.tokens, cfg.hidden, cfg.expert_intermediate, cfg.experts_per_token
    N, El = T * K, cfg.experts // ep
    f = FOLD if cfg.expert_bias and grouped_path(cfg, run, "cuda") else 0
    one = efficient_moe_transients(cfg, run, device="cuda")
    routing = sum(rnd(v) for k, v in one.items() if k.startswith("forward."))
    counts = 2 * rnd(cfg.experts * 4)
    forward = routing + counts + 2 * rnd(R * (H + f) * c) + 2 * rnd(R * H * c) + rnd(N * H * c)
    extra = max(0, R - T * min(K, El))
    backward = (rnd(extra * H * c) + rnd(extra * (I + f) * c) + rnd(extra * (H + f) * c) + 3 * rnd(R * H * c)
                + 2 * rnd(N * H * c))
    return forward, backward


def _optimizer_temporaries(cfg: ModelConfig, run: Run, ep: int, dp: int, rank: int, device: str, rnd) -> int:
    """torch's per-tensor AdamW on CPU: exp_avg_sq.sqrt() and its quotient, two of the largest local tensor at once
    (fused AdamW on CUDA makes none)."""
    if device != "cpu":
        return 0
    largest = max([lo for _, shapes in ep_calc.units(cfg) for _, s in shapes for lo in [shard_numel(s, dp, rank)[0]]]
                  + [prod(s) for _, s in ep_calc.local_experts(cfg, ep)])
    return 2 * rnd(largest * BYTES[param_dtype_name(run)])
