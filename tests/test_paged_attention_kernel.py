"""The Triton paged-attention kernel (runtime/kernels/paged_attention.py) against the torch path.

`paged_attention_impl` sends a call to the kernel when q is on CUDA, or on the CPU under Triton's
interpreter (TRITON_INTERPRET=1); otherwise it runs the torch implementation, unchanged. The
interpreter must be on before triton is first imported (and importing fxspeed imports it, through
torch's AOT autograd), so the interpreted tests run in a child pytest started with
TRITON_INTERPRET=1 (`test_the_kernel_matches_the_torch_path_under_triton_s_interpreter`), and are
skipped in a process without it. In that child the torch path is reached by patching
`kernel_applies` to False. On a GPU machine the `cuda` tests at the bottom check the compiled kernel.
"""

from __future__ import annotations


import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import INTERPRETING, needs_compiled_kernels, needs_interpreter, run_interpreted
import fxspeed
from fxspeed.runtime.kernels import paged_attention as pa

INTERPRETED_TESTS = ("test_the_kernel_gives_the_torch_path_s_attention_and_cache_over_mixed_batches",
                     "test_a_decode_step_over_long_contexts_matches_the_torch_path",
                     "test_a_llama_served_with_the_kernel_gives_the_torch_path_s_greedy_tokens")

# numpy's "invalid value encountered in divide" under the interpreter is a NaN the kernel made (in
# rows it does not store, but made): under a window the key loop may start past a dummy row's key
pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# ||kernel - torch|| <= TOL ||torch|| + ATOL sqrt(numel), in the dtype of the computation (q's)
TOL = {"fp32": 1e-5, "bf16": 2e-2, "fp16": 4e-3}
ATOL = {"fp32": 1e-6, "bf16": 1e-2, "fp16": 1e-3}




def test_the_kernel_matches_the_torch_path_under_triton_s_interpreter() -> None:
    """Runs the interpreted tests of this file in a child pytest that sets TRITON_INTERPRET=1 from the start."""
    run_interpreted(__file__, INTERPRETED_TESTS)


# --- a serving step, built the way runtime/serving.py builds one ------------------------------

