"""What a (dp, tp) mesh can run: the refusals the engine side (llm_anatomy.distributed.tensor_parallel) and the
calculator (llm_anatomy.calculator.tensor_parallel) both apply, each in one line naming the field. Pure Python."""
from __future__ import annotations

from llm_anatomy.config import ConfigError, ModelConfig, Run


def _pos(name: str, v) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ConfigError(f"{name} must be a positive integer, got {v!r}")


def check_mesh(cfg: ModelConfig, tp: int, dp: int = 1, *, variant: str = "baseline", cp: int = 1,
               device: str = "cpu") -> None:
    """ConfigError (one line, naming the field) for a (dp, tp) mesh the plan cannot shard this model over."""
    for name, v in (("tp", tp), ("dp", dp), ("cp", cp)):
        _pos(name, v)
    if cp > 1 and device == "cpu":
        raise ConfigError("cp > 1 needs CUDA: torch's context_parallel shards SDPA's flash/efficient/cuDNN "
                          "kernels; CPU's SDPA (_scaled_dot_product_flash_attention_for_cpu) has no sharding rule")
    if cp > 1:
        raise ConfigError("cp > 1 is not built yet (see docs/parallelism.md)")
    if tp == 1:
        return
    if variant != "baseline":
        raise ConfigError(f"tp > 1 runs the baseline variant only: the {variant} variant's fused kernels take "
                          "plain tensors, not column shards")
    if cfg.moe:
        raise ConfigError("tp > 1 does not shard mixture-of-experts layers (experts > 0)")
    for field in ("heads", "kv_heads", "intermediate", "vocab"):
        if getattr(cfg, field) % tp:
            raise ConfigError(f"{field}={getattr(cfg, field)} is not divisible by tp={tp}")


def check_run(run: Run, tp: int, dp: int = 1) -> None:
    """ConfigError (one line) for a run the mesh cannot take: sequence parallel splits seq over tp evenly, and amp
    needs FSDP's mixed-precision policy (dp > 1)."""
    if tp > 1 and run.seq % tp:
        raise ConfigError(f"seq={run.seq} is not divisible by tp={tp} (sequence parallel splits it evenly)")
    if run.dtype == "amp" and dp == 1:
        raise ConfigError("dtype amp on a mesh needs dp > 1 (its policy is FSDP's mixed precision); use fp32 or bf16")
