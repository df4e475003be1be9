"""Expert parallel (EP) for the efficient mixture-of-experts block, composed with FSDP2 over the same ranks.

    mesh = ep_mesh(world, ep)          # 1-D ("ep",) when ep = world, else 2-D ("efsdp", "ep"), ep innermost
    parallelize_experts(model, mesh)   # each rank: experts [e E/ep, (e+1) E/ep) of its ep rank e; FSDP2 the rest

ep = world (torchtitan's composition when its dp_shard equals ep): one 1-D mesh "ep" of every rank.
  experts     ExpertParallel, a ParallelStyle applied by parallelize_module to each block's Experts: rank r keeps
              rows [r El, (r+1) El) of the stacked (E, 2I, H) / (E, H, I) tensors (and biases), El = E / ep, as plain
              local parameters; FSDP2 leaves them alone (ignored_params), so no collective ever reads them whole.
              Their gradients sum the contributions of every rank's tokens, so a hook divides them by ep: the
              mean over ranks that FSDP2's reduce-scatter gives every other parameter.
  the rest    FSDP2 (fully_shard) on every Block and the root, as distributed/strategies.py wraps a model.

ep < world, ep | world (torchtitan's dp_shard_mod_ep layout): a 2-D mesh (efsdp, ep), world = efsdp x ep, ep
innermost, so global rank g is ep rank g % ep and efsdp rank g // ep (an ep group is ep consecutive ranks; the
efsdp group of g strides ep).
    world 8, ep 4:   ep ->   0 1 2 3        experts [0,El) [El,2El) [2El,3El) [3El,E) on columns 0..3
                 efsdp       4 5 6 7        each column's El experts FSDP2-sharded over its 2 ranks
  experts     ExpertParallel over mesh["ep"] as above; then fully_shard on each block's Experts over mesh["efsdp"]:
              FSDP2's dim-0 shards of the El rows (torch.chunk rows, each rank allocating the padded chunk,
              calculator/fsdp_shards.py; dim 1 where El < efsdp: strategies.shard_placement), gathered for the
              Experts' forward (and again for backward when resharded) and reduce-scattered after. A rank's
              expert gradient before the reduce-scatter sums what every rank of its ep group routed there (the
              all-to-alls' backward); the reduce-scatter sums that over efsdp,
              and FSDP2's own set_gradient_divide_factor(world) divides by world: the mean over every rank's
              tokens, what one process takes. No hook: FSDP2 owns these gradients. gloo has no PREMUL_SUM, so on a
              CPU mesh (gloo) set_force_sum_reduction_for_comms(True) makes it a SUM reduce-scatter and a division
              of the output (FSDP2's post-divide); on NCCL FSDP2 reduces with PREMUL_SUM(1 / world).
  the rest    FSDP2 on every Block and the root over the flattened mesh (DeviceMesh._flatten("dp"), torch 2.13:
              one 1-D mesh of every rank, its own process group), so every other parameter is sharded over world.

One block's forward on a rank (T local tokens, N = T K slots, E experts, El = E / ep, c the compute dtype):
    xs (N, H) sorted by global expert (efficient/moe.py: the experts of rank d are contiguous, so are its rows)
    counts (E,) int32 rows per expert -> all-to-all (equal splits) -> got (E,): got[s El + e] rows rank s sends
        to local expert e; both split lists read on the host (the one sync EP needs: all_to_all takes ints)
    xr = all_to_all(xs)                                    (R, H)  grouped by source rank, then local expert
    xl = xr sorted by local expert (Permute, k = 1)         (R, H)  efficient/moe.py's permutation on (R, 1)
    yl = Experts.forward(xl, offs_local, dt)               (R, H)  the grouped GEMMs (or the loop) on El experts
    yr = yl[pos]                                            (R, H)  back to arrival order
    y  = all_to_all(yr) with the splits swapped             (N, H)  back in xs's order, for the unpermute
The all-to-alls are torch's autograd-enabled functional collectives: backward runs each in reverse.

Saved per block beyond the local experts' own tensors on R rows: pos (R,) int64 (the local permute and the
unsort keep the same tensor); the all-to-alls keep nothing (their backward needs only the split sizes).

Recompute (Run.recompute "mlp" or "full"): the block's non-reentrant checkpoint holds the whole exchange, so it
keeps only its inputs. Its re-run in backward passes through these hooks again up to the early stop, which lies
past the combine (the unpermute, or the shared experts' down, saves last): the counts, rows and outputs are sent
again. The re-run routes the same input, so every rank sends the same splits; were they to differ, a saved
tensor's shape would too, which the checkpoint's determinism check refuses.

dtype amp: FSDP2's MixedPrecisionPolicy (bf16 gathers, fp32 reduce-scatters) on the rest, no autocast. ep = world:
the experts it ignores stay fp32: MoE computes in its router's dtype (bf16 under the policy) and Experts.forward
casts each stacked tensor to it for its GEMM, as the one-process block does under autocast; the gradients come
back through the casts in fp32 and are divided by ep, never reduced. ep < world: the experts are an FSDP2 unit
under the same policy, gathered in bf16 (Experts.forward's casts are then no-ops) and reduce-scattered in fp32.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from llm_anatomy.config import ConfigError, ModelConfig, Run
from llm_anatomy.distributed.strategies import shard_placement
from llm_anatomy.efficient.moe import Experts, Permute, permutation
from llm_anatomy.mesh_rules import check_ep

MESH_DIM = "ep"
EFSDP_DIM = "efsdp"  # the ranks of one ep rank, sharding its experts (ep < world)
DP_DIM = "dp"  # the flattened mesh of every rank, FSDP2's on the rest (ep < world)


class ExpertParallel(ParallelStyle):
    """Keep this rank's experts and move each token row to the rank holding its expert and back (module
    docstring). Applied to one Experts module; its forward hooks carry the split sizes from dispatch to combine."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, Experts):
            raise ConfigError(f"ExpertParallel applies to an Experts module, not {type(module).__name__}")
        ep, r = device_mesh.size(), device_mesh.get_local_rank()
        El = module.gate_up.shape[0] // ep
        for name, p in list(module.named_parameters(recurse=False)):
            module.register_parameter(name, nn.Parameter(p.detach()[r * El:(r + 1) * El].clone()))
        self.group = device_mesh.get_group()
        module.register_forward_pre_hook(self._dispatch)
        module.register_forward_hook(self._combine)
        return module

    def _dispatch(self, module: Experts, args: tuple) -> tuple:
        xs, offs, dt = args  # xs (N, H) sorted by global expert, offs (E,) int32 global row ends
        El = module.gate_up.shape[0]
        ep = offs.numel() // El
        counts = torch.diff(offs, prepend=offs.new_zeros(1))  # (E,) int32 rows per expert
        got = funcol.all_to_all_single(counts, None, None, self.group).wait()  # (E,): [source rank, local expert]
        send = counts.view(ep, El).sum(1).tolist()  # rows to each rank (host)
        recv = got.view(ep, El).sum(1).tolist()  # rows from each rank (host)
        xr = funcol.all_to_all_single_autograd(xs, recv, send, self.group)  # (R, H)
        expert = torch.arange(El, device=xs.device).repeat(ep).repeat_interleave(got.long())  # (R,) local expert
        order, pos, offs_local = permutation(expert.view(-1, 1), El)
        self._back = (pos, send, recv)
        return Permute.apply(xr, order, pos, 1), offs_local, dt

    def _combine(self, module: Experts, args: tuple, yl: torch.Tensor) -> torch.Tensor:
        pos, send, recv = self._back
        self._back = None
        yr = yl.index_select(0, pos)  # (R, H) in arrival order; keeps pos, the same storage Permute keeps
        return funcol.all_to_all_single_autograd(yr, send, recv, self.group)  # (N, H)


