"""The few collectives the checkpoint and the run lock need, without pickle: every rank learns the
same answer (an error number, a step, a short name, the shards' digests) through tensors.

One process (no process group) is world 1, rank 0, and every function is the identity.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _device() -> torch.device:
    # NCCL moves only CUDA tensors; gloo only CPU ones
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def max_int(x: int) -> int:
    """The largest x over the ranks (an errno, a 'refused' flag): every rank then fails together."""
    if not dist.is_initialized():
        return x
    t = torch.tensor([x], dtype=torch.int64, device=_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def from_rank0(x: int) -> int:
    if not dist.is_initialized():
        return x
    t = torch.tensor([x], dtype=torch.int64, device=_device())
    dist.broadcast(t, src=0)
    return int(t.item())


def str_from_rank0(s: str, size: int = 200) -> str:
    """Rank 0's short string (a folder name, at most `size` UTF-8 bytes)."""
    if not dist.is_initialized():
        return s
    raw = s.encode()[:size] if rank() == 0 else b""
    t = torch.zeros(size + 1, dtype=torch.uint8, device=_device())
    t[0] = len(raw)
    if raw:
        t[1:1 + len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    dist.broadcast(t, src=0)
    return bytes(t[1:1 + int(t[0])].cpu().tolist()).decode()


def gather_digests(digest: bytes, nbytes: int) -> list[tuple[str, int]]:
    """Every rank's (sha256 hex, file size), in rank order."""
    if not dist.is_initialized():
        return [(digest.hex(), nbytes)]
    mine = torch.tensor(list(digest) + list(nbytes.to_bytes(8, "little")), dtype=torch.uint8, device=_device())
    out = [torch.empty_like(mine) for _ in range(world())]
    dist.all_gather(out, mine)
    rows = [bytes(t.cpu().tolist()) for t in out]
    return [(r[:32].hex(), int.from_bytes(r[32:], "little")) for r in rows]
