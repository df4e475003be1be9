"""The calculator's result types. Pure Python: no torch."""
from __future__ import annotations

from dataclasses import dataclass, field
from math import prod

# the saved RoPE tables of the attention (fp32 buffers, cast per Block under FSDP's amp policy)
ROPE_TABLES = ("attention.rope_cos", "attention.rope_sin")
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4, "bool": 1}


@dataclass(frozen=True, init=False)
class Saved:
    """One tensor autograd keeps for backward: `count` instances across the whole model."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    count: int = 1
    why: str = ""  # which op saves it, and why it exists at all

    def __init__(self, name: str, shape: tuple[int, ...], dtype: str, count: int = 1, why: str = ""):
        # frozen: each field written once, into the instance's dict, as the generated __init__ writes it through
        # object.__setattr__ (three times slower; an estimate makes dozens of these)
        d = self.__dict__
        d["name"], d["shape"], d["dtype"], d["count"], d["why"] = name, shape, dtype, count, why

    @property
    def bytes(self) -> int:  # all instances
        return prod(self.shape) * BYTES[self.dtype] * self.count

    def to_dict(self) -> dict:
        """Every field (dataclasses.asdict's result, without its deep copy: the fields are immutable)."""
        return dict(name=self.name, shape=self.shape, dtype=self.dtype, count=self.count, why=self.why)


@dataclass
class Component:
    """One component summed over the model (e.g. all L attention layers)."""

    name: str
    instances: int
    params: int
    flops_counter_fwd: int  # FlopCounterMode convention
    flops_counter_bwd: int
    flops_model_fwd: int  # causal attention halved, no recompute: feeds MFU
    flops_model_bwd: int
    flops_elementwise_fwd: int = 0  # ~1 FLOP per elementwise op per element; an estimate, not a count
    saved: list[Saved] = field(default_factory=list)

    @property
    def saved_bytes(self) -> int:
        return sum(s.bytes for s in self.saved)


@dataclass
class Estimate:
    config: dict
    run: dict
    variant: str
    device: str
    components: dict[str, Component]

    def total(self, attr: str) -> int:
        return sum(getattr(c, attr) for c in self.components.values())

    @property
    def params(self) -> int:
        return self.total("params")

    def to_dict(self) -> dict:
        comps = self.components.values()
        saved, tensors = {}, []  # each component's sum and each tensor's row (Saved.to_dict, and more), in one pass
        for c in comps:
            total = 0
            for s in c.saved:
                b = s.bytes
                total += b
                tensors.append({"name": s.name, "shape": s.shape, "dtype": s.dtype, "count": s.count, "why": s.why,
                                "component": c.name, "bytes": b})
            saved[c.name] = total  # Component.saved_bytes
        return {
            "config": self.config, "run": self.run, "variant": self.variant, "device": self.device,
            "params": self.params,
            "flops": {
                "counter": {"forward": self.total("flops_counter_fwd"), "backward": self.total("flops_counter_bwd")},
                "model": {"forward": self.total("flops_model_fwd"), "backward": self.total("flops_model_bwd")},
                "elementwise": {"forward": self.total("flops_elementwise_fwd")},
            },
            "memory": {"saved": {
                "total": sum(saved.values()),
                "by_component": saved,
                "tensors": tensors,
            }},
            "components": {c.name: {
                "instances": c.instances, "params": c.params,
                "flops": {"counter": {"forward": c.flops_counter_fwd, "backward": c.flops_counter_bwd},
                          "model": {"forward": c.flops_model_fwd, "backward": c.flops_model_bwd},
                          "elementwise": {"forward": c.flops_elementwise_fwd}},
                "saved_bytes": saved[c.name]} for c in comps},
        }