def expert_params(model: nn.Module) -> list[nn.Parameter]:
    return [p for m in model.modules() if isinstance(m, Experts) for p in m.parameters(recurse=False)]


def ep_mesh(world: int, ep: int) -> DeviceMesh:
    """The CPU mesh of `world` ranks for expert parallel over ep (module docstring): 1-D ("ep",) when ep = world,
    else 2-D ("efsdp", "ep") with ep innermost."""
    from torch.distributed.device_mesh import init_device_mesh

    if ep == world:
        return init_device_mesh("cpu", (ep,), mesh_dim_names=(MESH_DIM,))
    return init_device_mesh("cpu", (world // ep, ep), mesh_dim_names=(EFSDP_DIM, MESH_DIM))


def parallelize_experts(model: nn.Module, mesh: DeviceMesh, *, reshard_after_forward: bool = True,
                        amp: bool = False) -> nn.Module:
    """Expert parallel on every MoE block of the efficient Transformer `model` over `mesh` (ep_mesh's), FSDP2 on
    everything else over every rank (module docstring). The weights must be the same on every rank. amp: FSDP2's
    MixedPrecisionPolicy (bf16 gathers, fp32 reduce-scatters) on the rest; ep = world: the experts stay fp32 and
    Experts.forward casts them to the router's bf16; ep < world: the experts' FSDP2 unit takes the same policy."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if amp else MixedPrecisionPolicy()
    if mesh.ndim == 1:
        ep_group, dp = mesh, mesh
    else:
        ep_group, dp = mesh[MESH_DIM], mesh._flatten(DP_DIM)
    for block in model.layers:
        parallelize_module(block, ep_group, {"mlp.experts": ExpertParallel()})
    ignored = set()
    if mesh.ndim == 1:
        ignored = set(expert_params(model))
        for p in ignored:  # the mean over ranks FSDP2 takes of every other gradient
            p.register_hook(lambda g, ep=mesh.size(): g / ep)
    else:
        cpu = mesh.device_type == "cpu"  # gloo's, whatever its options: no PREMUL_SUM
        for block in model.layers:
            experts = fully_shard(block.mlp.experts, mesh=mesh[EFSDP_DIM], reshard_after_forward=reshard_after_forward,
                                  mp_policy=mp, shard_placement_fn=shard_placement(mesh[EFSDP_DIM].size()))
            experts.set_gradient_divide_factor(float(mesh.size()))  # the mean over every rank's tokens
            if cpu:  # gloo has no PREMUL_SUM: a SUM reduce-scatter, then FSDP2 divides the output
                experts.set_force_sum_reduction_for_comms(True)
    place = shard_placement(dp.size())
    for block in model.layers:
        fully_shard(block, mesh=dp, reshard_after_forward=reshard_after_forward, mp_policy=mp,
                    ignored_params={p for p in block.parameters() if p in ignored}, shard_placement_fn=place)
    fully_shard(model, mesh=dp, reshard_after_forward=False, mp_policy=mp, ignored_params=ignored,
                shard_placement_fn=place)
    return model


def build(cfg: ModelConfig, run: Run, *, seed: int = 0, route: str | None = None,
          ep: int | None = None) -> tuple[nn.Module, DeviceMesh]:
    """The efficient model on the initialized process group, expert parallel over ep ranks (every rank by default;
    ep < world: the (efsdp, ep) mesh), the same weights on each before the split; route forces every router
    (measure/routing.py: "balanced", "skewed")."""
    import torch.distributed as dist

    from llm_anatomy.models import build_model

    world = dist.get_world_size()
    ep = world if ep is None else ep
    check_ep(cfg, run, ep, world=world)
    model = build_model(cfg, "efficient", dtype=torch.bfloat16 if run.dtype == "bf16" else None, seed=seed,
                        recompute=run.recompute)
    if route is not None:
        from llm_anatomy.measure.routing import force

        force(route)(model)
    mesh = ep_mesh(world, ep)
    return parallelize_experts(model, mesh, amp=run.dtype == "amp"), mesh


def train(cfg: ModelConfig, run: Run, *, steps: int = 2, optimizer: str = "adamw", lr: float = 1e-3, seed: int = 0,
          route: str | None = None, ep: int | None = None) -> list[dict]:
    """`steps` steps of expert parallel over ep ranks (build's) on the initialized (gloo) process group, each rank
    its own batch; one record
    per step: loss, collectives [[op, dtype, bytes, calls], ...] of forward + backward + optimizer step, memory
    {params, grads, optimizer} after the step (local storage), and in step 1 saved {component: bytes}."""
    import torch.distributed as dist

    from llm_anatomy.distributed.counting import CollectiveCounter, rank_memory
    from llm_anatomy.distributed.tp_saved import LocalSavedTracer
    from llm_anatomy.distributed.train_step import make_optimizer
    from llm_anatomy.models import make_batch

    model, _ = build(cfg, run, seed=seed, route=route, ep=ep)
    opt = make_optimizer(optimizer, model.parameters(), lr)
    ids, targets = make_batch(cfg, run, seed=seed + 1 + dist.get_rank())
    records = []
    for step in range(1, steps + 1):
        with CollectiveCounter() as counter:
            with LocalSavedTracer(model) if step == 1 else contextlib.nullcontext() as tr:
                loss = model(ids, targets)
            loss.backward()
            opt.step()
        rec = dict(step=step, loss=float(loss.detach().float()), memory=rank_memory(model, opt),
                   collectives=[[*k, n] for k, n in sorted(counter.counts().items())])
        opt.zero_grad(set_to_none=True)
        if tr is not None:
            rec["saved"] = tr.report.by_component()  # storage bytes this rank saved for backward
        records.append(rec)
    return records
