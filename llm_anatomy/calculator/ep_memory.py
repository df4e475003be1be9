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
from llm_anatomy.config import ModelConfig, Run


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


def ep_phases(cfg: ModelConfig, run: Run, ep: int, *, rank: int = 0, hist=None, optimizer: str = "adamw",
              device: str = "cuda") -> dict:
    """Bytes rank `rank` holds at each phase boundary of a training step after the first, and the step's peak (an
    upper bound: peak_bound). run is the rank's batch; hist as expert_parallel.received_rows takes it (None:
    balanced)."""
    ep_calc.check(cfg, run, ep, rank)
    rnd = _rounder(device)
    pb = BYTES[param_dtype_name(run)]
    u = _units(cfg, ep, rank, rnd, pb)
    L = cfg.layers
    experts = [prod(s) for _, s in ep_calc.local_experts(cfg, ep)]
    params = u["root"]["P"] + L * u["block"]["P"] + L * sum(rnd(n * pb) for n in experts)
    grads = u["root"]["S"] + L * u["block"]["S"] + L * sum(rnd(n * pb) for n in experts)
    opt = sum(_state(optimizer, n, pb, rnd) for n in u["root"]["n"]) + L * sum(
        _state(optimizer, n, pb, rnd) for n in u["block"]["n"] + experts)
    inputs = 2 * rnd(8 * run.tokens)
    mesh = rnd(MESH_RANK_BYTES * ep)
    base = params + opt + inputs + mesh
    saved = _saved(cfg, run, ep, rank, hist, rnd)
    fwd_end = base + sum(saved.values()) + rnd(4) + u["root"]["G"]
    out = dict(params=params, grads=grads, optimizer=opt, inputs=inputs, mesh=mesh, saved=saved,
               gathered=u["root"]["G"], received=ep_calc.received_rows(cfg, run, ep, hist)[rank],
               forward_end=fwd_end, backward_end=base + grads, optimizer_end=base)
    out.update(peak_bound(cfg, run, ep, rank, out, u, device))
    return out


def peak_bound(cfg, run, ep, rank, ph, u, device) -> dict:
    return dict(peak=0, peak_at="forward", peak_candidates={})
