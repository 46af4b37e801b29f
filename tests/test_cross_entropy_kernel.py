"""The Triton softmax / cross-entropy kernel of `fxspeed::linear_cross_entropy`
(runtime/kernels/cross_entropy.py) against the torch path.

`chunk_loss_and_grad` (one chunk's row losses and logit gradient d) sends a chunk to the kernel when
its logits are on CUDA, or on the CPU under Triton's interpreter (TRITON_INTERPRET=1); otherwise it
runs the torch implementation, unchanged. The interpreter must be on before triton is first
imported (and importing fxspeed imports it, through torch's AOT autograd), so the interpreted
tests run in a child pytest started with TRITON_INTERPRET=1
(`test_the_kernel_matches_the_torch_path_under_triton_s_interpreter`), and are skipped in a process
without it. In that child the torch path is reached by patching `kernel_applies` to False. On a
GPU machine the `cuda` tests at the bottom check the compiled kernel at realistic sizes.

Tolerances: fp32 row losses and d within 2e-6 of the torch path (relative to the row's scale:
|lse| for the loss, ||d|| + multiplier for d; see `check_chunk`); 16-bit d
within one unit in the last place of the torch path's, element by element, and at most 1% of them
off at all (the interpreter's runs here give bit-identical 16-bit d; the fp32 values before the
rounding differ by ~1e-7, which can move a value across a rounding boundary).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import INTERPRETING, needs_compiled_kernels, needs_interpreter, rel_err, run_interpreted
from fxspeed.runtime.kernels import cross_entropy as ce

INTERPRETED_TESTS = ("test_the_kernel_gives_the_torch_path_s_row_losses_and_logit_gradients",
                     "test_the_op_gives_the_torch_path_s_loss_and_gradients_with_the_kernel",
                     "test_a_chunk_whose_rows_are_all_ignored_gets_zero_loss_and_zero_gradient",
                     "test_the_kernel_writes_d_over_logits_of_its_dtype_and_elsewhere_otherwise")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
IGNORE = -100
RTOL = 2e-6  # fp32: row losses and d, relative to the row's scale
GRAD_RTOL = {torch.float32: 2e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}  # the op's gradients, ||.||-relative


def test_the_kernel_matches_the_torch_path_under_triton_s_interpreter() -> None:
    """Runs the interpreted tests of this file in a child pytest that sets TRITON_INTERPRET=1 from the start."""
    run_interpreted(__file__, INTERPRETED_TESTS)


# --- helpers -------------------------------------------------------------------------------------

def make_chunk(M: int, V: int, dtype: torch.dtype, ignored: float, reduction: int, seed: int,
               device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits [M, V] in dtype, target [M], ok [M], scale []) as the op's loop makes them; a
    fraction `ignored` of the rows has target == IGNORE (all of them when ignored == 1)."""
    g = torch.Generator().manual_seed(seed)
    logits = (4 * torch.randn(M, V, generator=g)).to(dtype)
    target = torch.randint(0, V, (M,), generator=g)
    target[torch.rand(M, generator=g) < ignored] = IGNORE
    logits, target = logits.to(device), target.to(device)
    ok = target != IGNORE
    count = ok.sum().to(torch.float32)
    scale = 1.0 / count if reduction == 1 else torch.ones((), dtype=torch.float32, device=device)
    return logits, target, ok, scale


