"""AdEMAMix: baseline loop vs efficient foreach/compiled, against the paper's Algorithm 1 in float64,
the optimizer-state claim, the recompile insight, and the step's HBM bandwidth on a GPU.

Accuracy is judged against float64, never against a constant picked to pass:
  * fixed gradients (Algorithm 1 transcription): a first-order running error bound of the fp32
    arithmetic, accumulated element by element along the float64 trajectory (_algorithm1_fp64);
  * a model's own gradients (which feed back): the DESIGN rule, efficient's error vs float64
    within 2x the fp32 baseline's own error vs float64.
"""
from __future__ import annotations

import copy
import math
import statistics

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import llm_anatomy.optim.efficient as efficient
from llm_anatomy.calculator.optimizer import state_bytes, step_bytes_moved
from llm_anatomy.optim import AdEMAMix, FusedAdEMAMix, alpha_at, beta3_at
from llm_anatomy.optim.efficient import ademamix_foreach_
from validations.gpu_clock import GpuRound, gpu_time

U32 = 2.0 ** -24  # fp32 unit roundoff: |fl(x) - x| <= U32 |x|

IMPLS = {
    "baseline": lambda ps, **kw: AdEMAMix(ps, **kw),
    "foreach": lambda ps, **kw: FusedAdEMAMix(ps, compile=False, **kw),
    "compiled": lambda ps, **kw: FusedAdEMAMix(ps, compile=True, **kw),
}