def make_step(queries: list[int], contexts: list[int], H: int, Hkv: int, D: int, block_size: int, pad: int,
              dtype: torch.dtype, cache_dtype: torch.dtype, seed: int, device: str = "cpu") -> tuple[tuple, torch.Tensor]:
    """The arguments of one `paged_attention_impl` call, and the cache slots it has no reason to
    read ([num_blocks, block_size] bool). Sequence s feeds queries[s] tokens after contexts[s]
    cached ones (a decode token when 1 and the context is non-empty, a prompt chunk otherwise),
    packed in one row with `pad` padding tokens at the end (the bucket's); the sequences' blocks
    are scattered over a cache whose other slots hold noise; short sequences leave dummy query
    slots (query_index == T) and zero block-table entries."""
    g = torch.Generator().manual_seed(seed)
    S, Q, T = len(queries), max(queries), sum(queries) + pad
    need = [-(-(c + n) // block_size) for c, n in zip(contexts, queries)]
    NB, num_blocks = max(need), sum(need) + 2  # block 0: the padding tokens' harmless writes
    order = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    k_cache = torch.randn(num_blocks, block_size, Hkv, D, generator=g).to(cache_dtype)
    v_cache = torch.randn(num_blocks, block_size, Hkv, D, generator=g).to(cache_dtype)
    q = torch.randn(1, T, H, D, generator=g).to(dtype).transpose(1, 2)  # the SDPA input's layout
    k = torch.randn(1, Hkv, T, D, generator=g).to(dtype)
    v = torch.randn(1, Hkv, T, D, generator=g).to(dtype)
    slot_mapping = torch.zeros(T, dtype=torch.long)
    block_table = torch.zeros(S, NB, dtype=torch.long)
    query_index = torch.full((S, Q), T, dtype=torch.long)
    query_pos = torch.zeros(S, Q, dtype=torch.long)
    unread = torch.ones(num_blocks * block_size, dtype=torch.bool)
    at = 0
    for s, (c, n, nb) in enumerate(zip(contexts, queries, need)):
        blocks = torch.tensor([order.pop() for _ in range(nb)])
        pos = torch.arange(c, c + n)
        block_table[s, :nb] = blocks
        slot_mapping[at:at + n] = blocks[pos // block_size] * block_size + pos % block_size
        query_index[s, :n] = torch.arange(at, at + n)
        query_pos[s, :n] = pos
        seen = torch.arange(c + n)
        unread[blocks[seen // block_size] * block_size + seen % block_size] = False
        at += n
    args = (q, k, v, k_cache, v_cache, slot_mapping, block_table, query_index, query_pos, D ** -0.5)
    return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args), \
        unread.view(num_blocks, block_size).to(device)


def run_both(args: tuple, unread: torch.Tensor) -> tuple[torch.Tensor, tuple, torch.Tensor, tuple]:
    """(kernel result, its caches, torch result, its caches), each from fresh copies of the caches;
    the kernel's hold NaN in the `unread` slots (a slot it read there would spread NaN into its
    result), the torch path's the noise (it gathers every slot of a sequence's blocks, and masks)."""
    def call(poison: bool) -> tuple[torch.Tensor, tuple]:
        caches = (args[3].clone(), args[4].clone())
        if poison:
            for c in caches:
                c[unread] = float("nan")
        return pa.paged_attention_impl(*args[:3], *caches, *args[5:]), caches

    assert pa.kernel_applies(args[0], args[3], args[4], args[6], args[7])
    out, caches = call(poison=True)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(pa, "kernel_applies", lambda *a: False)
        ref, ref_caches = call(poison=False)
    return out, caches, ref, ref_caches


def check(args: tuple, unread: torch.Tensor, out: torch.Tensor, caches: tuple, ref: torch.Tensor,
          ref_caches: tuple, dtype: str) -> float:
    """Asserts the kernel's result is the torch path's (same shape, strides, dtype; values within
    the dtype's tolerance; exact zeros at the tokens no query slot names) and the caches' read
    slots bit-identical after the write; returns the relative error."""
    assert (out.shape, out.stride(), out.dtype) == (ref.shape, ref.stride(), ref.dtype)
    assert all(torch.equal(a[~unread], b[~unread]) for a, b in zip(caches, ref_caches)), "the cache write differs"
    assert not out.isnan().any(), "the kernel read a slot past a sequence's last query position, or another's"
    T = out.shape[2]
    unnamed = torch.ones(T + 1, dtype=torch.bool, device=out.device)
    unnamed[args[7].reshape(-1)] = False
    assert not out[0][:, unnamed[:T]].any(), "a padding token's row was written"
    diff, norm = (out.double() - ref.double()).norm().item(), ref.double().norm().item()
    assert diff <= TOL[dtype] * norm + ATOL[dtype] * out.numel() ** 0.5, \
        f"{dtype}: ||kernel - torch|| = {diff:.3g}, ||torch|| = {norm:.3g}"
    return diff / norm


@settings(max_examples=25, deadline=None, derandomize=True)
@given(data=st.data(), S=st.integers(1, 3), Hkv=st.sampled_from([1, 2]), group=st.sampled_from([1, 2, 3, 4]),
       D=st.sampled_from([8, 16, 24, 32]), block_size=st.sampled_from([1, 2, 4, 8, 16]),
       dtype=st.sampled_from(sorted(DTYPES)), cache_dtype=st.sampled_from(["same", *sorted(DTYPES)]),
       pad=st.integers(0, 3), window=st.sampled_from([0, 0, 1, 3, 8]))
def test_the_kernel_gives_the_torch_path_s_attention_and_cache_over_mixed_batches(
        data, S, Hkv, group, D, block_size, dtype, cache_dtype, pad, window) -> None:
    """Mixed steps (prompt chunks of several tokens beside decode tokens, contexts over several
    blocks, dummy query slots, bucket padding), GQA ratios 1-4, head dims not all powers of two,
    caches in q's dtype or another (the torch path casts K/V to q's), with or without a sliding
    window (1: each query sees itself only)."""
    needs_interpreter()
    queries = data.draw(st.lists(st.integers(1, 5), min_size=S, max_size=S), label="queries")
    contexts = data.draw(st.lists(st.integers(0, 20), min_size=S, max_size=S), label="contexts")
    cdt = DTYPES[dtype if cache_dtype == "same" else cache_dtype]
    args, unread = make_step(queries, contexts, Hkv * group, Hkv, D, block_size, pad, DTYPES[dtype], cdt,
                             seed=data.draw(st.integers(0, 2 ** 16), label="seed"))
    args = (*args, window)
    check(args, unread, *run_both(args, unread), dtype)


@pytest.mark.parametrize("window", [0, 40])
@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_a_decode_step_over_long_contexts_matches_the_torch_path(dtype, window) -> None:
    """Decode only (one query per sequence), contexts spanning many blocks and several of the
    kernel's key tiles, one sequence at position 0 (a prompt of one token). With a window of 40,
    the query at 150 sees no key in the kernel's first tiles: those hold NaN here, and the kernel
    must not read them (it starts at the tile of the window's first key)."""
    needs_interpreter()
    args, unread = make_step([1, 1, 1, 1], [150, 0, 63, 64], 8, 2, 64, 16, 1, DTYPES[dtype], DTYPES[dtype], seed=1)
    if window:
        block_n = pa._tiles(1, 4, 64, dtype == "fp32")[3]
        _, _, _, _, _, _, bt, _, qp, _ = args
        for s in range(bt.shape[0]):
            behind = torch.arange((max(int(qp[s, 0]) - window + 1, 0)) // block_n * block_n)
            unread.view(-1)[bt[s, behind // 16] * 16 + behind % 16] = True
    args = (*args, window)
    check(args, unread, *run_both(args, unread), dtype)


@settings(max_examples=40, deadline=None)
@given(queries=st.lists(st.integers(1, 5), min_size=1, max_size=3), data=st.data(),
       block_size=st.sampled_from([1, 2, 4, 8]), window=st.integers(0, 12), pad=st.integers(0, 2))
def test_the_torch_path_attends_each_query_s_causal_window_over_mixed_steps(queries, data, block_size, window,
                                                                            pad) -> None:
    """The torch path (which on the CPU attends a mixed step's decode tokens apart from its prompt
    chunks, and gathers only the blocks from each sequence's window start) against a dense
    reference: each query attends the last `window` positions of its sequence, itself included
    (0: every position up to its own)."""
    contexts = data.draw(st.lists(st.integers(0, 30), min_size=len(queries), max_size=len(queries)), label="contexts")
    args, _ = make_step(queries, contexts, 4, 2, 8, block_size, pad, torch.float32, torch.float32, seed=3)
    q, k, v, kc, vc, slots, bt, qi, qp, scale = args
    with pytest.MonkeyPatch.context() as m:
        m.setattr(pa, "kernel_applies", lambda *a: False)
        out = pa.paged_attention_impl(q, k, v, kc.clone(), vc.clone(), slots, bt, qi, qp, scale, window)
    kflat, vflat = pa._write_cache(k, v, kc.clone(), vc.clone(), slots)
    for s in range(bt.shape[0]):
        for i in range(qi.shape[1]):
            t, p = int(qi[s, i]), int(qp[s, i])
            if t == q.shape[2]:
                continue
            keys = torch.arange(max(0, p - window + 1) if window else 0, p + 1)
            at = bt[s, keys // block_size] * block_size + keys % block_size
            K, V = kflat[at].transpose(0, 1), vflat[at].transpose(0, 1)  # [Hkv, n, D]
            K, V = K.repeat_interleave(2, 0), V.repeat_interleave(2, 0)
            w = torch.softmax(q[0, :, t, None] @ K.transpose(1, 2) * scale, -1)
            torch.testing.assert_close(out[0, :, t], (w @ V)[:, 0], rtol=1e-5, atol=1e-6)


def _tiny_hf(name: str) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    if name == "gpt2":
        cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=64, vocab_size=96,
                                      attn_implementation="sdpa", initializer_range=0.2)
        return transformers.GPT2LMHeadModel(cfg).eval()
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                   num_key_value_heads=2, initializer_range=0.2, vocab_size=96,
                                   max_position_embeddings=64, attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(cfg).eval()


PROMPTS = [[5, 17, 3], list(range(10, 21)), [7]]  # chunked over a token budget of 8, blocks of 4
NEW = [4, 3, 5]


def serve_with_and_without_the_kernel(model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch) -> tuple:
    """(tokens, logits) of `model` served with the kernel, then with the torch path (the same
    engine, so the same programs: only the attention's implementation differs); and how many
    attention calls the kernel ran."""
    launches = []
    launch = pa._paged_attention_triton
    monkeypatch.setattr(pa, "_paged_attention_triton", lambda *a: launches.append(1) or launch(*a))
    engine = fxspeed.serve(model, token_budget=8, max_batch=3, block_size=4, cache_tokens=64)
    results = []
    for kernel in (True, False):
        if not kernel:
            monkeypatch.setattr(pa, "kernel_applies", lambda *a: False)
        engine._serving.record_logits = {}
        tokens = engine.generate(PROMPTS, max_new_tokens=NEW)
        results.append((tokens, engine._serving.record_logits))
    return results[0], results[1], len(launches)


def test_a_llama_served_with_the_kernel_gives_the_torch_path_s_greedy_tokens(monkeypatch) -> None:
    """fxspeed.serve on the CPU under the interpreter: the attentions of every step go through the
    kernel (GQA: 4 query heads over 2 KV heads; prompt chunks beside decode tokens), and the greedy
    tokens and logits are the torch path's. (Only Llama here: the interpreter is slow; the cuda
    tier serves GPT-2 too.)"""
    needs_interpreter()
    (tokens, logits), (ref_tokens, ref_logits), launches = serve_with_and_without_the_kernel(_tiny_hf("llama"),
                                                                                             monkeypatch)
    assert launches > 0
    assert tokens == ref_tokens
    for i in range(len(PROMPTS)):
        torch.testing.assert_close(torch.stack(logits[i]), torch.stack(ref_logits[i]), rtol=0, atol=1e-4)


# --- dispatch, without the interpreter ----------------------------------------------------------

def test_on_the_cpu_without_the_interpreter_the_torch_path_runs_and_no_kernel_is_built() -> None:
    if INTERPRETING:
        pytest.skip("checks the dispatch of a process without TRITON_INTERPRET=1")
    args, unread = make_step([3, 1], [0, 9], 4, 2, 8, 4, 1, torch.float32, torch.float32, seed=0)
    assert not pa.kernel_applies(args[0], args[3], args[4], args[6], args[7])
    built = pa._make_kernel.cache_info().currsize
    pa.paged_attention_impl(*args)
    assert pa._make_kernel.cache_info().currsize == built


def test_heads_wider_than_the_kernel_takes_go_to_the_torch_path(monkeypatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # wherever the kernel could run, these shapes still may not
    pytest.importorskip("triton")
    q = torch.zeros(1, 2, 3, pa.MAX_HEAD_DIM * 2)
    cache = torch.zeros(4, 4, 2, pa.MAX_HEAD_DIM * 2)
    assert not pa.kernel_applies(q, cache, cache, torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 3, dtype=torch.long))
    assert not pa.kernel_applies(q.double(), cache.double(), cache.double(), torch.zeros(1, 1, dtype=torch.long),
                                 torch.zeros(1, 3, dtype=torch.long))


# --- the cuda tier ----------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the cuda tier needs a CUDA device")
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("queries, contexts, H, Hkv, D, block_size", [
    ([1] * 8, [0, 1, 15, 16, 17, 300, 1000, 2047], 32, 8, 128, 16),     # decode, Llama-like GQA
    ([1, 1, 37, 128], [500, 3, 0, 64], 12, 12, 64, 16),                 # prefill chunks beside decodes
    ([5, 1, 64], [9, 70, 200], 8, 1, 96, 32),                           # multi-query, D not a power of two
    ([1, 3], [4000, 31], 16, 4, 256, 64),                               # the widest heads the kernel takes
])
def test_the_compiled_kernel_matches_the_torch_path_on_cuda(queries, contexts, H, Hkv, D, block_size,
                                                            dtype) -> None:
    needs_compiled_kernels()
    args, unread = make_step(queries, contexts, H, Hkv, D, block_size, 3, DTYPES[dtype], DTYPES[dtype], seed=0, device="cuda")
    check(args, unread, *run_both(args, unread), dtype)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the cuda tier needs a CUDA device")
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_on_cuda_serving_runs_the_kernel_and_gives_the_torch_path_s_greedy_tokens(name, monkeypatch) -> None:
    needs_compiled_kernels()
    (tokens, logits), (ref_tokens, ref_logits), launches = serve_with_and_without_the_kernel(
        _tiny_hf(name).cuda(), monkeypatch)
    assert launches > 0
    assert tokens == ref_tokens
    for i in range(len(PROMPTS)):
        torch.testing.assert_close(torch.stack(logits[i]), torch.stack(ref_logits[i]), rtol=0, atol=1e-4)
