"""The flags every `anatomy` command shares (model, run, output) and their parsing into a ModelConfig.

Its own module so that the commands living elsewhere (llm_anatomy/measure/forensics_cli.py,
llm_anatomy/train/cli.py) import the flags without importing llm_anatomy.cli, which imports them.
Pure Python: no torch here.
"""
from __future__ import annotations

import argparse
import sys

from llm_anatomy.config import PRESETS, ConfigError, ModelConfig, Run, oneline
from llm_anatomy.hf_config import read_hf_config

DEFAULT_PRESET = "seed"
# The default variant is the fastest that fits: the efficient one, with its lean block where the run allows it
# (Run.lean: without recompute). Measured faster and smaller than the plain efficient block on every real config
# (docs/planning.md, "Defaults"); --no-lean keeps the plain block, --variant baseline the unfused model.
DEFAULT_VARIANT = "efficient"


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows "(default: X)" after a flag's help, except where there is no default to show."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or action.default == argparse.SUPPRESS or \
                "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """argparse with its usage errors on one line of stderr and exit code 2."""

    def __init__(self, *args, **kw):
        kw.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kw)

    def error(self, message):
        print(f"{self.prog}: error: {oneline(message)}", file=sys.stderr)
        sys.exit(2)


class Given(argparse.Action):
    """Stores the value and notes the flag's dest in `a.given`, so a command says which defaults it took."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        namespace.given = getattr(namespace, "given", frozenset()) | {self.dest}


def nonempty(text: str) -> str:
    """An argparse type: a string flag given as '' is refused rather than read as 'not given'."""
    if not text.strip():
        raise argparse.ArgumentTypeError("empty value")
    return text


# the model's fields as flags: (flag, help); `anatomy sweep` takes the same ones
FIELDS = (("hidden", "model width"), ("layers", "transformer blocks"), ("heads", "attention heads"),
          ("kv-heads", "key/value heads (grouped-query attention; default: --heads)"),
          ("intermediate", "MLP width"), ("vocab", "vocabulary size"))
HF_CONFIG_HELP = "a Hugging Face Llama, Mistral or Qwen2 config.json, or the folder holding it"
OPTIMIZER_HELP = ("the optimizer the step runs, for its state's memory and its time: adamw (torch's AdamW, fused on "
                  "CUDA) or ademamix (llm_anatomy.optim: the baseline's per-parameter loop, the efficient variant's "
                  "compiled step)")


def add_optimizer_flag(p: argparse.ArgumentParser) -> None:
    """--optimizer adamw|ademamix, default adamw: one optimizer for memory and time
    (llm_anatomy/calculator/optimizer.py: CHOICES, DEFAULT)."""
    from llm_anatomy.calculator.optimizer import CHOICES, DEFAULT

    p.add_argument("--optimizer", choices=CHOICES, default=DEFAULT, help=OPTIMIZER_HELP)


def add_model_fields(g, *, widths: bool = True) -> None:
    """--heads, --kv-heads, --intermediate, --vocab (and --hidden, --layers with widths), --tie-embeddings, --mlp."""
    for f, what in FIELDS:
        if widths or f not in ("hidden", "layers"):
            g.add_argument(f"--{f}", type=int, metavar="N", help=what)
    g.add_argument("--tie-embeddings", action=argparse.BooleanOptionalAction, default=None,
                   help="share the embedding and output matrices")
    g.add_argument("--mlp", choices=("swiglu", "gpt-oss"), help="MLP activation (default: swiglu)")
    g.add_argument("--qkv-bias", action=argparse.BooleanOptionalAction, default=None,
                   help="a bias on the q, k and v projections, as in Qwen2 (default: none)")


def add_config_flags(p: argparse.ArgumentParser) -> None:
    """The model flags, the run flags (batch, seq, dtype, variant, recompute) and --json."""
    add_model_flags(p)
    _add_run_flags(p)


def add_model_flags(p: argparse.ArgumentParser) -> None:
    """The model: a preset, an HF config.json, or explicit fields."""
    g = p.add_argument_group("model (a preset, an HF config.json, or explicit fields; fields override)")
    g.add_argument("--preset", type=nonempty, help=f"a named model: {', '.join(PRESETS)} (default: {DEFAULT_PRESET}, "
                                                   "unless fields or --hf-config are given)")
    g.add_argument("--hf-config", metavar="PATH", type=nonempty, help=HF_CONFIG_HELP)
    add_model_fields(g)


def _add_run_flags(p: argparse.ArgumentParser) -> None:
    r = p.add_argument_group("run")
    r.add_argument("--batch", type=int, default=16, metavar="N", action=Given, help="sequences per step")
    r.add_argument("--seq", type=int, default=4096, metavar="N", action=Given, help="tokens per sequence")
    r.add_argument("--dtype", default="amp", type=nonempty,
                   help="amp (bf16 autocast, fp32 master weights), bf16 or fp32")
    r.add_argument("--variant", default=DEFAULT_VARIANT, type=nonempty, action=Given,
                   help="efficient (fused kernels, with the lean block where it applies) or baseline (unfused, "
                        "readable)")
    r.add_argument("--recompute", default="none", type=nonempty,
                   help="efficient only: none; mlp (keep the block input, the attention branch and SDPA's "
                        "tensors; re-run both norms, gate_up and the activation in backward); or full (keep "
                        "only each block's input; re-run the whole block's forward in backward)")
    r.add_argument("--lean", action=argparse.BooleanOptionalAction, default=None,
                   help="efficient only, without recompute: the lean block (its matmuls keep no bf16 weight casts, "
                        "SwiGLU + down re-makes h in backward, each residual add runs inside the next norm); on "
                        "by default where it applies, --no-lean runs the plain efficient block")
    p.add_argument("--json", action="store_true", help="machine-readable output (keys in the README)")


def run_from_args(a) -> Run:
    """The run the flags name; --recompute and --lean are options of the efficient variant. Without --lean or
    --no-lean the efficient variant runs its lean block where the run allows it (no recompute); where it does
    not, a note (in a.config_notes) says the plain block runs."""
    lean = a.lean
    if lean is None:
        lean = a.variant == "efficient" and a.recompute == "none"
        if a.variant == "efficient" and not lean:
            a.config_notes = (*getattr(a, "config_notes", ()), f"the lean block applies without recompute only: "
                              f"--recompute {a.recompute} runs the plain efficient block")
        elif lean and getattr(a, "tp", 1) > 1:  # TP shards the plain block (distributed/tensor_parallel),
            # inside pipeline stages too (distributed/pipeline_tp)
            lean = False
            a.config_notes = (*getattr(a, "config_notes", ()), "the lean block runs without tensor parallel only: "
                              f"--tp {a.tp} runs the plain efficient block")
    run = Run(batch=a.batch, seq=a.seq, dtype=a.dtype, recompute=a.recompute, lean=lean)
    for flag, on in ((f"--recompute {run.recompute}", run.recompute != "none"), ("--lean", a.lean)):
        if on and a.variant != "efficient":
            raise ConfigError(f"{flag} is an option of the efficient variant (--variant efficient)")
    return run


def assumed(a, run: Run, variant: str) -> dict:
    """The run settings the command took by default ({} when every one was given): the variant (with the lean
    block or not), batch and sequence. Commands print them, and put them in their JSON as "defaults"."""
    given = getattr(a, "given", frozenset())
    out = {k: getattr(run, k) for k in ("batch", "seq") if k not in given}
    if "variant" not in given or (variant == "efficient" and a.lean is None):
        out["variant"] = variant
        out["lean"] = variant == "efficient" and run.lean_block
    return out


def say_assumed(d: dict) -> str:
    """The defaults taken, as one line of text ('' when none were)."""
    if not d:
        return ""
    parts = [f"{k} {v:,}" for k, v in d.items() if k in ("batch", "seq")]
    if "variant" in d:
        parts.insert(0, f"variant {d['variant']}" + ((" with the lean block" if d["lean"] else " (plain block)")
                                                     if d["variant"] == "efficient" else ""))
    return f"defaults taken: {', '.join(parts)} (flags: --variant, --lean/--no-lean, --batch, --seq)"


def config_from_args(a) -> ModelConfig:
    """The model the flags name. Notes about what an HF config carries but changes no count (RoPE scaling)
    are left in `a.config_notes` for the command to print once it has succeeded."""
    a.config_notes = ()
    if a.preset and a.hf_config:
        raise ConfigError("give --preset or --hf-config, not both")
    explicit = {k: getattr(a, k) for k in ("hidden", "layers", "heads", "kv_heads", "intermediate", "vocab",
                                           "tie_embeddings", "mlp", "qkv_bias") if getattr(a, k) is not None}
    if a.hf_config:
        hf = read_hf_config(a.hf_config)
        seq = getattr(a, "seq", None)
        if hf.sliding_window is not None and seq is not None and hf.sliding_window < seq:
            raise ConfigError(f"{oneline(a.hf_config)}: sliding_window={hf.sliding_window} is shorter than --seq {seq}; "
                              "the models here attend to the whole sequence (use --seq "
                              f"{hf.sliding_window} or less)")
        a.config_notes = hf.notes
        base = hf.config
    elif a.preset or not explicit:
        base = ModelConfig.from_name(a.preset or DEFAULT_PRESET)
    else:
        base = None
    if base is None:
        missing = [k for k in ("hidden", "layers", "heads", "intermediate", "vocab") if k not in explicit]
        if missing:
            raise ConfigError(f"without --preset, give --{' --'.join(m.replace('_', '-') for m in missing)}")
        return ModelConfig(**explicit)
    if base.moe and "intermediate" in explicit:  # a width no layer of a mixture of experts has
        raise ConfigError(f"--intermediate sets a dense MLP's width; {base.name} is a mixture of experts (each "
                          f"expert is {base.expert_intermediate} wide: expert_intermediate)")
    d = base.to_dict()
    if "heads" in explicit and "kv_heads" not in explicit:
        d["kv_heads"] = None
    d.update(explicit)
    if explicit:
        d["name"] = f"{base.name}+custom"
    return ModelConfig(**d)