@pytest.fixture(autouse=True, scope="module")
def _one_cpu_thread():
    """These tensors are tiny, and two OpenMP threads on 2 shared cores are fragile: while another
    process holds a core, each parallel region waits a scheduler slice (measured: 50 steps of the
    test MLP took 3.4 s instead of 0.03 s). One intra-op thread is also what such sizes want."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---- the paper's Algorithm 1, transcribed in float64 -----------------------------------------
def _f_alpha(t, alpha, T):
    return alpha if T is None else min(t * alpha / T, alpha)


def _f_beta3(t, beta3, beta_start, T):
    # the paper's closed form; it is written for t <= T (the paper sets T = the run's length)
    if T is None or t >= T:
        return beta3
    a = t / T
    lb3, lbs = math.log(beta3), math.log(beta_start)
    return min(math.exp(lbs * lb3 / ((1 - a) * lb3 + a * lbs)), beta3)


def _algorithm1_fp64(theta0, grads, lr, betas, alpha, eps, wd, T):
    """theta0: list of tensors; grads[t][i]: the gradient of tensor i at step t+1 (fixed, fp32
    values). Returns (theta after len(grads) steps in float64, elementwise fp32 error bound).

    The bound: an fp32 implementation rounds at every op, relative error U32 each. Per step t,
      update magnitude  M_t = lr ((A1/bc1 + alpha A2) / (sqrt(nu_hat) + eps) + wd |theta|)
    with A1, A2 the EMAs of |g| (what m1, m2 would be without cancellation). Its computed value
    is off by at most (16 + 5t) U32 M_t to first order: 16 = 11 roundings in the update formula
    (sqrt, /sqrt(bc2), +eps, m1/bc1, alpha m2, +, /denom, wd theta, +, lr *, theta -) + 5 scalars
    rounded to fp32 (lr, alpha, bc1, sqrt(bc2), wd); 5t = the EMA states' accumulated error, 3
    roundings per step in m1, m2 (mul, add, 1-beta) and 4 in nu, halved by the sqrt. Plus U32|theta_t|
    for storing theta. The bound sums these over steps (errors in theta are not amplified: the
    gradients are fixed and the decay factor 1 - lr wd is < 1).
    """
    theta = [p.detach().double().clone() for p in theta0]
    beta1, beta2, beta3 = betas
    m1 = [torch.zeros_like(p) for p in theta]
    m2 = [torch.zeros_like(p) for p in theta]
    nu = [torch.zeros_like(p) for p in theta]
    a1 = [torch.zeros_like(p) for p in theta]
    a2 = [torch.zeros_like(p) for p in theta]
    bound = [torch.zeros_like(p) for p in theta]
    for t, gs in enumerate(grads, start=1):  # line 4: t <- t + 1
        alpha_t = _f_alpha(t, alpha, T)  # line 5
        beta3_t = _f_beta3(t, beta3, beta1, T)
        for i, g in enumerate(gs):
            g = g.double()
            m1[i] = beta1 * m1[i] + (1 - beta1) * g  # line 8
            m2[i] = beta3_t * m2[i] + (1 - beta3_t) * g  # line 9
            nu[i] = beta2 * nu[i] + (1 - beta2) * g * g  # line 10
            m1_hat = m1[i] / (1 - beta1 ** t)  # line 11
            nu_hat = nu[i] / (1 - beta2 ** t)
            denom = nu_hat.sqrt() + eps
            a1[i] = beta1 * a1[i] + (1 - beta1) * g.abs()
            a2[i] = beta3_t * a2[i] + (1 - beta3_t) * g.abs()
            mag = lr * ((a1[i] / (1 - beta1 ** t) + alpha_t * a2[i]) / denom + wd * theta[i].abs())
            theta[i] = theta[i] - lr * ((m1_hat + alpha_t * m2[i]) / denom + wd * theta[i])  # line 12
            bound[i] += U32 * ((16 + 5 * t) * mag + theta[i].abs())
    return theta, bound


def _run_fixed_grads(impl, theta0, grads, **hp):
    ps = [torch.nn.Parameter(p.detach().clone()) for p in theta0]
    opt = IMPLS[impl](ps, **hp)
    for gs in grads:
        for p, g in zip(ps, gs):
            p.grad = g.clone()
        opt.step()
    return [p.detach() for p in ps]


def _check_within(name, got, ref, bound):
    for i, (x, r, b) in enumerate(zip(got, ref, bound)):
        err = (x.double() - r).abs()
        worst = (err / b).max().item()
        assert worst <= 1.0, f"{name} tensor {i}: error {err.max().item():.3e} is {worst:.2f}x its fp32 bound"


# ---- 2. both implementations vs Algorithm 1 in float64 ----------------------------------------
@pytest.mark.parametrize("impl", ["baseline", "foreach", "compiled"])
def test_matches_algorithm1_fp64(impl):
    gen = torch.Generator().manual_seed(1)
    shapes = [(7, 5), (13,), (3, 4, 2), (1,)]
    theta0 = [torch.randn(s, generator=gen) for s in shapes]
    # gradients with sign flips, scales from 1e-4 to 10, and a step of all-zero gradient
    grads = [[torch.randn(s, generator=gen) * 10.0 ** (i - 3) for i, s in enumerate(shapes)] for _ in range(8)]
    grads[4] = [torch.zeros(s) for s in shapes]
    hp = dict(lr=1e-2, betas=(0.9, 0.999, 0.9999), alpha=5.0, eps=1e-8, weight_decay=0.1, T_alpha_beta3=6)
    ref, bound = _algorithm1_fp64(theta0, grads, hp["lr"], hp["betas"], hp["alpha"], hp["eps"],
                                  hp["weight_decay"], hp["T_alpha_beta3"])
    _check_within(impl, _run_fixed_grads(impl, theta0, grads, **hp), ref, bound)


def test_schedules_match_paper_closed_form():
    for t in range(0, 25):
        assert alpha_at(t, 5.0, 20) == pytest.approx(_f_alpha(t, 5.0, 20), rel=1e-15)
        assert beta3_at(t, 0.9999, 0.9, 20) == pytest.approx(_f_beta3(t, 0.9999, 0.9, 20), rel=1e-14)
    assert beta3_at(0, 0.9999, 0.9, 20) == pytest.approx(0.9, rel=1e-14)  # starts at beta1
    assert beta3_at(20, 0.9999, 0.9, 20) == 0.9999 and beta3_at(7, 0.9999, 0.9, None) == 0.9999


# ---- 5. hypothesis: random shapes and hyperparameters -----------------------------------------
_shape = st.lists(st.integers(1, 9), min_size=1, max_size=3).map(tuple)


@given(shapes=st.lists(_shape, min_size=1, max_size=4), steps=st.integers(1, 6),
       lr=st.sampled_from([1e-4, 1e-3, 3e-2]), beta1=st.sampled_from([0.5, 0.9, 0.95]),
       beta2=st.sampled_from([0.95, 0.999]), beta3=st.sampled_from([0.99, 0.9999, 0.999999]),
       alpha=st.sampled_from([0.5, 5.0, 10.0]), wd=st.sampled_from([0.0, 0.1]),
       T=st.sampled_from([None, 1, 3, 100]), seed=st.integers(0, 2 ** 16))
def test_implementations_agree_hypothesis(shapes, steps, lr, beta1, beta2, beta3, alpha, wd, T, seed):
    gen = torch.Generator().manual_seed(seed)
    theta0 = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(steps)]
    hp = dict(lr=lr, betas=(beta1, beta2, beta3), alpha=alpha, eps=1e-8, weight_decay=wd, T_alpha_beta3=T)
    ref, bound = _algorithm1_fp64(theta0, grads, lr, (beta1, beta2, beta3), alpha, 1e-8, wd, T)
    base = _run_fixed_grads("baseline", theta0, grads, **hp)
    eff = _run_fixed_grads("foreach", theta0, grads, **hp)  # eager: a compile per example is too slow
    _check_within("baseline", base, ref, bound)
    _check_within("foreach", eff, ref, bound)


# ---- 1. a model trained 50 steps: efficient within 2x the baseline's own fp32 error -----------
def _mlp(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    # odd widths on purpose; tanh keeps the loss surface smooth, so the fp32/fp64 gap grows slowly
    return torch.nn.Sequential(torch.nn.Linear(12, 33), torch.nn.Tanh(), torch.nn.Linear(33, 17),
                               torch.nn.Tanh(), torch.nn.Linear(17, 4))


def _train(model, opt, batches):
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


def _max_err(ps, ref):
    return max((p.double() - r).abs().max().item() for p, r in zip(ps, ref))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("impl", ["foreach", "compiled"])
def test_efficient_matches_baseline_50_steps(request, impl, device):
    if device == "cuda":
        request.getfixturevalue("cuda_device")  # skips without a GPU
    hp = dict(lr=1e-2, betas=(0.9, 0.999, 0.9999), alpha=5.0, weight_decay=0.1, T_alpha_beta3=30)
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randn(64, 12, generator=gen), torch.randn(64, 4, generator=gen)) for _ in range(50)]
    model = _mlp(0)
    runs = {}
    for name, dtype in [("ref", torch.float64), ("baseline", torch.float32), (impl, torch.float32)]:
        m = copy.deepcopy(model).to(device=device, dtype=dtype)
        opt = AdEMAMix(m.parameters(), **hp) if name in ("ref", "baseline") else IMPLS[impl](m.parameters(), **hp)
        runs[name] = _train(m, opt, [(x.to(device, dtype), y.to(device, dtype)) for x, y in batches])
    moved = _max_err(runs["ref"], [p.double() for p in model.to(device).parameters()])
    err_base, err_eff = _max_err(runs["baseline"], runs["ref"]), _max_err(runs[impl], runs["ref"])
    assert moved > 0.1, "the parameters barely moved: the comparison would prove nothing"
    # the 2x rule compares rounding with rounding: fp32 rounding over 50 steps is ~1e-6 of the motion
    # (measured 7e-7); a gap of 1e-4 would mean a chaotic trajectory, where the rule compares noise
    assert 0 < err_base < 1e-4 * moved, f"baseline fp32 drifted from fp64 by {err_base:.3e}: not rounding"
    assert err_eff <= 2 * err_base, f"{impl}: {err_eff:.3e} from fp64, baseline's own fp32 error {err_base:.3e}"


def test_bf16_params_fp32_state_one_step():
    """bf16 params: both do the math in fp32 and round to bf16 once, so they differ by <= 1 bf16 ulp."""
    model = _mlp(3).to(torch.bfloat16)
    x, y = torch.randn(16, 12).bfloat16(), torch.randn(16, 4).bfloat16()
    out = {}
    for impl in ("baseline", "foreach"):
        m = copy.deepcopy(model)
        opt = IMPLS[impl](m.parameters(), lr=1e-2, weight_decay=0.1, T_alpha_beta3=10)
        out[impl] = _train(m, opt, [(x, y)])
        assert all(s[k].dtype == torch.float32 for s in opt.state.values() for k in s if k != "step")
    for a, b in zip(out["baseline"], out["foreach"]):
        ulp = torch.finfo(torch.bfloat16).eps * a.float().abs().clamp_min(torch.finfo(torch.bfloat16).tiny)
        assert ((a.float() - b.float()).abs() <= ulp).all()


def test_state_dict_moves_between_implementations():
    gen = torch.Generator().manual_seed(5)
    batches = [(torch.randn(8, 12, generator=gen), torch.randn(8, 4, generator=gen)) for _ in range(6)]
    hp = dict(lr=1e-2, weight_decay=0.1, T_alpha_beta3=4)
    m_a, m_b = _mlp(4), _mlp(4)
    opt_a = AdEMAMix(m_a.parameters(), **hp)
    _train(m_a, opt_a, batches[:3])
    m_b.load_state_dict(m_a.state_dict())
    opt_b = FusedAdEMAMix(m_b.parameters(), compile=False, **hp)
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))  # torch shares, not copies, same-dtype tensors
    a, b = _train(m_a, opt_a, batches[3:]), _train(m_b, opt_b, batches[3:])
    assert max((x - y).abs().max().item() for x, y in zip(a, b)) < 1e-6  # same math, fp32 ulps apart


# ---- 3. the state-bytes claim -----------------------------------------------------------------
def _state_storage_bytes(opt: torch.optim.Optimizer) -> int:
    """Sum of the unique storages of every tensor in opt.state (a view counts once)."""
    seen = {}
    for s in opt.state.values():
        for v in s.values():
            if torch.is_tensor(v):
                stg = v.untyped_storage()
                seen[(v.device, stg.data_ptr())] = stg.nbytes()
    return sum(seen.values())


@pytest.mark.parametrize("impl,dtype", [
    ("baseline", torch.float32), ("baseline", torch.bfloat16), ("foreach", torch.float32),
    ("foreach", torch.bfloat16), ("adamw", torch.float32), ("adamw", torch.bfloat16), ("sgd", torch.float32)],
    ids=["baseline-fp32", "baseline-bf16", "foreach-fp32", "foreach-bf16", "adamw-fp32", "adamw-bf16", "sgd-fp32"])
def test_state_bytes_claim(claims, impl, dtype):
    model = _mlp(1).to(dtype)
    params = list(model.parameters())
    n_params, n_tensors = sum(p.numel() for p in params), len(params)
    if impl == "adamw":  # torch's own: moments in the param dtype, plus a 0-dim fp32 step per tensor
        opt = torch.optim.AdamW(params)
        predicted = state_bytes(n_params, "adamw", n_tensors=n_tensors, param_bytes=dtype.itemsize)
    elif impl == "sgd":
        opt, predicted = torch.optim.SGD(params, lr=0.1), state_bytes(n_params, "sgd")
    else:  # fp32 state for bf16 params too; the step is a host int
        opt, predicted = IMPLS[impl](params), state_bytes(n_params, "ademamix")
    _train(model, opt, [(torch.randn(4, 12).to(dtype), torch.randn(4, 4).to(dtype))])
    claims.check("optimizer state bytes", component="optimizer", config=f"mlp-{n_params}",
                 variant=f"{impl}-{str(dtype).removeprefix('torch.')}", predicted=predicted,
                 measured=_state_storage_bytes(opt), tolerance=0.0, unit="B")


# ---- 4. the seed insight: a changing Python float recompiles, a 0-dim tensor does not --------
class _CountingBackend:
    """A torch.compile backend that counts the graphs dynamo hands it, and runs them eagerly."""

    def __init__(self):
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return gm.forward


def _graphs_for(fn, args_per_call, **compile_kw) -> int:
    torch._dynamo.reset()
    backend = _CountingBackend()
    compiled = torch.compile(fn, backend=backend, fullgraph=True, **compile_kw)
    for args in args_per_call:
        compiled(*args)
    torch._dynamo.reset()
    return backend.graphs


def test_changing_python_float_recompiles_zero_dim_tensor_does_not():
    def scaled(x, lr):
        return x * lr

    x = torch.ones(8)
    lrs = [1e-3 * (i + 1) for i in range(5)]
    # static: the float is a constant of the graph, one graph per value (and eager past the limit)
    assert _graphs_for(scaled, [(x, lr) for lr in lrs], dynamic=False) == len(lrs)
    # torch's default (automatic dynamic) still recompiles at least once: on the first change it
    # retraces with a symbolic float (torch 2.13: exactly once)
    assert _graphs_for(scaled, [(x, lr) for lr in lrs]) >= 2
    # a 0-dim tensor is data: one graph, whatever its value
    assert _graphs_for(scaled, [(x, torch.tensor(lr)) for lr in lrs], dynamic=False) == 1


def test_fused_step_compiles_once_under_changing_schedules(monkeypatch):
    """The real kernel, under a LR schedule plus the alpha and beta3 warm-ups: one graph for 8 steps.
    Passing the scalars as floats instead (here beta1, which the kernel takes as a float) recompiles."""
    torch._dynamo.reset()
    backend = _CountingBackend()
    monkeypatch.setattr(efficient, "_compiled",
                        torch.compile(ademamix_foreach_, backend=backend, fullgraph=True, dynamic=False))
    model = _mlp(2)
    opt = FusedAdEMAMix(model.parameters(), compile=True, lr=1e-2, T_alpha_beta3=5)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    gen = torch.Generator().manual_seed(2)
    for _ in range(8):
        _train(model, opt, [(torch.randn(4, 12, generator=gen), torch.randn(4, 4, generator=gen))])
        sched.step()
    assert backend.graphs == 1

    ps = [torch.zeros(3)]
    state = [[torch.zeros(3)] for _ in range(3)]
    for beta1 in (0.9, 0.91, 0.92):
        efficient._compiled(ps, [torch.ones(3)], *state, torch.ones(7), beta1, 0.999, 1e-8)
    assert backend.graphs == 1 + 3
    torch._dynamo.reset()


def test_kernel_gets_each_list_smallest_first(monkeypatch):
    """FusedAdEMAMix hands its kernel the parameters sorted by size (ties in module order), and every state
    list in the same order: Inductor fuses the list, in order, into kernels that stream at the copy rate
    only over tensors of one size (docs/timing.md)."""
    seen = []
    monkeypatch.setattr(FusedAdEMAMix, "_kernel", lambda self, device: lambda *a: seen.append(a) or
                        ademamix_foreach_(*a))
    model = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.Linear(32, 4), torch.nn.Linear(4, 4))
    opt = FusedAdEMAMix(model.parameters(), compile=False)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    ps, gs, m1s, m2s, nus = seen[0][:5]
    module_order = list(model.parameters())
    assert [p.numel() for p in ps] == sorted(p.numel() for p in module_order) != [p.numel() for p in module_order]
    at = {id(p): i for i, p in enumerate(module_order)}  # numels 384, 32, 128, 4, 16, 4
    assert [at[id(p)] for p in ps] == [3, 5, 4, 1, 2, 0]
    assert all(g is p.grad for p, g in zip(ps, gs))
    assert all(s is opt.state[p][k] for p, s, k in ((p, s, k) for k, lst in
               (("exp_avg_fast", m1s), ("exp_avg_slow", m2s), ("exp_avg_sq", nus)) for p, s in zip(ps, lst)))


# ---- 6. GPU: the step's achieved HBM bandwidth, efficient vs torch's fused AdamW --------------
def _median_cuda_seconds(fn, repeats: int = 20) -> float:
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


@pytest.mark.gpu
@pytest.mark.benchmark(timer=gpu_time)  # gated on GPU time, as every benchmark (docs/benchmarks.md)
@pytest.mark.parametrize("impl", ["ademamix-compiled", "adamw-fused"])
def test_step_bandwidth(cuda_device, benchmark, gpu_refs, impl):
    # 6 x 4096^2 = 100.7M fp32 params: 400 MB each of params and grads, far past the 60 MB L2
    params = [torch.nn.Parameter(torch.randn(4096, 4096, device="cuda")) for _ in range(6)]
    for p in params:
        p.grad = torch.randn_like(p)  # never time zeros
    n_params = sum(p.numel() for p in params)
    if impl == "adamw-fused":
        opt, name = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, fused=True), "adamw"
    else:
        opt, name = FusedAdEMAMix(params, lr=1e-4, weight_decay=0.1, T_alpha_beta3=10_000), "ademamix"

    def step():
        opt.step()
        torch.cuda.synchronize()

    for _ in range(3):  # compile and warm up outside any timing
        step()
    benchmark.pedantic(GpuRound(opt.step, cycles_per_s=gpu_refs["sleep_cycles_per_s"]), rounds=20, iterations=1,
                       warmup_rounds=2)

    # ceiling in the same run: a device copy of the same size, bytes read + written
    src = torch.randn(n_params, device="cuda")
    dst = torch.empty_like(src)
    copy_bw = 2 * src.numel() * 4 / _median_cuda_seconds(lambda: dst.copy_(src))
    seconds = _median_cuda_seconds(opt.step)
    moved = step_bytes_moved(n_params, name)
    benchmark.extra_info.update(
        impl=impl, n_params=n_params, bytes_moved=moved, median_s=seconds, hbm_GBps=moved / seconds / 1e9,
        copy_GBps=copy_bw / 1e9, fraction_of_copy=moved / seconds / copy_bw, gpu=torch.cuda.get_device_name(0))
    assert opt.state[params[0]] and moved / seconds > 0

