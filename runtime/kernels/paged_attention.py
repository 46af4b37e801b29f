"""Paged attention over a KV cache held in fixed-size blocks (the op `passes/inference/kv_cache`
puts in place of each attention of an inference program).

One call serves a whole serving step: the step's T tokens are packed in one row (prompt chunks
of several requests and single decode tokens side by side), and

    k_cache[slot_mapping[t]] = k[t]; v_cache[slot_mapping[t]] = v[t]     (in place, every token)
    out[query_index[s, i]] = softmax(q_i K_s^T * scale, keys j <= query_pos[s, i]) V_s
                             (and j > query_pos[s, i] - window, for a sliding window: window > 0)

where K_s / V_s are sequence s's keys and values gathered through its row of `block_table`
(block b holds positions b*block_size .. (b+1)*block_size - 1 of the sequence). Padding:
a query slot with `query_index == T` is a dummy (its result is dropped); a token whose slot is
in block 0 writes there harmlessly (the runtime never hands block 0 to a sequence).

Layouts: q [1, H, T, D], k/v [1, Hkv, T, D] (H a multiple of Hkv: grouped-query attention),
caches [num_blocks, block_size, Hkv, D], slot_mapping [T], block_table [S, NB],
query_index / query_pos [S, Q]. The result has q's shape, laid out as [1, T, H, D] in memory
(what the SDPA kernels it replaces return, so the graph's later views stay valid).

Two implementations behind `paged_attention_impl`:

- a Triton kernel, when q is on CUDA (or on the CPU under Triton's interpreter, TRITON_INTERPRET=1,
  what the tests check): it reads the cache blocks in place through the block table. The torch
  path gathers every sequence's whole K/V (NB * block_size slots, however short the sequence) into
  fresh copies and runs a masked SDPA over them; on a GPU, where decode attention is bound by memory
  bandwidth, that is a write and a second read of everything it reads. The kernel reads each key
  and value a query needs once per program and nothing past the program's last query position,
  nor, under a sliding window, before the tile of its earliest query's window start.
- the torch implementation (CPU, any device, and whatever the kernel does not take): no allocation
  that depends on anything but the step's shapes. On the CPU a pure decode step (sequence s's one
  query is token s) takes a shorter branch, without the query gather and output scatter a mixed
  step needs; a mixed step attends its decode tokens apart from its prompt chunks (each group
  padded to its own longest); a sliding window gathers only the blocks from each sequence's
  window start. Elsewhere (CUDA graphs capture one fixed op sequence) every step runs the same ops.

The cache write (k/v into their slots) is torch's index_copy_ in both.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

from .launch import interpreting, use_triton

_LOG2E = 1.4426950408889634  # the kernel's softmax runs in exp2: scores pre-scaled by log2(e)
MAX_HEAD_DIM = 256  # wider heads fall back to torch: a program holds its query rows' [rows, D] accumulator


def paged_attention_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, slot_mapping: torch.Tensor, block_table: torch.Tensor,
                         query_index: torch.Tensor, query_pos: torch.Tensor, scale: float,
                         window: int = 0) -> torch.Tensor:
    """The op's body. The serving runtime calls it directly from the program (`direct_calls`):
    the custom op's dispatch costs about 0.2 ms a call on the CPU, ~5% of a GPT-2 decode step.
    The Triton kernel where `kernel_applies` says so, else the torch implementation below.
    `window` > 0: a sliding window, keys `window` or more positions back hidden (Mistral's,
    Gemma3's local layers); 0: plain causal attention."""
    _, H, T, D = q.shape
    Hkv = k.shape[1]
    kc, vc = _write_cache(k, v, k_cache, v_cache, slot_mapping)
    if kernel_applies(q, k_cache, v_cache, block_table, query_index):
        return _paged_attention_triton(q, kc, vc, k_cache.shape[1], block_table, query_index, query_pos, scale,
                                       window)
    bs = k_cache.shape[1]
    groups, decode = _step_index(block_table, query_pos, query_index, bs, q.dtype, window, T)
    if decode:  # sequence s's one query is token s: q's own rows, no gather in and no scatter out
        slots, mask, _ = groups[0]
        S = block_table.shape[0]
        Q = q[0, :, :S].transpose(0, 1).unsqueeze(2)  # [S, H, 1, D]
        out = _attend(Q, kc, vc, slots, mask, scale).reshape(S, H, D)
        res = out if S == T else torch.cat([out, out.new_zeros(T - S, H, D)])
        return res.contiguous().transpose(0, 1).unsqueeze(0)
    qt = torch.cat([q[0].transpose(0, 1), q.new_zeros(1, H, D)])  # row T: the dummy query
    res = q.new_zeros(T + 1, H, D)
    for slots, mask, qidx in groups:
        Sg, Qg = qidx.shape
        Q = qt.index_select(0, qidx.reshape(-1)).view(Sg, Qg, H, D).transpose(1, 2)  # [S, H, Q, D]
        out = _attend(Q, kc, vc, slots, mask, scale)
        res.index_copy_(0, qidx.reshape(-1), out.transpose(1, 2).reshape(-1, H, D))  # dummies all land on row T
    return res[:T].transpose(0, 1).unsqueeze(0)


def _attend(Q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor,
            scale: float) -> torch.Tensor:
    """SDPA of queries Q [S, H, Q, D] over the keys and values at `slots` (S sequences' worth,
    flat), under the additive `mask` [S, 1, Q, L]."""
    S, H, _, D = Q.shape
    Hkv = kc.shape[1]
    # index_select, not advanced indexing: ~10x less overhead per call on CPU at decode sizes
    K = kc.index_select(0, slots).view(S, -1, Hkv, D).transpose(1, 2)  # [S, Hkv, L, D]
    V = vc.index_select(0, slots).view(S, -1, Hkv, D).transpose(1, 2)
    return F.scaled_dot_product_attention(Q, K.to(Q.dtype), V.to(Q.dtype), attn_mask=mask, scale=scale,
                                          enable_gqa=H != Hkv)


# Per window, the last step's (block_table, query_pos, query_index, (their versions, block size,
# dtype, window, T), (groups, decode)): every layer of a step calls the op with the same metadata tensors, so
# the torch path makes its slot list, mask and decode test once per step, not once per layer
# (5 ops in each layer but the first: 55 of the ~520 of a GPT-2 decode step; 12 layers at one
# token went from 3.7-3.8 to 2.8-2.9 ms). Holding the tensors keeps their identity from being
# reused; their version counters catch a step that refills them in place (_Static buckets). CPU
# only: under CUDA graph capture a memo made by the warm-up runs would be baked into the graph.
# Keyed by window: layers of two windows (Gemma3's local and global) alternate within a step.
_last_steps: dict[int, tuple] = {}


def _step_index(block_table: torch.Tensor, query_pos: torch.Tensor, query_index: torch.Tensor, bs: int,
                dtype: torch.dtype = torch.float32, window: int = 0, T: int | None = None
                ) -> tuple[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], bool]:
    """How the torch path attends a step: groups of sequences, each (the cache slots of the blocks
    its sequences' keys are read from, flat [S * W * bs]; the causal mask [S, 1, Q, W * bs], key j
    visible to a query at position p when j <= p, and p - window < j under a sliding window,
    additive: 0 / -inf in `dtype`, the queries', as SDPA would convert a boolean one in every
    layer; the token index of each of its query slots [S, Q], T for a dummy), and whether the step
    is pure decode, every sequence s's one query slot holding token s (then the queries need no
    gather). Layers of another window (Gemma3 alternates) get their own groups of the same step.

    One group of every sequence and all Q query slots, except on the CPU (where shapes may follow
    the data): there a mixed step's sequences with one query (decode tokens) attend apart from
    those with a prompt chunk, each group padded to its own longest; in one group a decode token
    beside a 256-token chunk ran 256 query rows, all but one dummies. And W = NB (every block of
    the table), except on the CPU under a sliding window: there each sequence reads the W blocks
    from its earliest query's window start (W the widest such span of the group), so a decode step
    reads about window keys whatever the context (block table column c holds positions c*bs ...
    c*bs + bs - 1). `T`: the step's tokens (query_index == T marks a dummy slot, whose position
    does not count)."""
    on_cpu = block_table.device.type == "cpu"
    # (tensors made under torch.inference_mode have no version counter: no memo for them)
    memoized = on_cpu and not any(t.is_inference() for t in (block_table, query_pos, query_index))
    stamp = (block_table._version, query_pos._version, query_index._version, bs, dtype, window, T) \
        if memoized else None
    memo = _last_steps.get(window) if memoized else None
    if memo is not None and memo[0] is block_table and memo[1] is query_pos and memo[2] is query_index \
            and memo[3] == stamp:
        return memo[4]
    S, Qn = query_index.shape
    if T is None and on_cpu:
        T = int(query_index.max()) + 1
    # .item() on CPU only: on CUDA it would wait for the device (and break graph capture)
    decode = on_cpu and Qn == 1 and bool(torch.equal(query_index[:, 0], torch.arange(S, device=query_index.device)))
    parts = [(block_table, query_pos, query_index)]
    if on_cpu and Qn > 1:
        live = query_index < T
        single = live.sum(1) <= 1  # (a padded sequence of a fixed-shape bucket has no live slot: a dummy here)
        if bool(single.any()) and not bool(single.all()):
            one, many = single.nonzero()[:, 0], (~single).nonzero()[:, 0]
            slot = live[one].int().argmax(1, keepdim=True)  # the one live query slot of each
            widest = int(torch.where(live[many], torch.arange(Qn) + 1, 0).max())  # past the last live slot
            parts = [(block_table[one], query_pos[one].gather(1, slot), query_index[one].gather(1, slot)),
                     (block_table[many], query_pos[many, :widest], query_index[many, :widest])]
    groups = [(*_keys_and_mask(bt, qp, qi, bs, dtype, window, T), qi) for bt, qp, qi in parts]
    found = (groups, decode)
    if memoized:
        _last_steps[window] = (block_table, query_pos, query_index, stamp, found)
    return found


