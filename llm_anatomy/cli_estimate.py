"""`anatomy estimate`'s figures (estimate_all) and its text (print_estimate): the calculator's estimate, the
memory phases with the optimizer's state, per-rank figures, and with a GPU the step time and the fit.
`anatomy sweep` predicts each point with estimate_all, so its figures are estimate's. Pure Python: no torch.
"""
from __future__ import annotations

from llm_anatomy.config import ConfigError, ModelConfig, Run

MAX_WORLD = 2**20  # data-parallel ranks: more GPUs than any cluster has


def check_variant(v: str) -> str:
    if v not in ("baseline", "efficient"):
        raise ConfigError(f"unknown variant {v!r}; choose baseline or efficient")
    return v


def moe_routing(cfg: ModelConfig, run: Run, variant: str = "baseline", device: str = "cuda") -> dict:
    """The routing the MoE blocks' saved bytes are counted under (balanced: every expert hit, the worst case),
    and the same blocks' bytes under the worst and under the skewed routing (every token to experts 0..k-1).
    The efficient block's bytes are the same under any dropless routing (N = T·k rows)."""
    from llm_anatomy.calculator import moe
    from llm_anatomy.calculator.moe_efficient import efficient_moe_saved

    if variant == "efficient":
        total = lambda hist: sum(efficient_moe_saved(cfg, run, hist, device).values())  # noqa: E731
    else:
        total = lambda hist: sum(s.bytes for s in moe.saved(cfg, run, hist))  # noqa: E731
    return {"histogram": "balanced", "moe_saved_worst": total(moe.worst_histogram(cfg, run)),
            "moe_saved_skewed": total(moe.skewed(cfg, run))}


def moe_peaks(cfg: ModelConfig, run: Run, variant: str, optimizer: str, device: str, need: int) -> dict:
    """The step's peak under each histogram calculator/moe.py peak_histograms names, and the largest as the worst.
    The efficient block keeps N = T·k rows under any dropless routing: one peak for every histogram."""
    from llm_anatomy.calculator.memory import phases
    from llm_anatomy.calculator.moe import peak_histograms

    if variant == "efficient":
        return {"need_bytes_balanced": need, "need_bytes_worst": need, "worst_histogram": "any"}
    peaks = {name: peak_bytes(phases(cfg, run, variant, optimizer=optimizer, device=device, stages=False, hist=h))
             for name, h in peak_histograms(cfg, run).items()}
    worst = max(peaks, key=peaks.get)
    return {f"need_bytes_{k}": v for k, v in peaks.items()} | {"need_bytes_worst": peaks[worst],
                                                                 "worst_histogram": worst}


def peak_bytes(ph: dict) -> int:
    """The step's peak from llm_anatomy.calculator.memory.phases: the larger of the forward peak (where
    modelled) and the peak inside backward; memory.need_bytes, which the fit verdict and `anatomy sweep`
    read."""
    return max(ph["forward_peak"] or 0, ph["backward_peak"])


PHASE_KEYS = ("init", "forward_end", "forward_peak", "backward_peak", "backward_peak_at", "backward_peak_by_kind",
              "backward_end", "optimizer_end", "reserved_low", "reserved_high")


