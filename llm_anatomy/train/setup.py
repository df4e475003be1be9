"""Where a run happens and what it trains: the process placement (one process, DDP or FSDP2 under
torchrun, or a tensor- / pipeline-parallel mesh: train/mesh.py), the model holding the baseline's initial weights, and the variant's optimizer.

Both variants start from the same weights for the same --seed: the efficient model loads the
baseline's initial state dict (its q/k/v and gate/up are fused, so its own init would draw the
same numbers in another layout).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from llm_anatomy.config import ConfigError, ModelConfig, Run
from llm_anatomy.models import build_model, param_dtype
from llm_anatomy.train.options import TrainOptions


@dataclass
class Placement:
    strategy: str  # none | ddp | fsdp | tp | pp (tp and pp: FSDP2 over dp when dp > 1)
    device: torch.device
    rank: int = 0
    world: int = 1
    owns_group: bool = False  # we initialised the process group, so we destroy it
    dp_rank: int = 0  # which batch this rank reads: the ranks of one TP group or one pipeline share it
    dp: int = 1  # data-parallel ranks: world / tp, world / pp, else world
    layout: str | None = None  # the mesh (train.mesh.layout) whose per-rank checkpoints this run writes and reads

    @property
    def loss_ranks(self) -> int:
        """How many ranks hold a copy of the batch loss (the last pipeline stage's ranks under PP, every rank else)."""
        return self.dp if self.strategy == "pp" else self.world


def launched_world() -> int:
    """The torchrun world size, 1 for one process."""
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    return int(os.environ.get("WORLD_SIZE", "1")) if launched else 1


def place(o: TrainOptions, variant: str) -> Placement:
    world = launched_world()
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    strategy = o.strategy
    if o.tp > 1 or o.pp > 1:
        strategy = "pp" if o.pp > 1 else "tp"  # train.mesh.check accepted the mesh; a pipeline holds TP inside
    elif strategy == "auto":
        strategy = "none" if world == 1 else ("ddp" if variant == "baseline" else "fsdp")
    if strategy == "none" and world > 1:
        raise ConfigError(f"--strategy none under torchrun with {world} ranks: pick ddp or fsdp (or auto)")
    cuda = torch.cuda.is_available() and o.device != "cpu"
    if strategy == "none":
        return Placement("none", torch.device("cuda" if cuda else "cpu"))
    if not launched:
        raise ConfigError(f"--strategy {strategy} needs several processes: launch with "
                          f"torchrun --nproc_per_node N -m llm_anatomy.cli train ...")
    try:
        from llm_anatomy.distributed.strategies import init_distributed
    except ImportError as e:
        raise ConfigError(f"distributed training needs llm_anatomy.distributed, which is unavailable: {e}") from None
    owns = not dist.is_initialized()
    init_distributed("nccl" if cuda else "gloo", 600.0)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    if strategy in ("tp", "pp"):
        from llm_anatomy.train import mesh

        dp_rank, dp = mesh.dp_coordinates(o)
        return Placement(strategy, device, rank, world, owns, dp_rank, dp, mesh.layout(o, world))
    return Placement(strategy, device, rank, world, owns, rank, world)


def init_model(cfg: ModelConfig, variant: str, device, dtype, seed: int, recompute: str = "none",
               lean: bool = False) -> torch.nn.Module:
    """The variant's model holding the baseline's initial weights for `seed` (same start for both);
    recompute and lean are Run.recompute and Run.lean (the efficient variant's)."""
    base = build_model(cfg, "baseline", device=device, dtype=dtype, seed=seed)
    if variant == "baseline":
        return base
    model = build_model(cfg, variant, device=device, dtype=dtype, seed=seed, recompute=recompute, lean=lean)
    model.load_state_dict(base.state_dict())  # the efficient model's pre-hook fuses q/k/v and gate/up
    return model


def make_optimizer(name: str, variant: str, model: torch.nn.Module, o: TrainOptions, device: torch.device):
    """The optimizer a step runs (llm_anatomy/calculator/optimizer.py: implementation() names the same ones, and
    times each). adamw: torch.optim.AdamW for either variant, fused on CUDA (one pass over each group of
    tensors: what users run), foreach elsewhere. ademamix: the baseline variant gets the readable
    per-parameter loop (llm_anatomy.optim.AdEMAMix), the efficient one the foreach step, compiled on CUDA
    (FusedAdEMAMix); T_alpha_beta3 = --steps, the paper's choice."""
    params = [p for p in model.parameters() if p.requires_grad]
    if name == "ademamix":
        from llm_anatomy.optim import AdEMAMix, FusedAdEMAMix

        cls = AdEMAMix if variant == "baseline" else FusedAdEMAMix
        return cls(params, lr=o.lr, weight_decay=o.weight_decay, T_alpha_beta3=o.steps)
    if name != "adamw":
        raise ConfigError(f"unknown optimizer {name!r}; choose adamw or ademamix")
    fused = device.type == "cuda"
    return torch.optim.AdamW(params, lr=o.lr, weight_decay=o.weight_decay, fused=fused, foreach=not fused)


def build(cfg: ModelConfig, run: Run, variant: str, o: TrainOptions, pl: Placement):
    """(model wrapped for the placement, its optimizer, whether the loop autocasts)."""
    dtype = torch.float64 if o.param_dtype == "float64" else param_dtype(run)
    torch.manual_seed(o.seed)
    model = init_model(cfg, variant, pl.device, dtype, o.seed, run.recompute, run.lean)  # the same weights on every rank
    amp = True
    if pl.strategy in ("tp", "pp"):
        from llm_anatomy.train import mesh

        model = mesh.build_tp(model, o, run, pl.device) if pl.strategy == "tp" else mesh.Pipelined(model, o, run,
                                                                                                    pl.device)
        amp = False  # fp32 / bf16 weights as built; amp is FSDP2's MixedPrecisionPolicy (dp > 1)
    elif pl.strategy == "ddp":
        from llm_anatomy.distributed.strategies import wrap

        model = wrap(model, "ddp", device_ids=[pl.device.index] if pl.device.type == "cuda" else None)
    elif pl.strategy == "fsdp":
        from llm_anatomy.distributed.strategies import default_mixed_precision, wrap

        pd, rd = default_mixed_precision(run)
        model = wrap(model, "fsdp", param_dtype=pd, reduce_dtype=rd)
        amp = False  # FSDP's MixedPrecisionPolicy is its amp: no autocast on top
    return model, make_optimizer(o.optimizer, variant, model, o, pl.device), amp


def model_flops(cfg: ModelConfig, run: Run, variant: str, dev: torch.device) -> int | None:
    """Model-convention FLOPs of one step on one rank (forward + backward), from the calculator."""
    try:
        from llm_anatomy.calculator import estimate

        f = estimate(cfg, run, variant, device="cuda" if dev.type == "cuda" else "cpu").to_dict()["flops"]["model"]
        return int(f["forward"] + f["backward"])
    except (ConfigError, KeyError, ImportError):
        return None
