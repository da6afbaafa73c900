"""The fused CPU kernels (lightning_zoff.ops) against torch and float64 references, on every ISA this CPU runs."""

from __future__ import annotations

import itertools
import math
import zlib

import pytest
import torch

from lightning_zoff import ops

ISAS = ops.available_isas()  # asks the compiled module: builds the kernels once (then cached on disk)
SIZES = [1, 15, 17, 63, 4099]  # below, at and past one vector; past one chunk of the 2-thread split
STEPS = 30
THREADS = 2
GRADS = [  # (grad dtype, grad_scale): fp16 with a loss-scale-like factor
    pytest.param(torch.float32, 1.0, id="fp32"),
    pytest.param(torch.bfloat16, 1.0, id="bf16"),
    pytest.param(torch.float16, 1 / 1024, id="fp16-scaled"),
]
OUT_FOR_GRAD = {torch.float32: None, torch.bfloat16: torch.bfloat16, torch.float16: torch.float16}
ADAM_CASES = {
    "adamw": dict(decoupled=True, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, maximize=False),
    "adam_l2": dict(decoupled=False, lr=3e-3, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.1, maximize=False),
    "adamw_maximize": dict(decoupled=True, lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, maximize=True),
    "adam_low_beta1": dict(decoupled=False, lr=1e-3, beta1=0.3, beta2=0.999, eps=1e-8, weight_decay=0.0,
                           maximize=False),
}
LION = dict(lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=0.1)
MOMENT_DTYPES = (torch.float32, torch.bfloat16)


def _gen(*seed: object) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(seed).encode()))  # stable across runs, unlike hash()


def _grad(n: int, dtype: torch.dtype, scale: float, gen: torch.Generator) -> torch.Tensor:
    """A gradient whose `grad * scale` is of order 1, with a spread of magnitudes (and no fp16 overflow)."""
    spread = torch.exp(torch.randn(n, generator=gen).clamp(-4, 2))
    return (torch.randn(n, generator=gen) * spread / scale).to(dtype)


def _scaled(grad: torch.Tensor, scale: float) -> torch.Tensor:
    """grad * scale in fp32, as the kernels compute it."""
    return grad.float() * scale


def _adam_f64(p, m, v, g, step, *, lr, beta1, beta2, eps, weight_decay, decoupled, maximize):
    """The Adam/AdamW step in float64, in place."""
    if maximize:
        g = -g
    if decoupled:
        p.mul_(1 - lr * weight_decay)
    elif weight_decay:
        g = g + weight_decay * p
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    denom = v.sqrt() / math.sqrt(1 - beta2**step) + eps
    p.addcdiv_(m, denom, value=-lr / (1 - beta1**step))


def _adam_kwargs(case: dict) -> dict:
    return {k: case[k] for k in ("lr", "beta1", "beta2", "eps", "weight_decay", "decoupled", "maximize")}


def _torch_adam(p: torch.Tensor, case: dict) -> torch.optim.Optimizer:
    cls = torch.optim.AdamW if case["decoupled"] else torch.optim.Adam
    return cls(
        [p], lr=case["lr"], betas=(case["beta1"], case["beta2"]), eps=case["eps"],
        weight_decay=case["weight_decay"], maximize=case["maximize"], foreach=False,
    )


def _assert_bits_equal(out: torch.Tensor, expected: torch.Tensor) -> None:
    """Bit for bit where `expected` is a number; NaN where it is NaN (bf16 NaN is 0x7FC0, as c10::BFloat16)."""
    nan = expected.isnan()
    bits = torch.int16 if out.element_size() == 2 else torch.int32
    assert out.dtype == expected.dtype
    assert torch.equal(out.isnan(), nan)
    assert torch.equal(out.view(bits)[~nan], expected.view(bits)[~nan])
    if out.dtype == torch.bfloat16:
        assert bool((out.view(torch.int16)[nan] == 0x7FC0).all())


