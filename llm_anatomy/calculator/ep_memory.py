"""The memory phases of one rank under expert parallel over ep of dp ranks, FSDP2 over all dp ranks on the rest
(llm_anatomy/distributed/expert_parallel.py; dp = ep is its 1-D composition, dp > ep its (efsdp, ep) mesh, efsdp =
dp / ep, each ep rank's experts FSDP2-sharded over efsdp). Pure Python: no torch.

Notation as calculator/expert_parallel.py's: T = batch x seq tokens per rank, K experts per token, N = T K rows
a rank sends per MoE layer, E experts, El = E / ep per rank, c the compute dtype's bytes, R_d the rows rank d
receives per MoE layer (received_rows: N on every rank under the balanced histogram; ep x N on rank 0 under the
skewed one, every token to experts 0..K-1, which is the worst rank of any routing). Each tensor is rounded to the
allocator's 512-byte blocks on device "cuda" and counted at its storage bytes on "cpu" (what live storage counts).

Phase boundaries of a step after the first (the optimizer state exists), exact on gloo (validations/
test_ep_memory.py for dp = ep, test_ep_memory_dp.py for dp > ep), under every dtype and recompute the engine runs:
  state           parameters: FSDP2's padded dim-0 shards of every non-expert tensor, each its own storage, and the
                  El local experts' rows of each stacked tensor (dp > ep: their padded dim-0 shards over efsdp,
                  each its own storage; fp32 under amp too, FSDP2's shards); optimizer state: AdamW's two moments and
                  a step per tensor (of the shards' real rows, calculator/sharding.py), SGD none; the (B, S) int64 ids and
                  targets; the DeviceMesh's rank tensor (dp int32: the DTensors keep the mesh alive; the (efsdp, ep)
                  mesh, its sub-meshes and its flattened one share it). All in the
                  storage dtype: fp32 under amp (FSDP2's MixedPrecisionPolicy keeps fp32 shards, the ignored experts
                  stay fp32), bf16 under bf16
  forward end     state + every tensor the rank saves for backward (expert_parallel.moe_saved on R_d rows and El
                  experts; the other components the one-process efficient model's on T tokens as the rank computes
                  them, bf16 under amp, with each Block's bf16 copy of the fp32 RoPE tables; under amp the experts'
                  bf16 weight casts, which their GEMMs save; under recompute "mlp" / "full" only the checkpoints'
                  kept inputs, every other tensor, the casts and the exchange's included, living inside them) + the
                  loss (an fp32 scalar) + the root's unsharded parameters in the all-gather dtype (bf16 under amp:
                  FSDP2 does not reshard the root after forward)
  backward end    state + the gradients: one flat reduce-scatter output per FSDP unit (the padded shards, in the
                  storage dtype: amp reduces in fp32) and the local experts' gradients (dp = ep: each its own
                  tensor, fp32 under amp, back through the casts; dp > ep: the experts unit's flat reduce-scatter
                  output, its padded shards); every bf16 buffer (gathered parameters, unsharded
                  gradients, the casts and their gradients) is gone
  (efsdp shards: dim 0's padded rows, or dim 1 where El < efsdp, fsdp_shards.fsdp_shard_dim)
  optimizer end   the gradients set to None: state
The step's peak is an upper bound (peak_bound below), stated with its measured slack in the test.
Not modelled (check_modelled): the lean block, which expert parallel does not build.
"""
from __future__ import annotations

from dataclasses import replace
from math import prod

from llm_anatomy.calculator import expert_parallel as ep_calc
from llm_anatomy.calculator.fsdp_shards import fsdp_shard_dim, shard_numel
from llm_anatomy.calculator.sharding import BYTES, param_dtype_name
from llm_anatomy.calculator.tp_memory import MESH_RANK_BYTES, _rounder, _state
from llm_anatomy.calculator.types import ROPE_TABLES
from llm_anatomy.config import ConfigError, ModelConfig, Run


