"""The efficient model's backward stages for gpt-oss's and OLMoE's attention fields (efficient/attention.py,
efficient/attention_sinks.py); backward_efficient.layer calls them.

- Sinks: SDPA's backward writes d(q'), d(k'), d(v') at the padded widths (hd + pad, and S + 1 keys for k', v');
  the real columns are views of them.
- OLMoE's whole q/k norms: rope_qkv's backward writes d(cat(qn, kn, v)) as one (T, D); cat's backward hands
  views of it on. Autograd runs v's column slice first (its backward: a zero (T, D) with v's gradient written
  in), then k_norm's rms_norm backward (d(kn) (T, kv) and the weight's gradient) and its column slice's zero
  (T, D), summed with v's (autograd's InputBuffer: backward.Walk.input_buffer_sum); then q_norm's, the same. d(cat)
  goes once q_norm's backward has read it; the saved qkv once both norms' backward ran. Not modelled: on CPU
  the reference rms_norm backward's fp32 temporaries inside each norm's backward (as for the block norms,
  backward_efficient.norm), a few (T, width) at once: where q is much wider than hidden they can be the peak."""
from __future__ import annotations


def width(w) -> int:
    """SDPA's head width: hd, and with sinks their pad columns."""
    from llm_anatomy.calculator.attention import sink_pad

    return w.hd + (sink_pad("cuda" if w.cuda else "cpu") if w.cfg.attn_sinks else 0)


def sdpa_grads(w) -> tuple[int, int]:
    """Bytes of SDPA's d(q) and of each of d(k), d(v): at the sinks' padded widths and one key longer."""
    B, S, nh, nkv, c, wd = w.B, w.S, w.nh, w.nkv, w.c, width(w)
    return B * nh * S * wd * c, B * nkv * (S + w.cfg.attn_sinks) * wd * c


def whole_qk_norm(w, tag: str, dqkv: int) -> None:
    """From d(cat) (dqkv bytes, live) to d(qkv) (one (T, D), left live for the qkv matmul's backward)."""
    T, c, p = w.T, w.c, w.p
    w.alloc(dqkv)  # v's columns into a zero (T, D)
    for name, width, last in (("k_norm", w.cfg.kv_dim, False), ("q_norm", w.cfg.q_dim, True)):
        w.alloc(T * width * c, width * p)  # rms_norm's d(x) and its weight's gradient
        w.peak(tag + "attention." + name)
        if last:  # d(cat) has had its last reader; so has the saved qkv
            w.alloc(-dqkv)
            w.free("attention.rope_qkv_norm.qkv")
        w.alloc(dqkv, -T * width * c)  # the columns' zero (T, D), d(x) written in (and gone)
        w.input_buffer_sum(tag + "attention." + name + " sum", dqkv)  # summed with the gradient so far
