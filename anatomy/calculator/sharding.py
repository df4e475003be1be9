"""Per-rank parameter, gradient and optimizer bytes under DDP and FSDP2. Pure Python: no torch.

The parameter tensors are the baseline module tree's, in registration order (the order of
`model.named_parameters()`, a tied head counted once under `embed.weight`):
    embed.weight (V, H)
    layers.i: attn_norm.weight (H,), attn.q (H, H), attn.k (kv, H), attn.v (kv, H), attn.o (H, H)
              (with qkv_bias, attn.q.bias (H,) after attn.q.weight, and so on for k and v),
              mlp_norm.weight (H,), mlp.gate (I, H), mlp.up (I, H), mlp.down (H, I)
    norm.weight (H,), head.lm_head.weight (V, H) unless tied

FSDP2 (torch.distributed.fsdp.fully_shard, torch 2.13, _fsdp_param.py `_init_sharded_param`):
  1. every parameter is sharded on dim 0 with torch.chunk semantics: chunk = ceil(d0 / W) rows;
     rank r holds rows [r*chunk, min((r+1)*chunk, d0)), possibly none (d0 < W*chunk leaves the
     last ranks short or empty);
  2. each rank *allocates* the padded chunk, chunk x d1 x ..., whatever it holds ("pre-pad the
     sharded parameter to avoid padding before all-gather"); the nn.Parameter is a narrow view
     of that buffer. So parameter storage per rank = padded numel, the same on every rank;
  3. gradients: the reduce-scatter output is one flat buffer per FSDP unit, sum of the padded
     shards, in the parameter's (storage) dtype; each sharded grad is an as_strided view into
     it (_fsdp_collectives.py `foreach_reduce`). Gradient storage = padded numel, like params;
  4. optimizer state is built with zeros_like(param): the DTensor's local tensor is the
     *unpadded* shard, so AdamW state per rank = 8 B x the rows this rank really holds (rank 0
     holds the most), plus torch's 4-byte `step` tensor per parameter tensor.
DDP keeps a full replica: params, grads (.grad, plus DDP's bucket copy, see comm.py) and state.
"""
from __future__ import annotations

from math import prod

from anatomy.calculator.optimizer import OPTIMIZERS, state_bytes
from anatomy.calculator.types import BYTES
from anatomy.config import ConfigError, ModelConfig, Run

STRATEGIES = ("ddp", "fsdp")
Shape = tuple[int, ...]


def param_shapes(cfg: ModelConfig) -> list[tuple[str, Shape]]:
    """(name, shape) of every parameter tensor, in `named_parameters()` order."""
    H, I, V, kv = cfg.hidden, cfg.intermediate, cfg.vocab, cfg.kv_dim
    out: list[tuple[str, Shape]] = [("embed.weight", (V, H))]
    for i in range(cfg.layers):
        p = f"layers.{i}."
        out += [(p + "attn_norm.weight", (H,))]
        for n, d in (("q", H), ("k", kv), ("v", kv)):  # each projection's bias follows its weight
            out += [(p + f"attn.{n}.weight", (d, H))] + ([(p + f"attn.{n}.bias", (d,))] if cfg.qkv_bias else [])
        out += [(p + "attn.o.weight", (H, H)), (p + "mlp_norm.weight", (H,)),
                (p + "mlp.gate.weight", (I, H)), (p + "mlp.up.weight", (I, H)), (p + "mlp.down.weight", (H, I))]
    out.append(("norm.weight", (H,)))
    if not cfg.tie_embeddings:
        out.append(("head.lm_head.weight", (V, H)))
    return out


def fsdp_units(cfg: ModelConfig) -> list[tuple[str, list[tuple[str, Shape]]]]:
    """FSDP units as `wrap` builds them: the root (everything outside a Block) first, then each Block."""
    blocks: dict[str, list] = {f"layers.{i}": [] for i in range(cfg.layers)}
    root: list = []
    for name, shape in param_shapes(cfg):
        unit = ".".join(name.split(".")[:2]) if name.startswith("layers.") else None
        (blocks[unit] if unit else root).append((name, shape))
    return [("root", root)] + list(blocks.items())


def shard_rows(rows: int, world: int, rank: int) -> tuple[int, int]:
    """(rows this rank holds, padded rows every rank allocates) for torch.chunk-style dim-0 sharding."""
    chunk = -(-rows // world)
    return max(0, min(chunk, rows - rank * chunk)), chunk


def shard_numel(shape: Shape, world: int, rank: int) -> tuple[int, int]:
    """(local numel, padded numel) of one parameter's shard on `rank`."""
    local, padded = shard_rows(shape[0], world, rank)
    rest = prod(shape[1:])
    return local * rest, padded * rest


def param_dtype_name(run: Run) -> str:
    """Storage dtype of the parameters (master weights): bf16 only under the 'bf16' policy."""
    return "bfloat16" if run.dtype == "bf16" else "float32"


def optimizer_bytes(optimizer: str, numel: int, n_tensors: int, param_bytes: int) -> int:
    """Optimizer state bytes for `numel` elements in `n_tensors` tensors.

    torch's AdamW keeps exp_avg / exp_avg_sq in the parameter's dtype (2 x 2 B for bf16 params);
    AdEMAMix always keeps fp32 state (anatomy/optim/common.py); see calculator/optimizer.py."""
    name = optimizer.lower()
    if name not in OPTIMIZERS:
        raise ConfigError(f"unknown optimizer {optimizer!r}; choose from {', '.join(OPTIMIZERS)}")
    if name == "adamw":
        return 2 * param_bytes * numel + 4 * n_tensors
    return state_bytes(numel, name, n_tensors=n_tensors)


def check_world(cfg: ModelConfig, world_size, strategy: str) -> None:
    """ConfigError (one line) for a strategy or world size that cannot be run."""
    if strategy not in STRATEGIES:
        raise ConfigError(f"unknown strategy {strategy!r}; choose from {', '.join(STRATEGIES)}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size must be a positive integer, got {world_size!r}")
    if strategy == "fsdp":
        largest = max(s[0] for _, s in param_shapes(cfg))
        if world_size > largest:
            raise ConfigError(f"fsdp cannot shard {cfg.name} over {world_size} ranks: its largest parameter has "
                              f"{largest} rows on dim 0, so ranks >= {largest} would hold no shard of anything")


def per_rank_memory(cfg: ModelConfig, run: Run, world_size: int, strategy: str, *, rank: int = 0,
                    optimizer: str = "adamw") -> dict:
    """Bytes one rank holds between steps: params, grads (after backward) and optimizer state."""
    check_world(cfg, world_size, strategy)
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank must be in [0, {world_size}), got {rank!r}")
    pb = BYTES[param_dtype_name(run)]
    shapes = [s for _, s in param_shapes(cfg)]
    if strategy == "ddp":
        n = sum(prod(s) for s in shapes)
        return dict(params=n * pb, grads=n * pb, optimizer=optimizer_bytes(optimizer, n, len(shapes), pb),
                    params_numel=n, local_numel=n)
    local = padded = 0
    for s in shapes:
        lo, pa = shard_numel(s, world_size, rank)
        local, padded = local + lo, padded + pa
    return dict(params=padded * pb, grads=padded * pb, optimizer=optimizer_bytes(optimizer, local, len(shapes), pb),
                params_numel=padded, local_numel=local)