def _units(cfg: ModelConfig, run: Run, ep: int, rank: int, rnd) -> dict:
    """Per FSDP unit ("root", "block"), one instance: P the padded shards (each its own tensor) and S the flat
    gradient, in the storage dtype; G the unsharded parameters, F the all-gather's flat output, C the all-gather
    inputs' casts (amp: each shard cast to bf16, each its own tensor; else none) and U the unsharded gradients,
    in the all-gather dtype; R the reduce-scatter's flat input in the reduce dtype; n the shards' real elements per
    tensor (the optimizer state's)."""
    from llm_anatomy.calculator.sharding import DTYPE_BYTES, fsdp_dtypes

    pb = BYTES[param_dtype_name(run)]
    dts = fsdp_dtypes(run)
    ag, rs = DTYPE_BYTES[dts["all_gather"]], DTYPE_BYTES[dts["reduce"]]
    out = {}
    for unit, shapes in ep_calc.units(cfg):
        sh = [shard_numel(s, ep, rank) for _, s in shapes]
        padded = sum(pa for _, pa in sh)
        out[unit] = dict(P=sum(rnd(pa * pb) for _, pa in sh), S=rnd(padded * pb),
                         G=sum(rnd(ep * pa * ag) for _, pa in sh), F=rnd(ep * padded * ag),
                         C=sum(rnd(pa * ag) for _, pa in sh) if ag != pb else 0, R=rnd(ep * padded * rs),
                         U=sum(rnd(prod(s) * ag) for _, s in shapes), n=[lo for lo, _ in sh])
    return out