def _keys_and_mask(block_table: torch.Tensor, query_pos: torch.Tensor, query_index: torch.Tensor, bs: int,
                   dtype: torch.dtype, window: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The cache slots and the additive mask of one group of `_step_index`."""
    S, NB = block_table.shape
    table, first = block_table, None
    if window > 0 and block_table.device.type == "cpu" and NB > 1:
        live = query_index < T
        earliest = torch.where(live, query_pos, query_pos.max() + 1).min(dim=1).values
        lo = (earliest - window + 1).clamp(min=0) // bs
        width = max(int((query_pos.max(dim=1).values // bs - lo).max()) + 1, 1)
        if width < NB:
            lo = lo.clamp(max=NB - width)
            table = block_table.gather(1, lo[:, None] + torch.arange(width))
            first = lo * bs
    slots = (table[:, :, None] * bs + torch.arange(bs, device=block_table.device)).reshape(-1)
    keys = torch.arange(table.shape[1] * bs, device=query_pos.device)[None, None, :]
    if first is not None:
        keys = keys + first[:, None, None]
    seen = keys <= query_pos[:, :, None]
    if window > 0:
        seen &= keys > query_pos[:, :, None] - window
    mask = torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill_(~seen, float("-inf"))[:, None]
    return slots, mask


def _write_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stores this step's k/v [1, Hkv, T, D] at their slots; returns the caches viewed as
    [num_blocks * block_size, Hkv, D] (slot-major)."""
    Hkv, D = k.shape[1], k.shape[3]
    nb, bs = k_cache.shape[0], k_cache.shape[1]
    kc = k_cache.view(nb * bs, Hkv, D)
    vc = v_cache.view(nb * bs, Hkv, D)
    kc.index_copy_(0, slot_mapping, k[0].transpose(0, 1).to(kc.dtype))
    vc.index_copy_(0, slot_mapping, v[0].transpose(0, 1).to(vc.dtype))
    return kc, vc


# --- the Triton kernel ------------------------------------------------------------------------

def kernel_applies(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                   query_index: torch.Tensor) -> bool:
    """Whether this call goes to the Triton kernel: q on CUDA (or the CPU under TRITON_INTERPRET=1),
    q and the caches fp32/bf16/fp16 on one device, contiguous caches, H a multiple of Hkv,
    D <= MAX_HEAD_DIM, and a non-empty step (at least one sequence, query slot and cache block)."""
    if not use_triton(q, k_cache, v_cache):  # first: the CPU decode path asks it in every layer
        return False
    H, D, Hkv = q.shape[1], q.shape[3], k_cache.shape[2]
    if D > MAX_HEAD_DIM or H % Hkv or block_table.shape[1] == 0 or query_index.numel() == 0 or q.shape[2] == 0:
        return False
    return k_cache.is_contiguous() and v_cache.is_contiguous()  # the kernel computes slot offsets itself


def _pow2(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length()


def _tiles(Qn: int, G: int, D: int, fp32: bool) -> tuple[int, int, int, int, int]:
    """(G_P, BLOCK_Q, BLOCK_D, BLOCK_N, num_warps) for Qn query slots per sequence, G query heads
    per KV head, head dim D, fp32 or 16-bit operands. A program's rows are BLOCK_Q slots x G_P
    (G padded to a power of two) heads: at least 16, tl.dot's smallest tile (a decode step, Q = 1,
    pads rows, which costs no reads), at most what fits registers unless one group alone is wider.
    D is padded to a power of two >= 16 and masked. The sizes are those ptxas compiles for sm_90
    without spilling registers (checked offline, not tuned on a GPU)."""
    G_P = _pow2(G)
    BLOCK_D = max(16, _pow2(D))
    if fp32:
        cap, BLOCK_N, warps = {256: (16, 16, 4), 128: (32, 32, 8)}.get(BLOCK_D, (64, 32, 8))
    else:
        cap, BLOCK_N, warps = {256: (16, 32, 8), 128: (64, 64, 8)}.get(BLOCK_D, (64, 64, 8))
    BLOCK_Q = max(1, 16 // G_P, min(_pow2(Qn), cap // G_P))
    if not fp32 and BLOCK_D == 128 and BLOCK_Q * G_P > 32:
        BLOCK_N = 32
    if not fp32 and BLOCK_D <= 64 and BLOCK_Q * G_P <= 16:
        warps = 4
    return G_P, BLOCK_Q, BLOCK_D, BLOCK_N, warps


def _kernel() -> Any:
    """The Triton kernel (imports triton on first use). Triton decides at decoration time whether a
    kernel is interpreted, so it is made once per TRITON_INTERPRET setting."""
    return _make_kernel(interpreting())


@functools.cache
def _make_kernel(interpret: bool) -> Any:
    import triton
    import triton.language as tl

    # cast and mma are module globals, not closure variables: Triton's interpreter re-executes a
    # kernel's source against its module's globals and cannot see a closure (NameError). Both
    # versions (interpreted or compiled) are the same code; a process runs in one mode.
    global _cast, _mma

    # INTERPRET_BF16 (bf16 under the interpreter only): Triton 3.9's interpreter multiplies bf16
    # tl.dot operands as their raw uint16 bits and truncates fp32 -> bf16 casts; there the kernel
    # multiplies the (exact) fp32 values and rounds to nearest even itself, which is what the
    # compiled kernel's bf16 x bf16 -> fp32 products and conversions do

    @triton.jit
    def _cast(x, dtype: tl.constexpr, INTERPRET_BF16: tl.constexpr):
        if INTERPRET_BF16 and dtype == tl.bfloat16 and x.dtype != tl.bfloat16:
            b = x.to(tl.float32).to(tl.uint32, bitcast=True)
            b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
            return b.to(tl.float32, bitcast=True).to(tl.bfloat16)  # exact: the low bits are zero
        else:
            return x.to(dtype)

    @triton.jit
    def _mma(a, b, INTERPRET_BF16: tl.constexpr):
        if INTERPRET_BF16:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            return tl.dot(a, b, input_precision="ieee")  # fp32 operands: no TF32, like the torch path

    @triton.jit
    def paged_attention_fwd(Q, KC, VC, BT, QI, QP, Out, T, NB, Qn, n_tiles, sq_t, sq_h, sq_d, qk_scale, WINDOW,
                            HKV: tl.constexpr, G: tl.constexpr, G_P: tl.constexpr, BS: tl.constexpr,
                            D: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                            SPLIT_P: tl.constexpr, INTERPRET_BF16: tl.constexpr):
        # one program: sequence s, kv head hk, query slots tile*BLOCK_Q ... (+BLOCK_Q); its rows are
        # (query slot, query head of the group), so a GQA group shares every K/V tile it loads
        pid = tl.program_id(0)
        hk = tl.program_id(1)
        s = pid // n_tiles
        tile = pid % n_tiles
        M: tl.constexpr = BLOCK_Q * G_P
        r = tl.arange(0, M)
        i = tile * BLOCK_Q + r // G_P
        g = r % G_P
        h = hk * G + g
        d = tl.arange(0, BLOCK_D)
        d_ok = d < D
        row_ok = (i < Qn) & (g < G)
        qi = tl.load(QI + s * Qn + i, mask=row_ok, other=T)
        live = row_ok & (qi < T)  # dummy slots (query_index == T) and padding rows compute but store nothing
        # a dead row reads position 0: it sees key 0 if the loop starts there (its result is never
        # stored; under a window the loop may start past it, and l = 0 is divided by 1 below)
        pos = tl.load(QP + s * Qn + i, mask=live, other=0).to(tl.int32)
        n_keys = tl.minimum(tl.max(pos, axis=0) + 1, NB * BS)  # causal: no program reads past its last query
        q = tl.load(Q + qi[:, None].to(tl.int64) * sq_t + h[:, None] * sq_h + d[None, :] * sq_d,
                    mask=live[:, None] & d_ok[None, :], other=0.0)
        dt = q.dtype
        m_i = tl.full([M], float("-inf"), tl.float32)
        l_i = tl.zeros([M], tl.float32)
        acc = tl.zeros([M, BLOCK_D], tl.float32)
        # under a sliding window, from the tile of the program's earliest live query's window start:
        # the tiles wholly behind it hold no key any row sees
        earliest = tl.min(tl.where(live, pos, n_keys), axis=0)
        lo = tl.where(WINDOW > 0, tl.maximum(earliest - WINDOW + 1, 0), 0) // BLOCK_N * BLOCK_N
        for start in range(lo, n_keys, BLOCK_N):
            j = start + tl.arange(0, BLOCK_N)
            j_ok = j < n_keys
            # each key's slot through the block table: the cache is read where it lies, no gathered copy
            blk = tl.load(BT + s * NB + j // BS, mask=j_ok, other=0)
            # 64-bit only where it must be (the block's base): 32-bit offsets keep registers free
            kv = (blk * (BS * HKV * D))[:, None] + (((j % BS) * HKV + hk) * D)[:, None] + d[None, :]
            kv_ok = j_ok[:, None] & d_ok[None, :]
            # the torch path casts K/V to q's dtype before the products; so does the kernel
            kt = _cast(tl.load(KC + kv, mask=kv_ok, other=0.0), dt, INTERPRET_BF16)
            qk = _mma(q, tl.trans(kt), INTERPRET_BF16)
            seen = (j[None, :] <= pos[:, None]) & j_ok[None, :]
            if WINDOW > 0:  # a sliding window: keys WINDOW or more positions back hidden
                seen = seen & (j[None, :] > pos[:, None] - WINDOW)
            qk = tl.where(seen, qk * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, axis=1))
            # a row with no key seen yet (all behind its window so far) keeps m = -inf: subtract 0,
            # not -inf, so that its terms are exp2(-inf) = 0, not NaN
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.math.exp2(m_i - m_sub)
            p = tl.math.exp2(qk - m_sub[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            vt = _cast(tl.load(VC + kv, mask=kv_ok, other=0.0), dt, INTERPRET_BF16)
            # P in q's dtype for the tensor cores, as P = hi + lo (two 16-bit terms): flash attention
            # rounds P to bf16's 8 bits, which about doubles the error of the torch path (fp32 P);
            # the second product costs nothing in a step bound by reading the cache
            p_hi = _cast(p, dt, INTERPRET_BF16)
            acc = acc * alpha[:, None] + _mma(p_hi, vt, INTERPRET_BF16)
            if SPLIT_P:
                acc += _mma(_cast(p - p_hi.to(tl.float32), dt, INTERPRET_BF16), vt, INTERPRET_BF16)
            m_i = m_new
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # a live row sees at least its own key: l > 0
        tl.store(Out + (qi[:, None].to(tl.int64) * (HKV * G) + h[:, None]) * D + d[None, :],
                 _cast(out, Out.dtype.element_ty, INTERPRET_BF16), mask=live[:, None] & d_ok[None, :])

    return paged_attention_fwd


def _paged_attention_triton(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, block_size: int,
                            block_table: torch.Tensor, query_index: torch.Tensor, query_pos: torch.Tensor,
                            scale: float, window: int = 0) -> torch.Tensor:
    """Attention of the step's queries over the caches kc/vc [num_blocks * block_size, Hkv, D] (this
    step's k/v already written), through the Triton kernel. Same result as the torch path, in its
    layout ([1, H, T, D] over [T, H, D] memory), with zero rows for the tokens no query slot names
    (the bucket's padding)."""
    _, H, T, D = q.shape
    Hkv = kc.shape[1]
    S, NB = block_table.shape
    Qn = query_index.shape[1]
    G = H // Hkv
    G_P, BLOCK_Q, BLOCK_D, BLOCK_N, warps = _tiles(Qn, G, D, q.dtype == torch.float32)
    n_tiles = -(-Qn // BLOCK_Q)
    out = q.new_zeros(T, H, D)  # the bucket's padding tokens keep zero rows, as in the torch path
    _kernel()[(S * n_tiles, Hkv)](
        q[0], kc, vc, block_table.contiguous(), query_index.contiguous(), query_pos.contiguous(), out,
        T, NB, Qn, n_tiles, q.stride(2), q.stride(1), q.stride(3), scale * _LOG2E, int(window),
        HKV=Hkv, G=G, G_P=G_P, BS=block_size, D=D, BLOCK_Q=BLOCK_Q, BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N,
        SPLIT_P=q.dtype != torch.float32, INTERPRET_BF16=interpreting() and q.dtype == torch.bfloat16, num_warps=warps)
    return out.transpose(0, 1).unsqueeze(0)


@torch.library.custom_op("fxspeed::paged_attention", mutates_args=("k_cache", "v_cache"))
def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, slot_mapping: torch.Tensor, block_table: torch.Tensor,
                    query_index: torch.Tensor, query_pos: torch.Tensor, scale: float, window: int = 0) -> torch.Tensor:
    return paged_attention_impl(q, k, v, k_cache, v_cache, slot_mapping, block_table, query_index, query_pos, scale,
                                window)


@paged_attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
      slot_mapping: torch.Tensor, block_table: torch.Tensor, query_index: torch.Tensor, query_pos: torch.Tensor,
      scale: float, window: int = 0) -> torch.Tensor:
    _, H, T, D = q.shape
    return q.new_empty(T, H, D).transpose(0, 1).unsqueeze(0)
