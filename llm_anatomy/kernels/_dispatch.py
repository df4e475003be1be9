"""How a kernel op picks its implementation (Triton or plain torch) and its dtype under autocast.

Every op in this package is a ``torch.library.custom_op`` with:
  * a default implementation: the plain-torch reference (CPU in CI, and any device without Triton);
  * a CUDA implementation: the Triton launcher;
  * a fake implementation, so meta tensors, FakeTensorMode and torch.compile see shapes and dtypes;
  * an autocast rule, registered on the AutocastCPU / AutocastCUDA dispatch keys (see below);
  * a backward that is itself a custom op with the same three implementations.

Triton on CPU. With TRITON_INTERPRET=1 in the environment *before triton is imported*, every
``@triton.jit`` kernel becomes an interpreted function that runs on CPU tensors through numpy.
The launchers (``*_triton`` functions) accept CPU tensors then; inside ``triton_on_cpu()`` the ops'
CPU implementations route to them too, so a test can drive the whole autograd path through the
real kernels. Kernels avoid what the interpreter cannot run: no inline asm, no atomics, no loops
whose trip count is a tensor (row loops run a fixed count and mask the tail).

Autocast. ``torch.library.register_autocast`` casts *every* floating input to one dtype fixed at
registration. That is wrong here: RMSNorm must keep x in fp32 (it is the residual stream and the
saved tensor) and only write its output in the autocast dtype; RoPE must keep its fp32 cos/sin
tables. ``register_autocast_rule`` therefore registers a kernel on the Autocast dispatch key that
reads the *current* autocast dtype, lets the op's own rule rewrite the arguments, and re-enters the
op with autocast disabled. Autocast sits above Autograd in the dispatcher, so the casts it issues
are recorded by autograd (their backward casts the gradient back), and it also runs while
torch.compile traces, so eager and compiled code agree. Backward ops take explicit tensors and
return gradients in the forward inputs' dtypes; their rule only turns autocast off. (The seed's
alternative, custom_fwd/custom_bwd on an autograd.Function, is tied to one device type per
decoration and sits outside the dispatcher, so torch.ops.anatomy.* calls would not see it.)

The eager fast path. Through the dispatcher, one call of a fused op is Python on four layers: the
autocast kernel (a Python kernel plus an autocast-off context), the custom op's autograd wrapper,
its backend lookup, and the launcher; its backward the same again. On the H200's host that is
144-391 us a forward call and 148-550 us a backward, against 11-20 us for an eager aten op (the
dispatcher path as `anatomy calibrate` times it, host_custom_us), enough for a 6-layer seed step to
spend more on the host than its 39 ms of kernels. So the public functions (rms_norm, rope_qkv,
rope_qkv_norm, swiglu_packed) run a plain ``torch.autograd.Function`` over the very implementations the
custom ops call, with the autocast rule applied inline, whenever ``fast_path`` holds: eager plain tensors
with no dispatch or function mode, no trace and no tensor subclass. Anything else (torch.compile, FakeTensorMode,
FlopCounterMode, the liveness walk's dispatch mode, DTensor, meta tensors) goes through the custom
op, so what sees ops still sees ``anatomy::*``. validations/test_fast_path.py holds the two
paths to the same bits, saved tensors and in-place gradients.
"""
from __future__ import annotations

import contextlib
import os
from types import SimpleNamespace
from typing import Callable

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

try:  # Triton is a Linux dependency; the plain-torch references work without it.
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None
    tl = SimpleNamespace(constexpr=int)
    HAS_TRITON = False

# triton.jit reads TRITON_INTERPRET when a kernel is decorated, i.e. when our kernel modules are
# imported, right after this one: so the value read here is the one the kernels were built with.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

LIB = torch.library.Library("anatomy", "FRAGMENT")  # holds the autocast kernels

_triton_on_cpu = False
_PLAIN = (torch.Tensor, torch.nn.Parameter)
# ANATOMY_FAST_PATH=0 sends every call through the custom ops: the A/B switch for what the fast path buys
_FAST = os.environ.get("ANATOMY_FAST_PATH", "1") != "0"
_wrapped = torch._C._functorch.is_functorch_wrapped_tensor


def jit(fn):
    """``triton.jit`` where Triton is installed; otherwise the plain function (never launched)."""
    return triton.jit(fn) if HAS_TRITON else fn


@contextlib.contextmanager
def triton_on_cpu():
    """Route the ops' CPU implementations through the Triton kernels (interpreter) for this block."""
    if not (HAS_TRITON and INTERPRET):
        raise RuntimeError("Triton kernels run on CPU only under TRITON_INTERPRET=1, set before triton "
                           "is imported (the repo's conftest.py does this on machines without nvidia-smi)")
    global _triton_on_cpu
    old, _triton_on_cpu = _triton_on_cpu, True
    try:
        yield
    finally:
        _triton_on_cpu = old


def cpu_uses_triton() -> bool:
    return _triton_on_cpu