def estimate_all(cfg: ModelConfig, run: Run, variant: str, *, device: str = "cuda", optimizer: str = "adamw",
                 gpu: str | None = None, world_size: int = 1, strategy: str | None = None,
                 gpus_per_node: int = 8) -> dict:
    """What `anatomy estimate` reports, as a dict: the calculator's estimate, the memory phases and the
    step's peak (memory.need_bytes, with the optimizer's state), per-rank figures on world_size ranks, and
    with a GPU the step time and whether the peak fits. One optimizer for memory and time."""
    from llm_anatomy.calculator import active_param_count, estimate
    from llm_anatomy.calculator.memory import phases
    from llm_anatomy.calculator.moe import phases_unmodelled, refuse_phases
    from llm_anatomy.calculator.optimizer import CHOICES, implementation

    if optimizer not in CHOICES:
        raise ConfigError(f"unknown optimizer {optimizer!r}; choose {' or '.join(CHOICES)}")
    est = estimate(cfg, run, check_variant(variant), device=device)  # one estimate: memory and time read it
    out = est.to_dict()
    out["optimizer"] = dict(name=optimizer, implementation=implementation(optimizer, variant))
    if cfg.moe:  # what one token's forward reaches: every parameter but the routed experts it is not sent to
        out["params_active"] = active_param_count(cfg)
        out["moe_routing"] = moe_routing(cfg, run, variant, device)
    if why := phases_unmodelled(cfg, run, variant, device):  # no peak model yet (calculator/moe.py)
        out["memory"]["not_modelled"] = f"the memory phases and peak ({why})"
        if gpu is not None or world_size != 1 or strategy:
            refuse_phases(cfg, run, variant, device,
                          "--gpu, --world-size and --strategy (the step time, the fit, per-rank peaks)")
        return out
    ph = phases(cfg, run, variant, optimizer=optimizer, device=device, est=est, stages=False)  # the peak, no list
    out["memory"]["phases"] = {k: ph[k] for k in PHASE_KEYS} | {"optimizer": optimizer}
    out["memory"]["need_bytes"] = peak_bytes(ph)
    if cfg.moe:
        out["moe_routing"] |= moe_peaks(cfg, run, variant, optimizer, device, out["memory"]["need_bytes"])
    if world_size != 1 or strategy:
        from llm_anatomy.calculator.comm import estimate_distributed

        if not 1 <= world_size <= MAX_WORLD:
            raise ConfigError(f"--world-size must be between 1 and {MAX_WORLD:,}, got {world_size:.3g}")
        out["distributed"] = estimate_distributed(cfg, run, world_size,
                                                  strategy or ("fsdp" if variant == "efficient" else "ddp"),
                                                  optimizer=optimizer, gpu=gpu or "h200-sxm", variant=variant,
                                                  device=device, gpus_per_node=gpus_per_node)
    if gpu is not None:
        from llm_anatomy.calculator.timing import estimate_time

        t = estimate_time(cfg, run, variant, gpu=gpu, optimizer=optimizer, with_kernels=False,
                          est=est if device == "cuda" else None)
        out["time"] = {k: t[k] for k in ("forward_backward_s", "optimizer_s", "step_s", "steady", "host_bound", "mfu",
                                         "components", "sources")
                       if k in t} | {"gpu": gpu, "profile": t["gpu"], "profile_kind": t["profile_kind"],
                                     "optimizer": optimizer}
        if t["profile_kind"] == "derived":  # its plausible range: the same step on the bounds' profiles
            from llm_anatomy.plan import derived_bounds

            bounds = derived_bounds(gpu)
            out["time"]["range"] = dict(source=bounds.pop("source"))
            for b, name in bounds.items():
                tb = estimate_time(cfg, run, variant, gpu=name, optimizer=optimizer, with_kernels=False,
                                   est=est if device == "cuda" else None)
                out["time"]["range"][b] = dict(gpu=name, forward_backward_s=tb["forward_backward_s"],
                                               step_s=tb["step_s"], steady_step_s=tb["steady"]["step_s"],
                                               tokens_per_s=run.tokens / tb["forward_backward_s"],
                                               mfu=tb["mfu"]["model"])
        gpu_s = {p: v["gpu_s"] for p, v in t["phases"].items()}  # the kernels' time, the GPU's idle time left out
        out["time"]["gpu_busy_s"] = dict(forward_backward=gpu_s["forward"] + gpu_s["backward"],
                                         step=sum(gpu_s.values()))
        from llm_anatomy.calculator.gpus import capacity_bytes, rule as gpus_rule
        from llm_anatomy.plan import table_entry

        cap, source = capacity_bytes(table_entry(gpu)["name"])  # what mem_get_info reports free on an idle device
        need = out["memory"]["need_bytes"]
        if (pk := out.get("distributed", {}).get("peak")) is not None:
            need = pk["peak"]  # one rank's peak, with its sharding and communication buffers
        out["memory"]["fits"] = dict(gpu=gpu, need_bytes=need, capacity_bytes=cap, capacity_source=source,
                                     per_rank=world_size > 1, fits=need <= cap, gpu_rule=gpus_rule(gpu))
    return out