def _saved(cfg: ModelConfig, run: Run, ep: int, rank: int, hist, rnd, layers: int | None = None,
           world: int | None = None) -> dict[str, int]:
    """{component: bytes} the rank saves for backward, each tensor rounded (without the ids and targets, which are
    the inputs themselves): expert_parallel.saved's rule (the one-process efficient model's as the rank computes it,
    under amp each Block's bf16 copy of the fp32 RoPE tables, "moe" from moe_saved; under recompute the
    checkpoints' kept inputs). layers=1: one layer's share of every per-layer tensor (count // L), the others
    whole."""
    L = cfg.layers if layers is None else layers
    from llm_anatomy.calculator import estimate
    from llm_anatomy.calculator.backward import INPUTS

    def size(s) -> int:
        if run.dtype == "amp" and s.name in ROPE_TABLES and s.dtype == "float32":
            return rnd(prod(s.shape) * BYTES["bfloat16"]) * L
        n = s.count if layers is None else max(1, s.count * layers // cfg.layers)
        return rnd(prod(s.shape) * BYTES[s.dtype]) * n

    out = {}
    for name, comp in estimate(cfg, ep_calc.compute_run(run), "efficient", device="cpu").components.items():
        ss = ep_calc.moe_saved(cfg, run, ep, rank, hist, "cpu", world) if name == "moe" else comp.saved
        out[name] = sum(size(s) for s in ss if s.name not in INPUTS)
    return out


def check_modelled(run: Run) -> None:
    """ConfigError (one line) for what these phases do not model: the lean block (Run.lean without recompute),
    which expert parallel does not build (distributed/expert_parallel.py builds the plain efficient block)."""
    if run.lean_block:
        raise ConfigError("expert parallel builds the plain efficient block, not the lean one (lean=true without "
                          "recompute)")


def ep_phases(cfg: ModelConfig, run: Run, ep: int, *, rank: int = 0, hist=None, optimizer: str = "adamw",
              device: str = "cuda", dp: int | None = None) -> dict:
    """Bytes rank `rank` holds at each phase boundary of a training step after the first, and the step's peak (an
    upper bound: peak_bound). run is the rank's batch; hist as expert_parallel.received_rows takes it (None:
    balanced). dp: the ranks FSDP2 shards the rest over, ep by default (the engine's 1-D composition); a multiple of
    ep is the (efsdp, ep) mesh, efsdp = dp / ep, rank then the global rank (its ep rank rank % ep)."""
    world = None if dp is None or dp == ep else dp  # the (efsdp, ep) mesh when dp > ep
    ep_calc.check(cfg, run, ep, rank, world)
    check_modelled(run)
    dp = ep if dp is None else dp
    rnd = _rounder(device)
    pb = BYTES[param_dtype_name(run)]
    u = _units(cfg, run, dp, rank, rnd)
    L = cfg.layers
    own = ep_calc.expert_shards(cfg, ep, world, rank)  # (held, padded) elements per local expert tensor
    params = u["root"]["P"] + L * u["block"]["P"] + L * sum(rnd(pa * pb) for _, pa in own)
    experts_grads = sum(rnd(pa * pb) for _, pa in own) if world is None else rnd(sum(pa for _, pa in own) * pb)
    grads = u["root"]["S"] + L * u["block"]["S"] + L * experts_grads
    opt = sum(_state(optimizer, n, pb, rnd) for n in u["root"]["n"]) + L * sum(
        _state(optimizer, n, pb, rnd) for n in u["block"]["n"] + [lo for lo, _ in own])
    inputs = 2 * rnd(8 * run.tokens)
    mesh = rnd(MESH_RANK_BYTES * dp)
    base = params + opt + inputs + mesh
    saved = _saved(cfg, run, ep, rank, hist, rnd, world=world)
    fwd_end = base + sum(saved.values()) + rnd(4) + u["root"]["G"]
    out = dict(params=params, grads=grads, optimizer=opt, inputs=inputs, mesh=mesh, saved=saved,
               gathered=u["root"]["G"], received=ep_calc.received_rows(cfg, run, ep, hist)[rank % ep],
               forward_end=fwd_end, backward_end=base + grads, optimizer_end=base)
    out.update(peak_bound(cfg, run, ep, dp, rank, out, u, device, hist))
    return out


def peak_bound(cfg: ModelConfig, run: Run, ep: int, dp: int, rank: int, ph: dict, u: dict, device: str,
               hist=None) -> dict:
    """The step's peak on the rank, an upper bound: the largest of three candidates, each the exact bytes it starts
    from plus the transients of the one-process efficient model on the rank's local view (local_view: El experts,
    min(K, El) per token, the same T tokens, memory.phases with optimizer None) and of the rows it receives:
      forward   forward end + one Block's gathered parameters and all-gather buffer twice where there are two
                Blocks (the Block running and the one prefetched; dp > ep: the experts unit's too, as many) + a
                unit's all-gather inputs cast to bf16 (amp) + the dim-1 experts' copy-out temporaries
                + the largest of the loss's transients (the one-process forward peak over its forward end on CUDA;
                on CPU, where that is not modelled, three (T, V) fp32 tensors: the logits, their exp and their
                gradient), the MoE block's on R_d rows (moe_transients) and, under recompute, one layer's tensors
                inside its checkpoint (what each component the checkpoint changes saves without recompute) with
                the larger of the MoE block's transients and, under "full", memory._block_forward_peak's on the
                local view;
      backward  the exact state, the root's gathered parameters, every saved tensor (the most activations a
                backward moment holds), the larger of the local view's largest gradient / backward buffers over its
                walk's stages (every gradient autograd has made by then, unsharded: FSDP2's unsharded gradients are
                those) and every gradient of the rank, FSDP2's buffers (two Blocks' gathered parameters where there
                are two, a unit's reduce-scatter input, twice on CPU where gloo reduces a copy, a unit's bf16
                casts under amp; dp > ep: the experts unit's gathered parameters beside the Blocks', and its
                reduce-scatter input among the units', and a dim-1 experts unit's copy-out temporaries, which
                also bound its re-chunked gradient's original), the router's (T, E) tensors the local view prices
                at El columns, the MoE backward's transients on the rows past the local view's (moe_transients); under
                recompute one layer's tensors made again (as in forward) beside the largest of the backward's, the
                re-run's MoE and, under "full", the re-run block's transients; under amp a local expert tensor's
                bf16 cast gradient and the fp32 one the ep hook divides (_expert_cast_grads; dp = ep). The local
                view runs as the rank computes (expert_parallel.compute_run: amp as bf16, FSDP2's unsharded
                gradients being bf16), under the run's recompute; under amp its walk's gradients count every
                layer's local expert gradients at fp32 (_expert_grads_fp32; dp = ep: for dp > ep they are FSDP2's
                bf16 unsharded gradients, as the walk prices them);
      optimizer backward end + the optimizer step's temporaries (torch's per-tensor AdamW on CPU: two of the
                largest local tensor; fused AdamW on CUDA: none)."""
    from llm_anatomy.calculator.memory import _block_forward_peak, phases

    rnd = _rounder(device)
    T, E = run.tokens, cfg.experts
    local, crun = local_view(cfg, ep), ep_calc.compute_run(run)
    one = phases(local, crun, "efficient", optimizer=None, device=device)
    loss = ((one["forward_peak"] - one["forward_end"]) if one["forward_peak"] is not None
            else 3 * rnd(T * cfg.vocab * 4))
    fwd_moe, bwd_moe = moe_transients(cfg, run, ep, ph["received"], rnd)
    blk, root = u["block"], u["root"]
    world = None if dp == ep else dp
    ex = _expert_unit(cfg, run, ep, world, rnd)
    held = min(2, cfg.layers)  # the Block running and the one prefetched
    cast = max(root["C"], blk["C"], ex["C"])  # amp: a unit's all-gather inputs cast to bf16
    # recompute: one layer's tensors made again inside its checkpoint (held through the block's backward: every
    # component the checkpoint changes, whole) beside the larger of the re-run's transients and the backward's
    layer = region = 0
    if run.recompute != "none":
        kept = _saved(cfg, run, ep, rank, hist, rnd, layers=1, world=world)
        remade = _saved(cfg, replace(run, recompute="none"), ep, rank, hist, rnd, layers=1, world=world)
        layer = sum(b for name, b in remade.items() if b != kept[name])
        region = _block_forward_peak(local, crun, device, rnd) if run.recompute == "full" else 0
    forward = (ph["forward_end"] + held * (blk["G"] + blk["F"] + ex["G"] + ex["F"]) + cast + ex["T"]
               + max(loss, fwd_moe + layer, layer + region))
    copy = 2 if device == "cpu" else 1
    # ex T: a dim-1 experts unit's copy-out temporaries, which also bound its re-chunked gradient's original
    fsdp = held * (blk["G"] + ex["G"]) + copy * max(root["R"], blk["R"], ex["R"]) + cast + ex["T"]
    router = 4 * rnd(T * E * 4)
    walk = max(st["by_kind"]["gradient / backward buffer"] for st in one["backward_stages"])
    grads = max(walk + (_expert_grads_fp32(cfg, run, ep, rnd) if world is None else 0), ph["grads"])
    backward = (ph["optimizer_end"] + ph["gathered"] + sum(ph["saved"].values()) + rnd(4) + grads + fsdp + router
                + layer + max(bwd_moe, fwd_moe if layer else 0, region)
                + (_expert_cast_grads(cfg, run, ep, rnd) if world is None else 0))
    optimizer = ph["backward_end"] + _optimizer_temporaries(cfg, run, ep, dp, rank, device, rnd)
    cands = dict(forward=forward, backward=backward, optimizer=optimizer)
    at = max(cands, key=cands.get)
    return dict(peak=cands[at], peak_at=at, peak_candidates=cands)


def _expert_unit(cfg: ModelConfig, run: Run, ep: int, world: int | None, rnd) -> dict:
    """One block's experts unit's FSDP2 buffers (dp > ep; zeros when world is None), as _units gives a unit's: G
    the unsharded parameters and F the all-gather's flat output in the all-gather dtype, C its inputs' bf16 casts
    (amp), R the reduce-scatter's flat input in the reduce dtype; f = efsdp ranks. El < efsdp shards the stacked
    tensors on dim 1 (fsdp_shards.fsdp_shard_dim): T their copy-out temporaries (all-gather dtype)."""
    from llm_anatomy.calculator.sharding import DTYPE_BYTES, fsdp_dtypes

    if world is None:
        return dict(G=0, F=0, C=0, R=0, T=0)
    f, pb, dts = ep_calc.efsdp_of(ep, world), BYTES[param_dtype_name(run)], fsdp_dtypes(run)
    ag, rs = DTYPE_BYTES[dts["all_gather"]], DTYPE_BYTES[dts["reduce"]]
    shapes = [s for _, s in ep_calc.local_experts(cfg, ep)]
    pads = [shard_numel(s, f, 0)[1] for s in shapes]
    return dict(G=sum(rnd(f * pa * ag) for pa in pads), F=rnd(f * sum(pads) * ag),
                C=sum(rnd(pa * ag) for pa in pads) if ag != pb else 0, R=rnd(f * sum(pads) * rs),
                T=sum(rnd(prod(s) * ag) for s in shapes if fsdp_shard_dim(s, f)))


def _expert_grads_fp32(cfg: ModelConfig, run: Run, ep: int, rnd) -> int:
    """amp: what every layer's local expert gradients hold in fp32 beyond the bf16 the local view's walk prices
    them at (they come back through the casts); 0 otherwise."""
    if run.dtype != "amp":
        return 0
    return cfg.layers * sum(rnd(prod(s) * 4) - rnd(prod(s) * 2) for _, s in ep_calc.local_experts(cfg, ep))


def _expert_cast_grads(cfg: ModelConfig, run: Run, ep: int, rnd) -> int:
    """amp: a local expert tensor's gradient through its bf16 cast, the cast's bf16 gradient and the fp32 one the ep
    hook divides into a new tensor, of the largest local expert tensor; 0 otherwise."""
    if run.dtype != "amp":
        return 0
    n = max(prod(s) for _, s in ep_calc.local_experts(cfg, ep))
    return rnd(n * BYTES["bfloat16"]) + rnd(n * 4)


def local_view(cfg: ModelConfig, ep: int) -> ModelConfig:
    """The one-process model whose walk prices a rank's non-expert transients: El experts, min(K, El) per token."""
    El = cfg.experts // ep
    return replace(cfg, experts=El, experts_per_token=min(cfg.experts_per_token, El), name=f"{cfg.name} ep-local")


def moe_transients(cfg: ModelConfig, run: Run, ep: int, R: int, rnd) -> tuple[int, int]:
    """(forward, backward) bytes one MoE layer makes beyond its saved tensors on a rank receiving R rows, c the
    compute dtype:
      forward   the one-process block's routing state and router logits (moe_efficient.efficient_moe_transients on
                the rank's T tokens), the received rows xr and their local sort xl (R, H) each, the expert
                output yl and its arrival-order copy yr (R, H), the combined y (N, H) and the row counts;
      backward  the same gradients on the R rows past the local view's T min(K, El): d(y) (R, H), d(h)
                (R, I), d(xs) (R, H), and the all-to-alls' buffers d(yr), d(xl), d(xr) (R, H) and d(y),
                d(xs) (N, H) on the send side.
    With expert biases under amp (the experts cast, so the bias folds: moe_efficient.FOLD columns) the forward adds
    the folded copies of the received rows (R, H + f) and of the larger stacked weight (El, 2I, H + f): the one-process
    transients at the rank's bf16 view hold the added biases' rows instead, so both are in the bound."""
    from llm_anatomy.calculator.moe_efficient import FOLD, efficient_moe_transients

    crun = ep_calc.compute_run(run)
    c = BYTES[param_dtype_name(crun)]
    T, H, I, K = run.tokens, cfg.hidden, cfg.expert_intermediate, cfg.experts_per_token
    N, El = T * K, cfg.experts // ep
    one = efficient_moe_transients(cfg, crun, device="cuda")
    routing = sum(rnd(v) for k, v in one.items() if k.startswith("forward."))
    counts = 2 * rnd(cfg.experts * 4)
    forward = routing + counts + 4 * rnd(R * H * c) + rnd(N * H * c)  # xr, xl, yl, yr; y
    if cfg.expert_bias and run.dtype == "amp":
        forward += rnd(R * (H + FOLD) * c) + rnd(El * 2 * I * (H + FOLD) * c)
    extra = max(0, R - T * min(K, El))
    backward = 2 * rnd(extra * H * c) + rnd(extra * I * c) + 3 * rnd(R * H * c) + 2 * rnd(N * H * c)
    return forward, backward


def _optimizer_temporaries(cfg: ModelConfig, run: Run, ep: int, dp: int, rank: int, device: str, rnd) -> int:
    """torch's per-tensor AdamW on CPU: exp_avg_sq.sqrt() and its quotient, two of the largest local tensor at once
    (fused AdamW on CUDA makes none)."""
    if device != "cpu":
        return 0
    largest = max([lo for _, shapes in ep_calc.units(cfg) for _, s in shapes for lo in [shard_numel(s, dp, rank)[0]]]
                  + [lo for lo, _ in ep_calc.expert_shards(cfg, ep, None if dp == ep else dp, rank)])
    return 2 * rnd(largest * BYTES[param_dtype_name(run)])