def both_paths(logits: torch.Tensor, target: torch.Tensor, ok: torch.Tensor, scale: torch.Tensor,
               dtype: torch.dtype) -> tuple[tuple, tuple]:
    """((row_loss, d) from the kernel, (row_loss, d) from the torch path), each on a fresh copy of
    the logits (both overwrite them)."""
    assert ce.kernel_applies(logits)
    out = ce.chunk_loss_and_grad(logits.clone(), target, ok, scale, dtype)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(ce, "kernel_applies", lambda *a: False)
        ref = ce.chunk_loss_and_grad(logits.clone(), target, ok, scale, dtype)
    return out, ref


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in units in the last place of a 16-bit float dtype (+0 and -0 the same), elementwise."""
    def ordered(t: torch.Tensor) -> torch.Tensor:
        i = t.view(torch.int16).to(torch.int32)
        return torch.where(i < 0, -(i & 0x7FFF), i)
    return (ordered(a) - ordered(b)).abs()


def check_chunk(logits: torch.Tensor, ok: torch.Tensor, scale: torch.Tensor, out: tuple, ref: tuple) -> dict:
    """Asserts the kernel's (row_loss, d) are the torch path's: same dtypes and shapes; exact zeros
    on ignored rows; fp32 loss per row and fp32 d per row within RTOL of the row's scale; 16-bit d
    within one ulp. Returns the errors seen.

    A row of d is (softmax - onehot) * mult: its values are probabilities (<= 1) times mult, each
    exact to about an ulp of the probability; where the target's probability is near 1, p - 1 cancels
    and ||d|| is far below mult, so the scale of a row's error is ||d|| + mult, not ||d|| alone."""
    (loss, d), (ref_loss, ref_d) = out, ref
    assert (loss.dtype, loss.shape, d.dtype, d.shape) == (ref_loss.dtype, ref_loss.shape, ref_d.dtype, ref_d.shape)
    assert not loss[~ok].any() and not d[~ok].any(), "an ignored row got a loss or a gradient"
    assert torch.isfinite(loss).all() and torch.isfinite(d.float()).all()
    row_scale = logits.float().abs().amax(1) + ref_loss.abs() + 1  # the loss is lse - picked: errors scale with |lse|
    loss_err = ((loss - ref_loss).abs() / row_scale).max().item()
    assert loss_err <= RTOL, f"row loss differs by {loss_err:.3g} of its scale"
    seen = dict(loss=loss_err)
    if d.dtype == torch.float32:
        diff = (d.double() - ref_d.double()).norm(dim=1)
        norm = ref_d.double().norm(dim=1) + torch.where(ok, scale, 0.0).double()
        rel = (diff / norm.clamp_min(1e-300)).max().item()
        assert (diff <= RTOL * norm).all(), f"d differs by {rel:.3g} of a row's scale"
        seen["d"] = rel
    else:
        u = ulps(d, ref_d)
        assert u.max().item() <= 1, f"d differs by {u.max().item()} ulp"
        # rarely, not as a rounding mode would (truncation moves about half of all values)
        assert int((u > 0).sum()) <= 1 + d.numel() // 100, f"{int((u > 0).sum())} of {d.numel()} values differ"
        seen["d_ulp"] = u.max().item()
        seen["d_differing"] = int((u > 0).sum())
    return seen


def run_op(h: torch.Tensor, wt: torch.Tensor, target: torch.Tensor, reduction: int, rows: int,
           kernel: bool) -> tuple:
    """linear_cross_entropy through the op, with the kernel or the torch path; counts kernel launches."""
    launches = []
    launch = ce._chunk_triton
    with pytest.MonkeyPatch.context() as m:
        m.setattr(ce, "_chunk_triton", lambda *a: launches.append(1) or launch(*a))
        if not kernel:
            m.setattr(ce, "kernel_applies", lambda *a: False)
        out = torch.ops.fxspeed.linear_cross_entropy(h, wt, target, IGNORE, reduction, rows)
    return out, len(launches)


# --- interpreted -------------------------------------------------------------------------------