def _recompute(out: dict) -> str:
    """The run's efficient-only options for a header line: recompute when on, and which block runs (lean or
    plain), said either way."""
    r = out["run"].get("recompute", "none")
    block = "" if out.get("variant") != "efficient" else \
        " · lean block" if out["run"].get("lean") and r == "none" else " · plain block"
    return ("" if r == "none" else f" · recompute {r}") + block


def print_estimate(con, out: dict) -> None:
    """The estimate as text on a rich Console: the component table, then one line per figure."""
    from rich.table import Table

    t = Table(title=f"{out['config']['name']} · {out['variant']} · B={out['run']['batch']} S={out['run']['seq']} "
                    f"{out['run']['dtype']}{_recompute(out)}")
    for c in ("component", "params (M)", "fwd TFLOP (counter)", "bwd TFLOP (counter)", "fwd TFLOP (model)",
              "saved GiB"):
        t.add_column(c, justify="left" if c == "component" else "right", overflow="fold")  # fold, never cut a figure
    row = lambda params, fc, bc, fm, sv: (f"{params / 1e6:,.2f}", f"{fc / 1e12:,.3f}", f"{bc / 1e12:,.3f}",  # noqa: E731
                                         f"{fm / 1e12:,.3f}", f"{sv / 2**30:,.3f}")
    for name, c in out["components"].items():
        t.add_row(name, *row(c["params"], c["flops"]["counter"]["forward"], c["flops"]["counter"]["backward"],
                             c["flops"]["model"]["forward"], c["saved_bytes"]))
    f, s = out["flops"], out["memory"]["saved"]
    t.add_row("total", *row(out["params"], f["counter"]["forward"], f["counter"]["backward"], f["model"]["forward"],
                            s["total"]), style="bold")
    if not con.is_terminal:  # a file or a pipe: as wide as the table, never a wrapped figure
        con.width = max(con.width, con.measure(t, options=con.options.update_width(1000)).maximum)
    con.print(t)
    con.print(f"{out['params']:,} parameters; TFLOP = 10^12 FLOP; GiB = 2^30 B")
    if "params_active" in out:
        con.print(f"{out['params_active']:,} parameters active per token (the routed experts a token is not sent "
                  "to left out)")
    if "moe_routing" in out:
        r = out["moe_routing"]
        con.print(f"MoE blocks' saved tensors under balanced routing (the worst: every expert hit) "
                  f"{r['moe_saved_worst'] / 2**30:,.3f} GiB; every token to the same k experts "
                  f"{r['moe_saved_skewed'] / 2**30:,.3f} GiB")
        if r.get("worst_histogram") == "any":
            con.print(f"the step's peak {r['need_bytes_worst'] / 2**30:,.2f} GiB under any routing (dropless: the "
                      "efficient block keeps T·k expert rows whatever the histogram)")
        elif "need_bytes_worst" in r:
            con.print(f"the step's peak by routing: balanced {r['need_bytes_balanced'] / 2**30:,.2f} GiB · skewed "
                      f"{r['need_bytes_skewed'] / 2**30:,.2f} GiB · one expert full {r['need_bytes_full_last'] / 2**30:,.2f}"
                      f" GiB; the worst of these {r['need_bytes_worst'] / 2**30:,.2f} GiB ({r['worst_histogram']})")
    if "not_modelled" in out["memory"]:
        con.print(f"not modelled for this config yet: {out['memory']['not_modelled']}")
    if out["variant"] == "baseline":
        con.print("(the unfused baseline; --variant efficient estimates the fused model, which saves far less)")
    if "phases" in out["memory"]:
        ph = out["memory"]["phases"]
        gib = lambda b: f"{b / 2**30:,.2f} GiB" if b is not None else "not modelled"  # noqa: E731
        opt = {"adamw": "AdamW", "ademamix": "AdEMAMix"}[ph["optimizer"]]
        con.print(f"memory with {opt} ({'CUDA, 512 B blocks' if out['device'] == 'cuda' else out['device']}): "
                  f"init {gib(ph['init'])} · forward end {gib(ph['forward_end'])} · forward peak "
                  f"{gib(ph['forward_peak'])} · backward peak {gib(ph['backward_peak'])} (at {ph['backward_peak_at']})"
                  f" · after backward {gib(ph['backward_end'])} · after the step {gib(ph['optimizer_end'])}")
        con.print("at the backward peak: " + " · ".join(
            f"{k} {v / 2**30:,.2f} GiB ({v / ph['backward_peak']:.0%})" for k, v in ph["backward_peak_by_kind"].items()
            if v))
        if out["device"] == "cuda":
            con.print(f"reserved by the caching allocator (looser): {gib(ph['reserved_low'])} to "
                      f"{gib(ph['reserved_high'])}")
    if "fits" in out["memory"]:
        f = out["memory"]["fits"]
        verdict = "fits" if f["fits"] else "predicted OOM"
        con.print(f"{verdict} on {f['gpu']}: needs {gib(f['need_bytes'])}{' per rank' if f.get('per_rank') else ''} "
                  f"of {gib(f['capacity_bytes'])} allocatable",
                  style=None if f["fits"] else "bold red")
        if f.get("gpu_rule"):
            con.print(f"(--gpu {f['gpu']}: {f['gpu_rule']})")
    if "time" in out:
        from llm_anatomy.calculator.optimizer import LABELS

        tm = out["time"]
        con.print(f"predicted training step on {tm['gpu']}: {tm['steady']['step_s'] * 1e3:,.1f} ms, steps back to back "
                  f"(forward+backward {tm['steady']['forward_backward_s'] * 1e3:,.1f} ms); one step on an idle GPU "
                  f"{tm['step_s'] * 1e3:,.1f} ms (forward+backward {tm['forward_backward_s'] * 1e3:,.1f} ms, optimizer "
                  f"{tm['optimizer_s'] * 1e3:,.2f} ms: {LABELS[out['optimizer']['implementation']]})")
        busy = tm["gpu_busy_s"]["step"]
        con.print(f"the GPU's kernel time in that step: {busy * 1e3:,.1f} ms ({busy / tm['steady']['step_s']:.0%}; the "
                  "rest is the GPU waiting on the host)")
        if tm["host_bound"]:
            con.print("host-bound: the CPU issuing the kernels, not the GPU, sets this step's pace; on the H200 "
                      "machines measured, a host-bound step's time moved by 10-20% between processes and within "
                      "one (docs/timing.md), while its kernel time held to ±10%")
        from llm_anatomy.calculator.timing import lookup as gpus

        if (rg := tm.get("range")) is not None:
            con.print(f"derived profile {tm['profile']} (the measured H200's kernel efficiencies on this part's "
                      f"datasheet, docs/derived-gpus.md): plausible range of the steady step "
                      f"{rg['high']['steady_step_s'] * 1e3:,.1f} to {rg['low']['steady_step_s'] * 1e3:,.1f} ms, "
                      f"forward+backward {rg['high']['forward_backward_s'] * 1e3:,.1f} to "
                      f"{rg['low']['forward_backward_s'] * 1e3:,.1f} ms ({rg['low']['tokens_per_s']:,.0f} to "
                      f"{rg['high']['tokens_per_s']:,.0f} tokens/s); --gpu {tm['profile'].removesuffix('-derived')}"
                      "-datasheet times the datasheet roofline" + gpus.measured_hint(tm["profile"].removesuffix("-derived")))
        measured = f"{gpus.profile_stem(tm['profile'])}-measured"
        if tm["profile_kind"] == "datasheet" and measured in gpus.names():
            con.print(f"(from datasheet figures; --gpu {measured} uses the profile `anatomy calibrate` measured on "
                      "one, which the H200 claims are checked against: docs/timing.md)")
    if "distributed" in out:
        from llm_anatomy.calculator.comm import render_distributed

        con.print(render_distributed(out["distributed"]), highlight=False)  # every collective: --json
