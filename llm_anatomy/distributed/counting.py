"""Instruments: what the process group actually did, and what each rank actually holds.

CollectiveCounter is a TorchDispatchMode, the mechanism CommDebugMode uses: every c10d collective
(DDP's reducer and FSDP2 call them through the dispatcher, eager or functional) passes through
it, so the count is of real calls with their real tensors, whatever the backend (gloo, nccl, fake).
A DTensor op is handed back to DTensor (NotImplemented), so the collectives it issues inside the op
(tensor parallel's redistributions, loss_parallel's reductions) reach the counter on plain tensors;
each call keeps its process group's name, which a mesh maps to its dim (counts_by_group).
Bytes follow NCCL-tests' convention, as the calculator does (llm_anatomy/calculator/comm.py): an
all-gather is its output, a reduce-scatter its input, an all-reduce or broadcast its buffer, a send or recv its tensor.
"""
from __future__ import annotations

from collections import Counter

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

# c10d op -> (collective, which argument holds the full buffer)
_C10D = {
    "_allgather_base_": ("all_gather", 0),  # (output, input, pg, ...)
    "allgather_": ("all_gather", 0),  # ([[outputs]], [inputs], ...)
    "allgather_into_tensor_coalesced_": ("all_gather", 0),
    "allgather_coalesced_": ("all_gather", 0),
    "_reduce_scatter_base_": ("reduce_scatter", 1),  # (output, input, ...)
    "reduce_scatter_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "allreduce_": ("all_reduce", 0),
    "allreduce_coalesced_": ("all_reduce", 0),
    "broadcast_": ("broadcast", 0),
    "reduce_": ("reduce", 0),
    "alltoall_base_": ("all_to_all", 1),
    "alltoall_": ("all_to_all", 1),
    "gather_": ("gather", 1),
    "scatter_": ("scatter", 0),
    "send": ("send", 0),  # ([tensors], pg, dst, tag): point to point, as pipelining's isend / batch_isend_irecv
    "recv_": ("recv", 0),
    "recv_any_source_": ("recv", 0),
    "barrier": ("barrier", None),
    "monitored_barrier_": ("barrier", None),
}
# functional collectives: the buffer is the input, times the group size for an all-gather
_FUNCTIONAL = {"all_gather_into_tensor": "all_gather", "all_gather_into_tensor_out": "all_gather",
               "reduce_scatter_tensor": "reduce_scatter", "all_reduce": "all_reduce", "all_reduce_": "all_reduce",
               "broadcast": "broadcast", "broadcast_": "broadcast", "all_to_all_single": "all_to_all"}
_FUNCTIONAL_NAMESPACES = ("_c10d_functional", "c10d_functional", "_c10d_functional_autograd")
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
                torch.int32: "int32", torch.int64: "int64", torch.uint8: "uint8", torch.bool: "bool"}


def _c10d_group(args) -> str | None:
    """The process group's name of a c10d op (its ProcessGroup argument), None if it has none."""
    pg_type = torch._C._distributed_c10d.ProcessGroup
    for a in args:  # the dispatcher passes the ProcessGroup boxed in a TorchScript object
        if isinstance(a, torch.ScriptObject):
            return pg_type.unbox(a).group_name
        if isinstance(a, pg_type):
            return a.group_name
    return None


def collective_group(func, args) -> str | None:
    """The process group's name of a collective op (c10d or functional) that every member of the group issues at
    the same point; None for any other op, point-to-point and barriers included."""
    if not isinstance(func, torch._ops.OpOverload):
        return None
    ns, name = func.namespace, func._overloadpacket.__name__
    if ns == "c10d" and name in _C10D and _C10D[name][0] not in ("send", "recv", "barrier"):
        return _c10d_group(args)
    if ns in _FUNCTIONAL_NAMESPACES and name in _FUNCTIONAL:
        return next((a for a in reversed(args) if isinstance(a, str)), None)
    return None


def _tensors(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for y in x for t in _tensors(y)]
    return []


def _nbytes(ts: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


class CollectiveCounter(TorchDispatchMode):
    """Records every collective issued inside the context: op, dtype, bytes of its full buffer."""

    def __init__(self):
        super().__init__()
        self.calls: list[dict] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **(kwargs or {}))
        if any(issubclass(t, DTensor) for t in types):
            # a DTensor op: let DTensor run it, so the collectives it desugars into (redistributions, loss
            # parallel's reductions) come back through this mode on plain tensors, as CommDebugMode does
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        ns, name = func.namespace, func._overloadpacket.__name__
        if ns == "c10d" and name in _C10D:
            op, i = _C10D[name]
            ts = _tensors(args[i]) if i is not None else []
            self._add(op, ts, _nbytes(ts), _c10d_group(args))
        elif ns in _FUNCTIONAL_NAMESPACES and name in _FUNCTIONAL:
            op, ts = _FUNCTIONAL[name], _tensors(args[0])
            n = _nbytes(ts) * (args[1] if op == "all_gather" and name != "all_gather_into_tensor_out" else 1)
            self._add(op, ts, n, next((a for a in reversed(args) if isinstance(a, str)), None))
        return out

    def _add(self, op: str, ts: list[torch.Tensor], nbytes: int, group: str | None = None) -> None:
        dtype = _DTYPE_NAMES.get(ts[0].dtype, str(ts[0].dtype)) if ts else "none"
        self.calls.append(dict(op=op, dtype=dtype, bytes=nbytes, group=group))

    def counts(self) -> dict[tuple[str, str, int], int]:
        """{(op, dtype, bytes): calls}, the form calculator.comm.collective_counts() predicts."""
        return dict(Counter((c["op"], c["dtype"], c["bytes"]) for c in self.calls))

    def counts_by_group(self, names: dict[str, str] | None = None) -> dict[tuple[str, str, str, int], int]:
        """{(group, op, dtype, bytes): calls}; `names` maps a process group's name to a label (a mesh dim)."""
        names = names or {}
        return dict(Counter((names.get(c["group"], c["group"] or "?"), c["op"], c["dtype"], c["bytes"])
                            for c in self.calls))


def _local(t: torch.Tensor) -> torch.Tensor:
    return getattr(t, "_local_tensor", t)  # a DTensor's shard on this rank


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors`: a view and its base count once."""
    seen: dict[int, int] = {}
    for t in tensors:
        s = _local(t).untyped_storage()
        seen[s._cdata] = s.nbytes()
    return sum(seen.values())


def rank_memory(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Bytes this rank holds: parameters, gradients, optimizer state (storage level, local shards)."""
    params = list(model.parameters())
    state = [v for st in (optimizer.state.values() if optimizer else ()) for v in st.values()
             if isinstance(v, torch.Tensor)]
    return dict(params=storage_bytes(params), grads=storage_bytes(p.grad for p in params if p.grad is not None),
                optimizer=storage_bytes(state))