def slices(V: int) -> st.SearchStrategy[int]:
    """BLOCK_V for a row of V columns: the op's, or one that splits the row into at most 6 slices
    (the interpreter takes ~1 ms per slice and row, whatever its width)."""
    return st.sampled_from([b for b in (16, 128, 1024) if -(-V // b) <= 6] + [ce.BLOCK_V])


@settings(max_examples=15, deadline=None, derandomize=True)
@given(data=st.data(), M=st.integers(1, 40), V=st.one_of(st.integers(1, 40), st.integers(1, 3000)),
       dtype=st.sampled_from(sorted(DTYPES)), ignored=st.sampled_from([0.0, 0.3, 1.0]),
       reduction=st.sampled_from([1, 2]), seed=st.integers(0, 2**16))
def test_the_kernel_gives_the_torch_path_s_row_losses_and_logit_gradients(data, M, V, dtype, ignored, reduction,
                                                                         seed) -> None:
    """Rows of 1-3000 columns (powers of two or not, narrower than a slice or over several slices),
    fp32 and 16-bit logits, some or all rows ignored, scales of mean and sum."""
    needs_interpreter()
    block = data.draw(slices(V), label="BLOCK_V")
    logits, target, ok, scale = make_chunk(M, V, DTYPES[dtype], ignored, reduction, seed)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(ce, "BLOCK_V", block)
        out, ref = both_paths(logits, target, ok, scale, DTYPES[dtype])
    check_chunk(logits, ok, scale, out, ref)


@settings(max_examples=15, deadline=None, derandomize=True)
@given(data=st.data(), n=st.integers(1, 40), c=st.integers(1, 16),
       v=st.one_of(st.integers(1, 40), st.integers(1, 3000)), rows=st.integers(1, 48),
       dtype=st.sampled_from(sorted(DTYPES)), ignored=st.sampled_from([0.0, 0.3, 1.0]),
       reduction=st.sampled_from([1, 2]), seed=st.integers(0, 2**16))
def test_the_op_gives_the_torch_path_s_loss_and_gradients_with_the_kernel(data, n, c, v, rows, dtype, ignored,
                                                                         reduction, seed) -> None:
    """`fxspeed::linear_cross_entropy` (chunks of `rows` rows) with every chunk through the kernel:
    the loss, grad_h and grad_wt_t of the torch path (NaN loss and zero gradients when every
    target is ignored under mean, as there)."""
    needs_interpreter()
    block = data.draw(slices(v), label="BLOCK_V")
    g = torch.Generator().manual_seed(seed)
    dt = DTYPES[dtype]
    h = torch.randn(n, c, generator=g).to(dt)
    wt = torch.randn(c, v, generator=g).to(dt)
    target = torch.randint(0, v, (n,), generator=g)
    target[torch.rand(n, generator=g) < ignored] = IGNORE
    with pytest.MonkeyPatch.context() as m:
        m.setattr(ce, "BLOCK_V", block)
        (loss, gh, gwt), launches = run_op(h, wt, target, reduction, rows, kernel=True)
    (ref_loss, ref_gh, ref_gwt), ref_launches = run_op(h, wt, target, reduction, rows, kernel=False)
    assert launches == -(-n // rows) and ref_launches == 0
    assert (gh.dtype, gwt.dtype, gwt.shape) == (dt, dt, (v, c))
    if torch.isnan(ref_loss):
        assert torch.isnan(loss) and not gh.any() and not gwt.any()
        return
    assert abs(loss.item() - ref_loss.item()) <= RTOL * (abs(ref_loss.item()) + 1)
    for a, b in ((gh, ref_gh), (gwt, ref_gwt)):
        assert rel_err(a, b) <= GRAD_RTOL[dt], f"{dtype}: relative error {rel_err(a, b):.3g}"


@pytest.mark.parametrize("reduction", [1, 2])
@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_a_chunk_whose_rows_are_all_ignored_gets_zero_loss_and_zero_gradient(dtype, reduction) -> None:
    """Every target ignore_index: the multiplier is 0 on every row (under mean the scale is 1/0),
    and the kernel writes zero losses and an all-zero d (no NaN from inf * 0)."""
    needs_interpreter()
    logits, target, ok, scale = make_chunk(5, 300, DTYPES[dtype], 1.0, reduction, seed=3)
    assert not ok.any()
    with pytest.MonkeyPatch.context() as m:
        m.setattr(ce, "BLOCK_V", 128)
        out, ref = both_paths(logits, target, ok, scale, DTYPES[dtype])
    check_chunk(logits, ok, scale, out, ref)
    assert not out[0].any() and not out[1].any()


def test_the_kernel_writes_d_over_logits_of_its_dtype_and_elsewhere_otherwise() -> None:
    """bf16 logits and bf16 d: d is the logits' storage (no second [M, V] block); fp32 logits and
    bf16 d (h in bf16, logits from an fp32 matmul): a fresh bf16 d, rounded once from fp32, as the
    torch path's `.to`."""
    needs_interpreter()
    logits, target, ok, scale = make_chunk(6, 700, torch.bfloat16, 0.3, 1, seed=5)
    x = logits.clone()
    loss, d = ce.chunk_loss_and_grad(x, target, ok, scale, torch.bfloat16)
    assert d.data_ptr() == x.data_ptr()
    logits32, *_ = make_chunk(6, 700, torch.float32, 0.3, 1, seed=5)
    out, ref = both_paths(logits32, target, ok, scale, torch.bfloat16)
    assert out[1].dtype == torch.bfloat16
    check_chunk(logits32, ok, scale, out, ref)


# --- dispatch, without the interpreter ----------------------------------------------------------

def test_on_the_cpu_without_the_interpreter_the_torch_path_runs_and_no_kernel_is_built() -> None:
    if INTERPRETING:
        pytest.skip("checks the dispatch of a process without TRITON_INTERPRET=1")
    logits, target, ok, scale = make_chunk(4, 50, torch.float32, 0.3, 1, seed=0)
    assert not ce.kernel_applies(logits)
    built = ce._make_kernel.cache_info().currsize
    ce.chunk_loss_and_grad(logits, target, ok, scale, torch.float32)
    h, wt = torch.randn(7, 5), torch.randn(5, 50)
    (loss, _, _), launches = run_op(h, wt, torch.randint(0, 50, (7,)), 1, 3, kernel=True)
    assert launches == 0 and torch.isfinite(loss)
    assert ce._make_kernel.cache_info().currsize == built


def test_logits_the_kernel_does_not_take_go_to_the_torch_path(monkeypatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # wherever the kernel could run, these still may not
    pytest.importorskip("triton")
    assert not ce.kernel_applies(torch.zeros(4, 6).t())  # columns not contiguous
    assert not ce.kernel_applies(torch.zeros(4, 0))  # an empty vocabulary
    assert not ce.kernel_applies(torch.zeros(4, 6, dtype=torch.float64))


# --- the cuda tier ----------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the cuda tier needs a CUDA device")
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("V", [32000, 50257])
def test_the_compiled_kernel_matches_the_torch_path_on_cuda(V, dtype) -> None:
    """4096 rows of GPT-2's and Llama's vocabularies (50257 is not a multiple of any slice), some
    rows ignored, the mean's scale."""
    needs_compiled_kernels()
    logits, target, ok, scale = make_chunk(4096, V, DTYPES[dtype], 0.1, 1, seed=0, device="cuda")
    check_chunk(logits, ok, scale, *both_paths(logits, target, ok, scale, DTYPES[dtype]))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the cuda tier needs a CUDA device")
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_on_cuda_the_op_gives_the_torch_path_s_loss_and_gradients_with_the_kernel(dtype) -> None:
    """GPT-2's head: 4096 rows of width 768 over 50257 columns, in the chunks the rewrite picks."""
    needs_compiled_kernels()
    g = torch.Generator().manual_seed(0)
    dt = DTYPES[dtype]
    h = (torch.randn(4096, 768, generator=g) / 4).to(dt).cuda()
    wt = (torch.randn(768, 50257, generator=g) / 8).to(dt).cuda()
    target = torch.randint(0, 50257, (4096,), generator=g)
    target[::7] = IGNORE
    target = target.cuda()
    rows = ce.rows_per_chunk(50257)
    (loss, gh, gwt), launches = run_op(h, wt, target, 1, rows, kernel=True)
    (ref_loss, ref_gh, ref_gwt), _ = run_op(h, wt, target, 1, rows, kernel=False)
    assert launches == -(-4096 // rows)
    assert abs(loss.item() - ref_loss.item()) <= RTOL * (abs(ref_loss.item()) + 1)
    for a, b in ((gh, ref_gh), (gwt, ref_gwt)):
        assert rel_err(a, b) <= GRAD_RTOL[dt], f"{dtype}: relative error {rel_err(a, b):.3g}"
