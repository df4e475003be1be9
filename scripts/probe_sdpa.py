"""Probe: what each SDPA backend keeps for backward on this device, its output layout, and FlopCounterMode's count.

python3 scripts/probe_sdpa.py > probe.json    (records device, versions, date; used to write the calculator's
per-backend saved list, which the claim tests then check against the model)"""
import json
import sys
import time

import torch  # noqa: E402
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from anatomy.measure.flops import flop_counter


def probe(backend, B=2, S=256, nh=8, nkv=8, hd=64, q_layout="bhsd", dtype=torch.bfloat16):
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    saved = []

    def pack(t):
        saved.append(dict(shape=list(t.shape), dtype=str(t.dtype), stride=list(t.stride()),
                          storage_bytes=t.untyped_storage().nbytes(), key=t.untyped_storage()._cdata))
        return t

    if q_layout == "bshd":
        q = torch.randn(B, S, nh, hd, device=dev, dtype=dtype).transpose(1, 2).requires_grad_()
    else:
        q = torch.randn(B, nh, S, hd, device=dev, dtype=dtype, requires_grad=True)
    k = torch.randn(B, nkv, S, hd, device=dev, dtype=dtype, requires_grad=True)
    v = torch.randn(B, nkv, S, hd, device=dev, dtype=dtype, requires_grad=True)
    res = dict(backend=str(backend), B=B, S=S, nh=nh, nkv=nkv, hd=hd, q_layout=q_layout)
    try:
        ctx = sdpa_kernel([backend]) if backend is not None else torch.enable_grad()
        with ctx, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), flop_counter() as fc:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=nkv != nh)
        fwd = fc.get_total_flops()
        with flop_counter() as fc2:
            out.backward(torch.randn_like(out))
        keys = {q.untyped_storage()._cdata: "q", k.untyped_storage()._cdata: "k", v.untyped_storage()._cdata: "v",
                out.untyped_storage()._cdata: "out"}
        for s in saved:
            s["is"] = keys.get(s.pop("key"), "other")
        res.update(ok=True, grad_fn=type(out.grad_fn).__name__, out_stride=list(out.stride()),
                   flops_fwd=fwd, flops_bwd=fc2.get_total_flops(), saved=saved)
    except Exception as e:  # a backend that refuses these inputs is a result too
        res.update(ok=False, error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
    return res


if __name__ == "__main__":
    backends = [None, SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                SDPBackend.MATH] if torch.cuda.is_available() else [None]
    rows = []
    for be in backends:
        for nkv in (8, 2):
            for layout in ("bhsd", "bshd"):
                rows.append(probe(be, nkv=nkv, q_layout=layout))
                print(json.dumps({k: v for k, v in rows[-1].items() if k != "saved"}), file=sys.stderr)
    env = dict(date=time.strftime("%Y-%m-%d %H:%M:%S %Z"), torch=torch.__version__, cuda=torch.version.cuda,
               gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
               cudnn=torch.backends.cudnn.version(), command="python3 scripts/probe_sdpa.py")
    print(json.dumps(dict(env=env, rows=rows), indent=1))