def _run_adam_against_references(isa: str, case: dict, n: int, grad_dtype: torch.dtype, scale: float) -> None:
    gen = _gen(n, STEPS, str(grad_dtype), *case.values())
    start = torch.randn(n, generator=gen)
    ours, m, v = start.clone(), torch.zeros(n), torch.zeros(n)
    theirs = start.clone().requires_grad_()
    opt = _torch_adam(theirs, case)
    ref, ref_m, ref_v = start.double(), torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    out_dtype = OUT_FOR_GRAD[grad_dtype]
    out = None if out_dtype is None else torch.empty(n, dtype=out_dtype)
    for step in range(1, STEPS + 1):
        grad = _grad(n, grad_dtype, scale, gen)
        ops.adam_step(ours, grad, m, v, **_adam_kwargs(case), step=step, grad_scale=scale, out=out, isa=isa,
                      threads=THREADS)
        theirs.grad = _scaled(grad, scale)
        opt.step()
        _adam_f64(ref, ref_m, ref_v, grad.double() * scale, step, **_adam_kwargs(case))
        if out is not None:
            _assert_bits_equal(out, ours.to(out_dtype))
    ours_err = (ours.double() - ref).abs().max().item()
    torch_err = (theirs.detach().double() - ref).abs().max().item()
    assert ours_err <= 2 * torch_err + 1e-7, f"ours {ours_err:.3g} vs torch {torch_err:.3g}"


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("case", ADAM_CASES)
@pytest.mark.parametrize(("grad_dtype", "scale"), GRADS)
@pytest.mark.parametrize("n", SIZES)
def test_adam_error_at_most_twice_torch(isa, case, grad_dtype, scale, n):
    _run_adam_against_references(isa, ADAM_CASES[case], n, grad_dtype, scale)


@pytest.mark.parametrize("isa", ISAS)
def test_adamw_million_elements(isa):
    _run_adam_against_references(isa, ADAM_CASES["adamw"], 1_000_003, torch.float32, 1.0)


def _special_floats(gen: torch.Generator) -> torch.Tensor:
    """fp32 values that stress rounding to bf16 and fp16: ties, NaN, +-inf, +-0, subnormals, overflow edges."""
    bf16_ties = (torch.randint(0, 0x7F7F, (2000,), generator=gen, dtype=torch.int32) << 16) | 0x8000
    half_bits = torch.randint(0, 0x7BFF, (2000,), generator=gen, dtype=torch.int16)
    halves = half_bits.view(torch.float16).double()
    half_ties = ((halves + (half_bits + 1).view(torch.float16).double()) / 2).float()  # exact in fp32
    any_bits = torch.randint(-(2**31), 2**31 - 1, (20000,), generator=gen, dtype=torch.int32)
    named = torch.tensor(
        [math.nan, math.inf, -math.inf, 0.0, -0.0, 65504.0, 65520.0, 65519.99, -65520.0, 2**-24, 2**-25,
         3 * 2**-26, 2**-14, 2**-14 - 2**-25, 1e-45, 3.4028235e38, 1.0 + 2**-8, 1.0 + 3 * 2**-8],
        dtype=torch.float32,
    )
    values = torch.cat([bf16_ties.view(torch.float32), half_ties, -half_ties, any_bits.view(torch.float32), named])
    return torch.cat([values, named[:13]])  # the named ones again at the very end, in the tail of the sweep


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_out_copy_is_bitwise_param_to(isa, out_dtype):
    p = _special_floats(_gen(1))
    n = p.numel()
    m, v, out = torch.zeros(n), torch.zeros(n), torch.empty(n, dtype=out_dtype)
    grad = torch.randn(n, generator=_gen(2))
    # lr 0 keeps every value (NaN, inf, ties) as it is, so the copy sees all of them
    ops.adam_step(p, grad, m, v, lr=0.0, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1,
                  decoupled=True, out=out, isa=isa, threads=THREADS)
    _assert_bits_equal(out, p.to(out_dtype))
    ops.lion_step(p, grad, m, lr=0.0, beta1=0.9, beta2=0.99, weight_decay=0.0, out=out, isa=isa, threads=THREADS)
    _assert_bits_equal(out, p.to(out_dtype))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16])
