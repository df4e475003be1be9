"""`anatomy sweep`'s grid: the list flags, the models the flags name (presets, Hugging Face configs or
fields, as `anatomy estimate` reads them) and their reshaping to other widths and depths. Pure Python.
"""
from __future__ import annotations

import argparse
import itertools
from dataclasses import replace

from llm_anatomy.cli_args import config_from_args
from llm_anatomy.config import MAX_LAYERS, MAX_WIDTH, ConfigError, ModelConfig, Run, oneline

VARIANTS = ("baseline", "efficient")


def _list(kind):
    def parse(text: str):
        items = [t.strip() for t in text.split(",")]
        if not any(items) or any(not t for t in items[:-1]):
            raise argparse.ArgumentTypeError(f"empty value in {oneline(repr(text), 60)}")
        try:
            return [kind(t) for t in items if t]
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a {kind.__name__} list: {oneline(repr(text), 60)}") from None
    parse.__name__ = f"{kind.__name__} list"
    return parse


def _flat(values, default):
    out = [v for group in (values or []) for v in group]
    return out or list(default)


# ---- the grid ----------------------------------------------------------------------------------
def reshape(base: ModelConfig, hidden: int | None = None, layers: int | None = None) -> ModelConfig:
    """`base` at another width and/or depth, keeping head_dim, the GQA group and the MLP ratio."""
    for flag, v, top in (("--hidden", hidden, MAX_WIDTH), ("--layers", layers, MAX_LAYERS)):
        if v is not None and not 0 < v <= top:
            raise ConfigError(f"{flag} must be between 1 and {top:,}, got {v:.3g}")
    d = base.to_dict()
    name = base.name
    if hidden is not None and hidden != base.hidden:
        if hidden % base.head_dim:
            raise ConfigError(f"--hidden {hidden} is not a multiple of {base.name}'s head_dim {base.head_dim}")
        heads = hidden // base.head_dim
        group = base.heads // base.kv_heads
        if heads % group:
            raise ConfigError(f"--hidden {hidden} gives {heads} heads, not a multiple of {base.name}'s "
                              f"GQA group of {group}")
        d.update(hidden=hidden, heads=heads, kv_heads=heads // group,
                 intermediate=max(1, round(base.intermediate * hidden / base.hidden)))
        name += f"-h{hidden}"
    if layers is not None and layers != base.layers:
        d["layers"] = layers
        name += f"-l{layers}"
    d["name"] = name
    return ModelConfig(**d)


def grid(presets, hiddens, layers, batches, seqs, dtypes, variants, lean: bool = True) -> list[tuple[ModelConfig, Run, str]]:
    """The points: each model (a preset name or a ModelConfig) reshaped to each hidden and depth, at each
    batch, seq, dtype and variant; the efficient variant's with its lean block when `lean` (Run.lean)."""
    for v in variants:
        if v not in VARIANTS:
            raise ConfigError(f"unknown variant {v!r}; choose from {', '.join(VARIANTS)}")
    cfgs = []
    for p in presets:
        base = p if isinstance(p, ModelConfig) else ModelConfig.from_name(p)
        for h, n in itertools.product(hiddens or [None], layers or [None]):
            cfg = reshape(base, h, n)
            if cfg not in cfgs:
                cfgs.append(cfg)
    runs = [Run(batch=b, seq=s, dtype=d) for b, s, d in itertools.product(batches, seqs, dtypes)]
    return [(c, replace(r, lean=lean and v == "efficient"), v) for c in cfgs for r in runs for v in variants]


FIELD_KEYS = ("heads", "kv_heads", "intermediate", "vocab", "tie_embeddings", "mlp", "qkv_bias")


def models(a: argparse.Namespace, seqs: list[int]) -> tuple[list, list, list, tuple]:
    """(models, hiddens, layers, notes) the flags name, the models as `grid` takes them: presets, or HF
    configs, each with the fields given overriding it (as `anatomy estimate` reads them) and reshaped
    to --hidden/--layers by grid; or, with fields and neither, one model per (hidden, layers) from the
    fields alone (nothing to reshape)."""
    hiddens, layers = _flat(a.hidden, []), _flat(a.layers, [])
    fields = {k: getattr(a, k) for k in FIELD_KEYS}
    seq = max(seqs)  # a config's sliding window must cover the longest sequence
    ns = lambda **kw: argparse.Namespace(**{"preset": None, "hf_config": None, "hidden": None, "layers": None,  # noqa: E731
                                           "seq": seq, **fields, **kw})
    if a.preset and a.hf_config:
        raise ConfigError("give --preset or --hf-config, not both")
    if a.hf_config:
        out, notes = [], []
        for path in a.hf_config:
            n = ns(hf_config=path)
            out.append(config_from_args(n))
            notes += [x for x in n.config_notes if x not in notes]
        return out, hiddens, layers, tuple(notes)
    if a.preset or not any(v is not None for v in fields.values()):
        out = []
        for name in _flat(a.preset, ["seed"]):
            n = ns(preset=name)
            out.append(config_from_args(n))
        return out, hiddens, layers, ()
    out = []
    combos = list(itertools.product(hiddens or [None], layers or [None]))
    for h, n_layers in combos:
        cfg = config_from_args(ns(hidden=h, layers=n_layers))
        out.append(cfg if len(combos) == 1 else replace(cfg, name=f"{cfg.name}-h{cfg.hidden}-l{cfg.layers}"))
    return out, [], [], ()