def launches_triton(t: torch.Tensor) -> bool:
    """Whether an op on t runs the Triton launcher (CUDA, or CPU inside triton_on_cpu) or the reference."""
    return t.device.type == "cuda" or _triton_on_cpu


def fast_path(*tensors: torch.Tensor) -> bool:
    """May this call skip the dispatcher (module docstring)? Only eager, plain, real tensors with no
    mode or trace that expects to see the op."""
    if (not _FAST or torch.compiler.is_compiling() or torch._C._is_torch_function_mode_enabled()
            or _get_current_dispatch_mode() is not None):
        return False
    return all(type(t) in _PLAIN and t.device.type != "meta" and not _wrapped(t) for t in tensors)


def autocast_dtype(t: torch.Tensor) -> torch.dtype | None:
    """The autocast dtype in force for t's device type, or None: what the Autocast key would see."""
    dt = t.device.type
    return torch.get_autocast_dtype(dt) if dt in _AUTOCAST_KEYS and torch.is_autocast_enabled(dt) else None


def no_autocast(t: torch.Tensor):
    """Autocast off for t's device type where it matters: the references' aten calls must not be cast
    (as inside the custom ops). The Triton launchers call no op autocast touches (empty, view,
    contiguous, the launch), so on that path this is a null context and costs no host time."""
    if launches_triton(t) or autocast_dtype(t) is None:
        return contextlib.nullcontext()
    return torch.autocast(t.device.type, enabled=False)


def check_launchable(t: torch.Tensor) -> None:
    """Raise one clear line when a Triton launcher cannot run on this tensor's device."""
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed; use the op (it falls back to the plain-torch reference)")
    if t.device.type == "cuda":
        return
    if t.device.type == "cpu" and INTERPRET:
        return
    raise RuntimeError(f"Triton launchers need CUDA tensors, or CPU tensors under TRITON_INTERPRET=1 "
                       f"(got {t.device.type}, TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')})")


def rows(t: torch.Tensor) -> torch.Tensor:
    """(..., N) -> (M, N) with unit stride along N: a view whenever the leading dims merge (as for a
    contiguous tensor or a column slice such as ``gate_up[..., :I]``), a copy otherwise."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 or t2.shape[-1] == 1 else t2.contiguous()


def num_warps(block: int) -> int:
    """Warps for a one-row-per-program kernel of `block` elements (Liger's calculate_settings)."""
    return 32 if block >= 32768 else 16 if block >= 8192 else 8 if block >= 2048 else 4


MIN_ROWS_PER_PROGRAM = 4


def reduction_programs(device: torch.device, n_rows: int, n_cols: int) -> int:
    """Programs for a kernel that loops over rows and reduces them (an RMSNorm weight gradient).

    About 8K accumulator columns per SM: max(1, 8192 // n_cols) programs per SM, the best of 1, 2, 4
    per SM on the H200 (bf16, torch 2.11 / triton 3.6) at every width tuned: 3.64, 3.67, 3.71 TB/s
    for N = 2048, 4096, 8192 (with a 3-stage pipelined row loop). Each program takes at least
    MIN_ROWS_PER_PROGRAM rows: every program leaves one fp32 row of partials for a second kernel to
    sum, and below ~16K rows one row per program makes that sum take up to three times the row pass
    (H200, 1,024-16,384 rows of 256-4096; docs/history.md). Under the interpreter, which
    runs programs one after another, 8 programs."""
    if device.type == "cuda":
        per_sm = max(1, 8192 // max(n_cols, 1))
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return max(1, min(-(-n_rows // MIN_ROWS_PER_PROGRAM), per_sm * sms))
    return max(1, min(n_rows, 8))


def autocast_floating(t: torch.Tensor, device_type: str, dtype: torch.dtype) -> torch.Tensor:
    """Autocast's own eligibility rule: floating, on this device type, not float64."""
    if t.is_floating_point() and t.device.type == device_type and t.dtype is not torch.float64:
        return t.to(dtype)
    return t


_AUTOCAST_KEYS = {"cpu": "AutocastCPU", "cuda": "AutocastCUDA"}


def _keep(dtype, device_type, *args):
    return args


def register_autocast_rule(op, rule: Callable[..., tuple] = _keep) -> None:
    """On each device type's Autocast key, call ``op(*rule(autocast_dtype, device_type, *args))``
    with autocast disabled. The rule returns the rewritten positional arguments; the default keeps
    them (for backward ops: their aten calls then never see autocast, even when a CPU backward runs
    inside an autocast region on the calling thread)."""
    name, overload = op._name, op._opoverload  # a torch.library.CustomOpDef

    for device_type, key in _AUTOCAST_KEYS.items():
        def kernel(_keyset, *args, _device_type=device_type):
            dtype = torch.get_autocast_dtype(_device_type)
            new_args = rule(dtype, _device_type, *args)
            with torch.autocast(_device_type, enabled=False):
                return overload(*new_args)

        LIB.impl(name, kernel, key, with_keyset=True)