def test_every_16bit_grad_value_promotes_exactly(isa, grad_dtype):
    grad = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(grad_dtype)
    p, m = torch.zeros(grad.numel()), torch.zeros(grad.numel())
    # beta2 = 0 makes the new m exactly the promoted gradient
    ops.lion_step(p, grad, m, lr=0.0, beta1=0.9, beta2=0.0, weight_decay=0.0, isa=isa, threads=THREADS)
    torch.testing.assert_close(m, grad.float(), rtol=0, atol=0, equal_nan=True)


def _with_zeros(t: torch.Tensor, every: int, negative_every: int) -> torch.Tensor:
    t = t.clone()
    t[::every] = 0.0
    t[::negative_every] = -0.0
    return t


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("grad_dtype", "scale"), GRADS)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("maximize", [False, True])
def test_lion_matches_its_definition_in_torch_ops(isa, grad_dtype, scale, n, maximize):
    gen = _gen(n, str(grad_dtype), maximize)
    lr, beta1, beta2, wd = LION["lr"], LION["beta1"], LION["beta2"], LION["weight_decay"]
    p, m = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 0.1
    out_dtype = OUT_FOR_GRAD[grad_dtype]
    out = None if out_dtype is None else torch.empty(n, dtype=out_dtype)
    exact_zero_directions = 0
    for _ in range(STEPS):
        m = _with_zeros(m, 3, 6)  # exact zeros in m and g, both signs, some in the same places (direction 0)
        grad = _with_zeros(_grad(n, grad_dtype, scale, gen), 2, 4)
        g = _scaled(grad, scale)
        g = -g if maximize else g
        direction = m * beta1 + g * (1 - beta1)
        expected_p = p * (1 - lr * wd) - lr * torch.sign(direction)
        expected_m = m * beta2 + g * (1 - beta2)
        # where the direction is within rounding of 0 its sign may legitimately differ; exact zeros are kept
        rounding = 4 * torch.finfo(torch.float32).eps * ((m * beta1).abs() + (g * (1 - beta1)).abs())
        decided = direction.abs() >= rounding
        exact_zero_directions += int((direction == 0).sum())
        ops.lion_step(p, grad, m, **LION, grad_scale=scale, maximize=maximize, out=out, isa=isa, threads=THREADS)
        assert int((~decided).sum()) <= max(1, n // 1000)
        assert torch.equal(p[decided], expected_p[decided])
        assert torch.equal(m, expected_m)
        if out is not None:
            _assert_bits_equal(out, p.to(out_dtype))
    assert exact_zero_directions > 0


# bf16 moments: loaded into fp32, updated with the fp32 math, stored rounded to nearest even. The references are
# torch ops on fp32 tensors in the kernel's order (each op rounds once, as the kernel's do; no fusion), with m and v
# rounded by torch's own `.to(torch.bfloat16)` after every step, and float64 for each single step.


def _f32(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)  # a Python float rounded to fp32 once, as step_consts.h does


def _adam_f32_ops(p, m, v, grad, scale, step, *, lr, beta1, beta2, eps, weight_decay, decoupled, maximize):
    """One Adam/AdamW step in fp32, op by op: the new (p, m, v) in fp32, p computed with the unrounded m and v."""
    g = grad.float() * _f32(-scale if maximize else scale)
    if not decoupled and weight_decay:
        g = g + _f32(weight_decay) * p
    if decoupled and weight_decay:
        p = p * _f32(1 - lr * weight_decay)
    m, v, w = m.float(), v.float(), _f32(1 - beta1)
    d = g - m
    m = m + w * d if w < 0.5 else g - (_f32(1.0) - w) * d  # torch's lerp, from whichever end is nearer
    v = _f32(beta2) * v + _f32(1 - beta2) * g * g
    # the correctly rounded fp32 sqrt, as the kernels' (torch's own CPU sqrt can be 1 ulp off); rounding the float64
    # root to fp32 gives it exactly (53 >= 2 x 24 + 2 bits)
    sqrt_v = v.double().sqrt().float()
    denom = sqrt_v / _f32(math.sqrt(1 - beta2**step)) + _f32(eps)
    return p + _f32(-lr / (1 - beta1**step)) * m / denom, m, v


def _lion_f32_ops(p, m, grad, scale, *, lr, beta1, beta2, weight_decay, maximize=False):
    g = grad.float() * _f32(-scale if maximize else scale)
    m = m.float()
    direction = _f32(beta1) * m + _f32(1 - beta1) * g
    if weight_decay:
        p = p * _f32(1 - lr * weight_decay)
    return p - _f32(lr) * torch.sign(direction), _f32(beta2) * m + _f32(1 - beta2) * g


def _bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 numbers at |x| (float64; for normal numbers)."""
    _, exponent = torch.frexp(x)
    return torch.ldexp(torch.ones_like(x), exponent - 8)


def _assert_within_one_bf16_ulp(ours: torch.Tensor, exact: torch.Tensor, terms: torch.Tensor) -> None:
    """|ours - exact| <= one bf16 ulp, plus the few fp32 roundings of the terms summed (`terms`: their magnitude),
    which is all there is left where they cancel."""
    bad = (ours.double() - exact).abs() > _bf16_ulp(exact) + 2**-21 * terms
    assert not bool(bad.any()), (ours[bad], exact[bad])


BF16_RULES = [*ADAM_CASES, "lion"]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rule", BF16_RULES)
@pytest.mark.parametrize("n", [15, 4099])
@pytest.mark.parametrize("where", ["in_place", "into", "into_streamed"])
def test_bf16_moments_are_the_fp32_step_rounded_to_bf16(isa, rule, n, where):
    for grad_dtype, scale in (g.values for g in GRADS):
        _run_bf16_moments_against_references(isa, rule, grad_dtype, scale, n, where)


def _run_bf16_moments_against_references(isa, rule, grad_dtype, scale, n, where):
    gen = _gen("bf16-moments", rule, n, str(grad_dtype))
    lion = rule == "lion"
    case = LION if lion else ADAM_CASES[rule]
    p = torch.randn(n, generator=gen)
    m = torch.zeros(n, dtype=torch.bfloat16)
    v = None if lion else torch.zeros(n, dtype=torch.bfloat16)
    ref = [p.clone(), m.clone()] + ([] if lion else [v.clone()])
    out_dtype = OUT_FOR_GRAD[grad_dtype]
    out = None if out_dtype is None else torch.empty(n, dtype=out_dtype)
    for step in range(1, 11):
        grad = _grad(n, grad_dtype, scale, gen)
        state = [p, m] + ([] if lion else [v])
        into = None
        if where != "in_place":  # 3 elements past an aligned start: the kernel peels until it can stream
            into = tuple(torch.full((n + 3,), math.nan, dtype=t.dtype)[3:] for t in state)
        before = [t.clone() for t in state]
        kwargs = dict(grad_scale=scale, out=out, into=into, stream=where == "into_streamed", isa=isa, threads=THREADS)
        if lion:
            ops.lion_step(p, grad, m, **LION, **kwargs)
            new = _lion_f32_ops(ref[0], ref[1], grad, scale, **LION)
            exact_m = (LION["beta2"] * before[1].double() + (1 - LION["beta2"]) * grad.double() * scale,)
            terms = (before[1].double().abs() + grad.double().abs() * scale,)
        else:
            ops.adam_step(p, grad, m, v, **_adam_kwargs(case), step=step, **kwargs)
            new = _adam_f32_ops(*ref, grad, scale, step, **_adam_kwargs(case))
            exact = [t.double() for t in before]
            _adam_f64(*exact, grad.double() * scale, step, **_adam_kwargs(case))
            exact_m = exact[1:]
            g = grad.double() * scale
            terms = (before[1].double().abs() + g.abs() + case["weight_decay"] * before[0].double().abs(),
                     before[2].double() + g * g)
        if into is not None:
            assert all(torch.equal(a, b) for a, b in zip(before, state, strict=True))  # the inputs are untouched
            p, m, v = into[0], into[1], None if lion else into[2]
            state = list(into)
        ref = [new[0]] + [t.to(torch.bfloat16) for t in new[1:]]
        for ours, theirs in zip(state, ref, strict=True):
            _assert_bits_equal(ours, theirs)  # the master too: the same fp32 math on the same bf16 moments
        for ours, theirs, size in zip(state[1:], exact_m, terms, strict=True):  # near the exact value
            _assert_within_one_bf16_ulp(ours, theirs, size)
        if not lion:  # the master within fp32 rounding (decay, add) of the float64 step from the same state
            err = (p.double() - exact[0]).abs()
            step_size = (exact[0] - before[0].double()).abs()
            assert bool((err <= 2**-22 * exact[0].abs() + 2**-18 * step_size).all()), err.max()  # 2 fp32 ulps
        if out is not None:
            _assert_bits_equal(out, p.to(out_dtype))


@pytest.mark.parametrize("isa", ISAS)
def test_bf16_moments_round_ties_to_even_and_keep_nan(isa):
    # beta2 = 0 (Lion's m, Adam's v) and beta1 = 0 (Adam's m) make the new moment the fp32 gradient (or its square):
    # ties, NaN, infinities, subnormals and the overflow edge all reach the bf16 store, in the vectors and the tail
    g = _special_floats(_gen(3))
    n = g.numel()
    p, m = torch.zeros(n), torch.zeros(n, dtype=torch.bfloat16)
    lion = dict(lr=0.0, beta1=0.9, beta2=0.0, weight_decay=0.0)
    ops.lion_step(p, g, m, **lion, isa=isa, threads=THREADS)
    _assert_bits_equal(m, _lion_f32_ops(p, torch.zeros(n), g, 1.0, **lion)[1].to(torch.bfloat16))
    assert int((g.view(torch.int32) & 0xFFFF == 0x8000).sum()) >= 2000  # the ties, rounded to even
    case = dict(lr=0.0, beta1=0.0, beta2=0.0, eps=1e-8, weight_decay=0.0, decoupled=True, maximize=False)
    m, v = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
    ops.adam_step(p, g, m, v, **case, step=1, isa=isa, threads=THREADS)
    _, ref_m, ref_v = _adam_f32_ops(p, torch.zeros(n), torch.zeros(n), g, 1.0, 1, **case)
    _assert_bits_equal(m, ref_m.to(torch.bfloat16))
    _assert_bits_equal(v, ref_v.to(torch.bfloat16))
    assert bool(m.isnan().any())
    assert bool(m.isinf().any())


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("grad_dtype", "scale"), [*GRADS, pytest.param(torch.float32, 0.3, id="fp32-scaled")])
@pytest.mark.parametrize("n", [*SIZES, 1_000_003])
def test_grad_sumsq_matches_float64(isa, grad_dtype, scale, n):
    grad = _grad(n, grad_dtype, scale, _gen(n, str(grad_dtype), scale))
    sumsq, finite = ops.grad_sumsq_finite(grad, scale, isa=isa, threads=THREADS)
    assert finite
    assert sumsq == pytest.approx(((grad.double() * scale) ** 2).sum().item(), rel=1e-6)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("where", [0, 2050, 4098])  # first chunk, second chunk, the tail
def test_grad_sumsq_flags_nan_and_inf(isa, grad_dtype, bad, where):
    grad = torch.randn(4099, generator=_gen(where)).to(grad_dtype)
    grad[where] = bad
    assert ops.grad_sumsq_finite(grad, 0.5, isa=isa, threads=THREADS)[1] is False


@pytest.mark.parametrize("isa", ISAS)
def test_grad_sumsq_finiteness_is_of_the_fp32_scaled_value(isa):
    # 60000 * 4 leaves the fp16 range but is a finite fp32 value: that is what the update uses, so it is finite
    grad = torch.full((33,), 60000.0, dtype=torch.float16)
    sumsq, finite = ops.grad_sumsq_finite(grad, 4.0, isa=isa, threads=THREADS)
    assert finite
    assert sumsq == pytest.approx(33 * 240000.0**2, rel=1e-12)
    # 3e38 * 2 overflows fp32: the scaled value is inf
    assert ops.grad_sumsq_finite(torch.full((33,), 3e38), 2.0, isa=isa, threads=THREADS)[1] is False


def _sweep_all_types(isa: str, threads: int) -> list[torch.Tensor]:
    """Every kernel on every grad/out type from the same inputs; the results, in order."""
    results = []
    n = 10_007
    for grad_dtype, scale in (g.values for g in GRADS):
        for out_dtype, moment_dtype in itertools.product((None, torch.bfloat16, torch.float16), MOMENT_DTYPES):
            gen = _gen(n, str(grad_dtype), str(out_dtype))
            p, m, v = torch.randn(n, generator=gen), torch.randn(n, generator=gen), torch.rand(n, generator=gen)
            m, v = m.to(moment_dtype), v.to(moment_dtype)
            grad = _grad(n, grad_dtype, scale, gen)
            grad[::97] = math.nan
            out = None if out_dtype is None else torch.empty(n, dtype=out_dtype)
            ops.adam_step(p, grad, m, v, **_adam_kwargs(ADAM_CASES["adam_l2"]), step=3, grad_scale=scale, out=out,
                          isa=isa, threads=threads)
            results += [p, m.float(), v.float()] + ([] if out is None else [out.float()])
            ops.lion_step(p, grad, m, **LION, grad_scale=scale, out=out, isa=isa, threads=threads)
            results += [p, m.float()] + ([] if out is None else [out.float()])
    return results


@pytest.mark.parametrize("isa", ISAS)
def test_isas_and_thread_counts_agree_bitwise(isa):
    # every ISA computes the same formula with the same roundings (no FMA contraction), so results are identical
    for ours, scalar in zip(_sweep_all_types(isa, THREADS), _sweep_all_types("scalar", 1), strict=True):
        torch.testing.assert_close(ours, scalar, rtol=0, atol=0, equal_nan=True)
    grad = _grad(100_003, torch.bfloat16, 1.0, _gen(7))
    ours = ops.grad_sumsq_finite(grad, isa=isa, threads=THREADS)[0]
    assert ours == pytest.approx(ops.grad_sumsq_finite(grad, isa="scalar", threads=1)[0], rel=1e-12)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rule", ["adamw", "lion"])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("stream", [True, False])
def test_update_into_other_tensors_equals_in_place(isa, rule, n, stream):
    # the engine's speculative updates write the new state elsewhere (streamed stores) and must equal the cached
    # in-place update bit for bit; slices at odd offsets make the kernel peel elements until it can stream
    gen = _gen("into", isa, rule, n)
    p, m, v = torch.randn(n, generator=gen), torch.randn(n, generator=gen), torch.rand(n, generator=gen)
    grad = _grad(n, torch.bfloat16, 1.0, gen)
    state = (p, m) if rule == "lion" else (p, m, v)
    before = [t.clone() for t in state]
    inplace = [t.clone() for t in state]
    into = [torch.full((n + 3,), math.nan)[3:] for _ in state]  # 3 elements past an aligned start, as out
    out_inplace, out_into = torch.empty(n, dtype=torch.bfloat16), torch.empty(n + 3, dtype=torch.bfloat16)[3:]
    if rule == "lion":
        ops.lion_step(*inplace[:1], grad, inplace[1], **LION, grad_scale=0.5, out=out_inplace, stream=False, isa=isa,
                      threads=THREADS)
        ops.lion_step(p, grad, m, **LION, grad_scale=0.5, out=out_into, into=tuple(into), stream=stream, isa=isa,
                      threads=THREADS)
    else:
        kwargs = dict(_adam_kwargs(ADAM_CASES["adamw"]), step=4, grad_scale=0.5, isa=isa, threads=THREADS)
        ops.adam_step(inplace[0], grad, inplace[1], inplace[2], out=out_inplace, stream=False, **kwargs)
        ops.adam_step(p, grad, m, v, out=out_into, into=tuple(into), stream=stream, **kwargs)
    for old, now in zip(before, state, strict=True):
        assert torch.equal(old, now)  # the inputs are untouched
    for a, b in zip(inplace, into, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(out_inplace.view(torch.int16), out_into.view(torch.int16))
    assert not torch.equal(inplace[0], before[0])  # it did update


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dst_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", SIZES)
def test_accumulate_equals_torch_add(isa, dst_dtype, src_dtype, n):
    gen = _gen("accumulate", isa, dst_dtype, src_dtype, n)
    dst = (torch.randn(n, generator=gen) * 100).to(dst_dtype)
    src = (torch.randn(n, generator=gen) * 100).to(src_dtype)
    if n > 3:
        src[1], src[2] = math.inf, math.nan  # non-finite values pass through as torch's add gives them
    copied = dst.clone()
    expected = dst.clone().add_(src)
    ops.accumulate(dst, src, isa=isa, threads=THREADS)
    assert torch.equal(dst.isnan(), expected.isnan())
    keep = ~expected.isnan()
    assert torch.equal(dst[keep], expected[keep])
    ops.accumulate(copied, src, replace=True, isa=isa, threads=THREADS)  # the first micro-batch of a window
    expected = torch.empty_like(copied).copy_(src)
    assert torch.equal(copied.isnan(), expected.isnan())
    assert torch.equal(copied[~expected.isnan()], expected[~expected.isnan()])


def test_accumulate_rejects_mismatched_sizes():
    with pytest.raises(ValueError, match="src"):
        ops.accumulate(torch.zeros(8), torch.zeros(9))
    with pytest.raises(ValueError, match="into"):
        ops.adam_step(torch.zeros(8), torch.zeros(8), torch.zeros(8), torch.zeros(8), lr=1e-3, beta1=0.9,
                      beta2=0.999, eps=1e-8, weight_decay=0.0, step=1, decoupled=True, into=(torch.zeros(8),))


@pytest.mark.parametrize("isa", ISAS)
def test_empty_tensors_are_a_no_op(isa):
    e = torch.empty(0)
    ops.adam_step(e, e, e, e, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, step=1, decoupled=True,
                  out=torch.empty(0, dtype=torch.bfloat16), isa=isa, threads=THREADS)
    ops.lion_step(e, e, e, **LION, isa=isa, threads=THREADS)
    assert ops.grad_sumsq_finite(e, isa=isa, threads=THREADS) == (0.0, True)


def _adam_call(param, grad, exp_avg, exp_avg_sq, out=None, **overrides):
    kwargs = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1, decoupled=True, out=out,
                  isa="scalar", threads=1)
    ops.adam_step(param, grad, exp_avg, exp_avg_sq, **{**kwargs, **overrides})


def test_bad_tensors_raise_instead_of_copying():
    t = lambda n=64, dtype=torch.float32: torch.zeros(n, dtype=dtype)  # noqa: E731
    with pytest.raises(ValueError, match="param must be contiguous"):
        _adam_call(t(128)[::2], t(), t(), t())
    with pytest.raises(ValueError, match="grad must be contiguous"):
        _adam_call(t(), t(128, torch.bfloat16)[::2], t(), t())
    with pytest.raises(ValueError, match="exp_avg_sq must be contiguous"):
        _adam_call(t(), t(), t(), t(128)[::2])
    with pytest.raises(ValueError, match="out must be contiguous"):
        _adam_call(t(), t(), t(), t(), out=t(128, torch.bfloat16)[::2])
    with pytest.raises(ValueError, match="param must be float32"):
        _adam_call(t(dtype=torch.float64), t(), t(), t())
    with pytest.raises(ValueError, match="grad must be float32, bfloat16 or float16"):
        _adam_call(t(), t(dtype=torch.int32), t(), t())
    with pytest.raises(ValueError, match=r"exp_avg \(an optimizer moment\) must be float32 or bfloat16, got Double"):
        _adam_call(t(), t(), t(dtype=torch.float64), t())
    with pytest.raises(ValueError, match=r"exp_avg_sq \(an optimizer moment\) must be float32 or bfloat16, got Half"):
        _adam_call(t(), t(), t(), t(dtype=torch.float16))
    with pytest.raises(ValueError, match=r"exp_avg_sq must have exp_avg's dtype \(BFloat16\), got Float"):
        _adam_call(t(), t(), t(dtype=torch.bfloat16), t())
    bf16 = t(dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"into\[2\] must be BFloat16 like the state it replaces, got Float"):
        _adam_call(t(), t(), bf16, bf16.clone(), into=(t(), bf16.clone(), t()))
    with pytest.raises(ValueError, match=r"exp_avg \(an optimizer moment\) must be float32 or bfloat16, got Half"):
        ops.lion_step(t(), t(), t(dtype=torch.float16), lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=0.0, isa="scalar")
    with pytest.raises(ValueError, match="out must be bfloat16 or float16"):
        _adam_call(t(), t(), t(), t(), out=t())
    with pytest.raises(ValueError, match="grad has 65 elements, param has 64"):
        _adam_call(t(), t(65), t(), t())
    with pytest.raises(ValueError, match="out has 63 elements"):
        _adam_call(t(), t(), t(), t(), out=t(63, torch.float16))
    with pytest.raises(ValueError, match="must be a CPU tensor"):
        _adam_call(t(), torch.zeros(64, device="meta"), t(), t())
    with pytest.raises(ValueError, match="exp_avg must be contiguous"):
        ops.lion_step(t(), t(), t(128)[::2], lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=0.0, isa="scalar")
    with pytest.raises(ValueError, match="grad must be contiguous"):
        ops.grad_sumsq_finite(t(128)[::2], isa="scalar")


def test_bad_arguments_raise():
    t = lambda: torch.zeros(64)  # noqa: E731
    with pytest.raises(ValueError, match="step counts this step"):
        _adam_call(t(), t(), t(), t(), step=0)
    with pytest.raises(ValueError, match="threads must be"):
        _adam_call(t(), t(), t(), t(), threads=0)
    with pytest.raises(ValueError, match=r"choose one of: .*scalar"):
        _adam_call(t(), t(), t(), t(), isa="bogus")
    for missing in {"avx512", "avx2", "scalar"} - set(ISAS):  # refused before any of its instructions runs
        with pytest.raises(ValueError, match=f"isa '{missing}' is not one this CPU runs"):
            _adam_call(t(), t(), t(), t(), isa=missing)


def test_zoff_isa_env_var(monkeypatch):
    monkeypatch.setenv("ZOFF_ISA", "bogus")
    with pytest.raises(ValueError, match=f"ZOFF_ISA='bogus'.*{', '.join(ISAS)}"):
        ops.selected_isa()
    monkeypatch.setenv("ZOFF_ISA", "scalar")
    assert ops.selected_isa() == "scalar"
    monkeypatch.delenv("ZOFF_ISA")
    assert ops.selected_isa() == ISAS[0]
    assert ISAS[-1] == "scalar"


@pytest.mark.parametrize("isa", ISAS)
def test_stream_probe_reports_bandwidths(isa):
    gbps = ops.stream_probe(nbytes=1 << 22, threads=THREADS, isa=isa)
    expected = {"read", "copy", "triad"} | (set() if isa == "scalar" else {"copy_nt", "triad_nt"})
    assert set(gbps) == expected
    assert all(math.isfinite(x) and x > 0 for x in gbps.values())
