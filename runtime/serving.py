"""Serving: continuous batching over compiled inference programs with a paged KV cache.

`Engine.generate` / `Engine.stream` delegate here (the Engine stays the one engine; this module
holds the per-step scheduling it runs). One serving step:

    schedule     every decoding request gets 1 token, then prompts fill the rest of the token
                 budget in chunks (Dynamic SplitFuse: a long prompt is split over several steps
                 and shares them with decode tokens, so every step runs at about the budget)
    pack         the step's tokens side by side in one row, padded to a bucket (a power of two,
                 or the budget), so one compiled program per bucket is reused
    run          program(tokens, positions, slot_mapping, block_table, query_index, query_pos,
                 *kv_cache) -> logits; the cache is written in place by the program
    sample       for each request whose chunk reached the end of what it has: greedy, or
                 temperature / top_k / top_p from its own seeded generator (seed x 1000003 +
                 the request's index in the call: the same call samples the same tokens whatever
                 the batching, but a prompt at another index draws other samples)
    retire       a request that produced eos or max_new_tokens frees its blocks; waiting
                 requests join as soon as blocks are free

A request holds the blocks of what it has fed: its prompt's when admitted (with a block of room
left for each running request that may still grow), then one more each time its tokens start a
block (`_grow`), so one that stops early at eos never held the rest of max_new_tokens. Where no
block is free, the youngest running request gives its blocks back and waits at the head of the
queue; readmitted, it feeds its prompt and tokens so far again and goes on (preemption by
recompute: `stats["preempted"]` counts them; the tokens and a seeded request's samples are an
uninterrupted run's up to float rounding: a recomputed chunk sums in another order than the
decode steps it replaces, which can flip a near tie). A request longer than the whole cache
(prompt + max_new_tokens - 1: the last new token is never fed, so it takes no position and no
cache slot) is refused up front. Block 0
is never handed out: padding tokens write there. Where every layer has a sliding window, a
request holds at most `ring_blocks` blocks, however long it runs: its logical block b lives in
its block b % ring, and a block is written again only once every query that could see its keys
has run (Mistral at window 4096 holds 4096 + token_budget tokens a request, not its whole
context).

Prefix caching: every full block of the "" pool is indexed by its tokens after the same prefix
(`KVCache.match` / `index`), kept after its requests finish until its room is needed (least
recently used first), and a request whose first blocks are there reads them and computes from
the first block that is not. Off where a layer has a sliding window; dropped when the weights
change between calls.

Bad requests (empty prompt, token id outside the vocabulary, prompt + max_new_tokens - 1 longer
than the model's context or sliding window, a request larger than the whole cache, or larger
than what is free while another paused `stream` of the engine holds the rest, max_new_tokens
< 1) fail alone with a `RequestError`; the others run. `stream` yields (req_id, RequestError) for them;
`generate` raises `GenerationError` at the end (its `.results` hold the other requests'
tokens), or returns the errors in place with `on_error="return"`.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import logging
import inspect
import math
import numbers
import os
import sys
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Iterator, Sequence

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from fxspeed.errors import ConfigError, FxspeedError
from fxspeed.global_state import no_autocast
from fxspeed.ir import IOSpec
from fxspeed.ir.program import WINDOW_GROUP, InferenceProgram
from fxspeed.runtime.kernels.packed_linear import COPY_KINDS, PackedWeights, fastest_copies, weight_stamps
from fxspeed.runtime.kernels.direct_calls import direct_calls

log = logging.getLogger("fxspeed")

PER_STEP = ("tokens", "positions", "slot_mapping", "block_table", "query_index", "query_pos", "logits_index")


def step_key(kind: str, group: str = "") -> str:
    """A serving step's name for a per-step input: its kind, with the block table's group when
    not the main one ("block_table:window")."""
    return f"{kind}:{group}" if group else kind


class RequestError(FxspeedError, ValueError):
    """One request of a generate/stream call was refused; `req_id` is its index in the prompts."""

    def __init__(self, req_id: int, message: str):
        super().__init__(f"request {req_id}: {message}")
        self.req_id = req_id
        self.reason = message  # without the "request i: " prefix


class GenerationError(FxspeedError):
    """Some requests of a `generate` call failed. `results[i]` is request i's tokens, or its
    RequestError; `errors` lists the failures. The other requests ran to completion."""

    def __init__(self, results: list[Any]):
        self.results = results
        self.errors = [r for r in results if isinstance(r, RequestError)]
        super().__init__(f"{len(self.errors)} of {len(results)} requests failed: "
                         + "; ".join(str(e) for e in self.errors[:5]))


class KVCache:
    """The paged cache: per layer a key and a value tensor [blocks, block_size, kv_heads, head_dim],
    allocated once; blocks are handed to requests from a free list. `groups[i]`: the block table
    layer i reads. A model with sliding and global layers has two ("" and "window"), each over
    blocks of its own: `group_blocks` gives the "window" pool's size (its layers' tensors hold
    that many blocks), `num_blocks` the "" pool's."""

    def __init__(self, layout: Sequence[tuple[int, int, torch.dtype]], num_blocks: int, block_size: int,
                 device: torch.device, groups: Sequence[str] = (), group_blocks: dict[str, int] | None = None):
        groups = tuple(groups) or ("",) * len(layout)
        self.sizes = {g: num_blocks if g == "" else int((group_blocks or {}).get(g, num_blocks))
                      for g in ("", *groups)}
        if min(self.sizes.values()) < 2:
            raise ConfigError(f"serve: the cache needs at least 2 blocks (block 0 is reserved), got "
                              f"{min(self.sizes.values())}; raise cache_tokens")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.layout = list(layout)
        self.groups = groups
        self.tensors: dict[str, torch.Tensor] = {}
        for i, ((h, d, dt), g) in enumerate(zip(layout, groups)):
            for kv in ("k", "v"):
                self.tensors[f"{i}.{kv}"] = torch.zeros(self.sizes[g], block_size, h, d, dtype=dt, device=device)
        self._free = {g: list(range(n - 1, 0, -1)) for g, n in self.sizes.items()}
        # The prefix index (the "" pool): a full block's keys and values are those of its tokens
        # after every token before them, so it is found again by (the id of the block before it in
        # the index, 0 for the first, its tokens). Ids are never reused: a key cannot match a block
        # whose prefix was evicted and written over, and there is no hash to collide.
        self._index: dict[tuple[int, tuple[int, ...]], int] = {}  # key -> block
        self._entry: dict[int, tuple[tuple[int, tuple[int, ...]], int]] = {}  # indexed block -> (key, id)
        self._refs: dict[int, int] = {}  # indexed block -> requests holding it
        self._idle: collections.OrderedDict[int, None] = collections.OrderedDict()  # held by none, LRU first
        self._ids = itertools.count(1)
        # bumped by forget_prefixes: a request admitted before it computed its blocks partly with
        # the old weights, so it indexes none of them (`ServingLoop._index_full_blocks`)
        self.generation = 0

    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - 1

    def usable(self, group: str) -> int:
        return self.sizes[group] - 1

    def free_blocks(self, group: str = "") -> int:
        """Blocks a request can take: never handed out, or indexed but held by no request (the
        least recently used of those is taken first, and leaves the index)."""
        return len(self._free[group]) + (len(self._idle) if group == "" else 0)

    def allocate(self, needs: dict[str, int]) -> dict[str, list[int]] | None:
        """`needs[g]` blocks of each table's pool, or None (nothing taken) where one has too few."""
        if any(n > self.free_blocks(g) for g, n in needs.items()):
            return None
        return {g: [self._take_free(g) for _ in range(n)] for g, n in needs.items()}

    def _take_free(self, group: str) -> int:
        if self._free[group]:
            return self._free[group].pop()
        block, _ = self._idle.popitem(last=False)  # evicted: its key goes, its children are unreachable
        key, _ = self._entry.pop(block)
        del self._refs[block]
        if self._index.get(key) == block:  # (after forget_prefixes the key is gone or another's)
            del self._index[key]
        return block

    def release(self, blocks: dict[str, list[int]]) -> None:
        for g, bs in blocks.items():
            plain = []
            # last blocks first: they are evicted first, and a prefix's first blocks stay findable
            # (a chain's child is unreachable once its parent is evicted)
            for b in reversed(bs):
                if g == "" and b in self._entry:  # indexed: kept for the next request with this prefix
                    self._refs[b] -= 1
                    if not self._refs[b]:
                        self._idle[b] = None
                else:
                    plain.append(b)
            self._free[g].extend(plain)

    def match(self, tokens: Sequence[int], limit: int) -> tuple[list[int], int]:
        """The indexed blocks holding the first `limit` full blocks of `tokens` (as many as are
        indexed, from the first), and the id of the last (0: none). Takes nothing: see `hold`."""
        bs, parent, found = self.block_size, 0, []
        for k in range(limit):
            block = self._index.get((parent, tuple(tokens[k * bs:(k + 1) * bs])))
            if block is None:
                break
            found.append(block)
            parent = self._entry[block][1]
        return found, parent

    def idle_among(self, blocks: Sequence[int]) -> int:
        return sum(b in self._idle for b in blocks)

    def hold(self, blocks: Sequence[int]) -> None:
        """A request now reads these indexed blocks (from `match`): they are not evicted until
        it releases them."""
        for b in blocks:
            self._refs[b] += 1
            self._idle.pop(b, None)

    def index(self, block: int, parent: int, tokens: tuple[int, ...]) -> int:
        """Index `block`, just filled with `tokens` after the prefix `parent` (an id from `match`
        or `index`), held by the one request that wrote it; returns its id. Where another block
        already holds that prefix, `block` stays out of the index and that block's id is returned
        (the two hold the same keys and values)."""
        key = (parent, tokens)
        if key in self._index:
            return self._entry[self._index[key]][1]
        ident = next(self._ids)
        self._index[key], self._entry[block], self._refs[block] = block, (key, ident), 1
        return ident

    def forget_prefixes(self) -> None:
        """The weights changed: no cached block holds what they would compute now. Blocks no
        request holds are free again; blocks a paused stream's requests hold stay counted (their
        entries and references) until released, but no key leads to them any more."""
        for b in self._idle:
            key, _ = self._entry.pop(b)
            del self._refs[b]
        self._free[""].extend(reversed(list(self._idle)))
        self._idle.clear()
        self._index.clear()
        self.generation += 1

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


# The default cache (max_batch requests of a whole context) is capped at this share of the memory
# free after compiling: a long-context model's default (a Llama-3-8B config: 131072 x 16 tokens x
# 128 KiB = 256 GiB) would otherwise fail in the allocator, or on a CPU with overcommit succeed
# lazily and be killed later. The other half is left to activations and the rest of the process.
CACHE_MEMORY_FRACTION = 0.5


def free_memory(device: torch.device) -> int:
    """Bytes free on `device` now for this process: the CUDA allocator's view of the GPU, or for a
    CPU the host's available memory (psutil) shared by the launch's local ranks (LOCAL_WORLD_SIZE,
    set by fxspeed run / torchrun: tensor-parallel ranks on one host each take their share)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    import psutil

    return int(psutil.virtual_memory().available) // max(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), 1)


def _allocate_cache(program: InferenceProgram, cache_tokens: int | None, default_tokens: int, block_size: int,
                    device: torch.device, agree_min: Callable[[int], int] | None,
                    window_blocks: Callable[[int], int] | None = None) -> KVCache:
    """The KVCache for `cache_tokens` (the user's), else for `default_tokens` capped at
    CACHE_MEMORY_FRACTION of the free memory; a failed allocation is a ConfigError naming
    cache_tokens instead of the allocator's message. Under tensor parallelism (`agree_min`: the
    minimum over the tp ranks) every rank takes the smallest rank's room, so all admit the same
    requests, and all raise if one rank's allocation failed (the others would wait in the next
    collective until dist_timeout_s). A model with sliding and global layers: the tokens are the
    global layers' ("" table); `window_blocks(usable "" blocks)` sizes the sliding layers' pool."""
    groups = tuple(getattr(program, "kv_groups", ()))
    windowed = window_blocks is not None and any(groups)
    main = program.kv_bytes_per_token("") if windowed else program.kv_bytes_per_token()
    side = program.kv_bytes_per_token(WINDOW_GROUP) if windowed else 0

    def side_blocks(tokens: int) -> int:
        return window_blocks(-(-tokens // block_size)) if window_blocks is not None and windowed else 0

    def nbytes(tokens: int) -> int:  # without the reserved blocks
        return tokens * main + side_blocks(tokens) * block_size * side

    tokens = cache_tokens
    if tokens is None:
        budget = int(CACHE_MEMORY_FRACTION * free_memory(device))
        room = budget // max(main, 1)
        if windowed:  # the most tokens whose blocks in both pools fit (nbytes grows with tokens)
            lo, hi = 0, min(room, default_tokens)
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if nbytes(mid) <= budget else (lo, mid - 1)
            room = lo
        if agree_min is not None:
            room = agree_min(room)
        tokens = default_tokens
        if room < tokens:
            tokens = max(room, 2 * block_size)
            log.warning("fxspeed: serve's default KV cache (max_batch x what a request of the whole context holds = %d "
                        "tokens, %.1f GB) does not fit in "
                        "half of the %s's free memory; it holds %d tokens (%.1f GB). Pass serve(..., cache_tokens=) "
                        "to choose", default_tokens, nbytes(default_tokens) / 1e9, device.type, tokens,
                        nbytes(tokens) / 1e9)
    blocks = -(-tokens // block_size) + 1
    sizes = {WINDOW_GROUP: side_blocks(tokens) + 1} if windowed else None
    cache, error = None, ""
    try:
        cache = KVCache(program.kv_layout, blocks, block_size, device, groups, sizes)
    except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
        error = str(e).splitlines()[0] if str(e) else type(e).__name__
    if agree_min is not None and agree_min(0 if cache is None else 1) == 0 and not error:
        error = "another tensor-parallel rank could not allocate its share"
    if error:
        side_note = (f"; its sliding layers' {side_blocks(tokens) * block_size} tokens ({side} bytes a token) "
                     "included" if windowed else "")
        raise ConfigError(f"serve: a KV cache of {tokens} tokens ({nbytes(blocks * block_size) / 1e9:.2f} GB, "
                          f"{main} bytes a token{side_note}) could not be allocated on {device}: {error}; "
                          "lower serve(..., cache_tokens=)")
    assert cache is not None
    return cache


@dataclass
class _Request:
    id: int
    prompt: list[int]
    max_new: int
    eos: frozenset[int]
    temperature: float
    top_k: int | None
    top_p: float | None
    generator: torch.Generator | None
    blocks: dict[str, list[int]] = field(default_factory=dict)  # per block table: its blocks
    cached: int = 0  # tokens whose keys/values are in the cache
    indexed: int = 0  # its first blocks that are in the cache's prefix index (or equal to one there)
    chain: int = 0  # the prefix index id of the last of those
    generation: int = 0  # the cache's prefix generation when it was admitted
    out: list[int] = field(default_factory=list)
    last_token_at: float = 0.0

    def pending(self) -> list[int]:
        """Tokens not yet fed: the rest of the prompt, or the last sampled token."""
        seq = self.prompt + self.out
        return seq[self.cached:]

    def to_feed(self) -> int:
        """len(pending()), without building the sequence."""
        return len(self.prompt) + len(self.out) - self.cached

    def done(self) -> bool:
        return len(self.out) >= self.max_new or (bool(self.out) and self.out[-1] in self.eos)


def _token_ids(prompt: Any) -> tuple[list[int] | None, str]:
    """The prompt's token ids (a list, a 1-D integer tensor or array), or (None, what is wrong).
    Only integers: a float id (2.5, or 2.0 from a float tensor), a bool or a string is refused, not
    rounded: it means the caller passed something other than what it meant to."""
    if getattr(prompt, "ndim", 1) != 1:  # a tensor or array: one prompt is 1-D
        return None, f"a {type(prompt).__name__} of shape {tuple(prompt.shape)}; give each prompt as a 1-D sequence"
    seq = prompt.tolist() if hasattr(prompt, "tolist") and not isinstance(prompt, (list, tuple)) else prompt
    try:
        items = list(seq)
    except TypeError:
        return None, f"{type(prompt).__name__} {prompt!r}"
    for j, t in enumerate(items):
        if not _is_int(t):
            return None, f"position {j} holds {t!r} ({type(t).__name__})"
    return [int(t) for t in items], ""


class _Bound:
    """One compiled bucket with its argument list built once; a step fills the per-step slots."""

    static = False  # its per-step inputs take each step's own shapes

    def __init__(self, program: InferenceProgram, bind: Callable[[IOSpec], torch.Tensor], cache: KVCache,
                 packed: PackedWeights):
        self.program = program
        self.run = direct_calls(program.gm)
        self.args: list[Any] = []
        self.slots: dict[str, int] = {}
        for i, s in enumerate(program.signature.inputs):
            if s.kind in PER_STEP:
                self.slots[step_key(s.kind, s.target)] = i
                self.args.append(None)
            elif s.kind == "kv_cache":
                self.args.append(cache.tensors[s.target])
            elif s.kind in COPY_KINDS:
                self.args.append(packed.get(s, bind))
            else:
                self.args.append(bind(s))

    def shape(self, sequences: int, queries: int, blocks: int) -> tuple[int, int, int]:
        """The (sequences, query slots per sequence, blocks per sequence) of a step's metadata."""
        return sequences, queries, blocks

    def __call__(self, step: dict[str, torch.Tensor]) -> torch.Tensor:
        args = list(self.args)
        for k, i in self.slots.items():
            args[i] = step[k]
        with torch.no_grad(), no_autocast():  # a stream's steps run under whatever its consumer is in
            return self.run(*args)[0]


class _Static:
    """A bucket of T tokens run at fixed shapes: every step's metadata padded to the most a step
    can hold (min(T, max_batch) sequences, T query slots each, the blocks of a whole context; the
    padding is the kernels' own: dummy query slots `query_index == T`, block 0, logits row 0), so
    that on CUDA the program is captured once as a CUDA graph and a step is one replay instead of
    a few hundred kernel launches from Python.

        step:  copy the step's inputs into the static buffers -> graph.replay() -> the static logits

    Capture: two warm-up runs on a side stream (allocator, Triton's JIT, cuBLAS workspaces) with
    every query slot a dummy and every token writing block 0 (the cache's padding block), then the
    capture itself. Without `capture` (a CPU device: tests) the same padded step runs directly.
    """

    static = True

    def __init__(self, bound: _Bound, sequences: int, blocks: int, device: torch.device, capture: bool):
        self.bound = bound
        self.program = bound.program
        T = bound.program.tokens
        self.dims = (sequences, T, blocks)

        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.long, device=device)

        self.inputs = {"tokens": zeros(1, T), "positions": zeros(1, T), "query_pos": zeros(sequences, T),
                       "query_index": torch.full((sequences, T), T, dtype=torch.long, device=device),
                       "logits_index": zeros(sequences)}
        for key in bound.slots:  # one slot mapping and block table per block table the program reads
            kind = key.split(":")[0]
            if kind == "slot_mapping":
                self.inputs[key] = zeros(T)
            elif kind == "block_table":
                self.inputs[key] = zeros(sequences, blocks)
        self.graph: Any = None
        self.out: torch.Tensor | None = None
        if capture:
            self._capture(device)

    def _capture(self, device: torch.device) -> None:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self.bound(self.inputs)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.out = self.bound(self.inputs)
        self.graph = graph

    def shape(self, sequences: int, queries: int, blocks: int) -> tuple[int, int, int]:
        return self.dims

    def __call__(self, step: dict[str, torch.Tensor]) -> torch.Tensor:
        for k, v in step.items():
            self.inputs[k].copy_(v)
        if self.graph is None:
            return self.bound(self.inputs)
        self.graph.replay()
        assert self.out is not None
        return self.out


class ServingLoop:
    """Continuous batching for one Engine (see the module docstring)."""

    def __init__(self, compile_bucket: Callable[[int, str, int], InferenceProgram],
                 bind: Callable[[IOSpec], torch.Tensor],
                 *, vocab_size: int, max_context: int, device: torch.device, token_budget: int = 256,
                 context_limit: str = "",
                 max_batch: int = 16, block_size: int = 16, cache_tokens: int | None = None,
                 agree: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 agree_min: Callable[[int], int] | None = None, cuda_graphs: bool | None = None,
                 pack_linear: str = "auto", prefix_caching: bool = True):
        """`agree`: tensor-parallel serving hands every step's sampled tokens to it and continues with
        what it returns (tp rank 0's choice), so that every rank schedules the same requests;
        `agree_min` gives the minimum of an int over the tp ranks (the cache size they can all hold).
        `cuda_graphs`: the buckets up to the decode bucket run at fixed shapes (`_Static`),
        captured as CUDA graphs on a CUDA device; None: on a CUDA device without tensor
        parallelism. True on another device runs the fixed-shape steps without capture.
        `compile_bucket(T, copies, ways)`: bucket T's program; where the pack_linear_weights pass
        applies (CPU buckets of a few tokens) its linears read `copies` of the weights: "packed" for
        oneDNN, "transposed" (ATen's GEMM, [out, in] weights through [in, out] copies: its fast
        layout at a few rows), "split" (copies in `ways` slices, the loop's PackedWeights.ways) or
        "none" (the Parameters themselves).
        `pack_linear`: "auto" times the ways on the model's weights before compiling each such
        bucket and takes the fastest: packed, transposed copies or (with more than one CPU
        thread) split ones (`pack_probe` keeps the seconds); "always" packs; "never" holds no
        copy beside the model's weights.
        `prefix_caching`: a request's first full blocks that are in the cache already (another
        request's same prompt start, or its own before a preemption) are read, not computed again;
        on where no layer has a sliding window (a window layer needs the keys before the first
        token it computes in its own pool). Forgotten when the weights change between calls."""
        check_pack_linear(pack_linear)
        if token_budget < 1 or max_batch < 1 or block_size < 1:
            raise ConfigError(f"serve: token_budget ({token_budget}), max_batch ({max_batch}) and block_size "
                              f"({block_size}) must be >= 1")
        if cache_tokens is not None and (not _is_int(cache_tokens) or cache_tokens < 1):
            raise ConfigError(f"serve: cache_tokens must be an int >= 1 (the KV cache's size in tokens), got "
                              f"{cache_tokens!r}; leave it unset for max_batch x the model's context, capped at half "
                              "the free memory")
        if max_batch > token_budget:
            raise ConfigError(f"serve: max_batch ({max_batch}) > token_budget ({token_budget}): every running request "
                              "needs a token of each step's budget; raise token_budget or lower max_batch")
        if token_budget > max_context:
            # A step's packed row longer than the model's context would index past its position
            # tables and causal-mask buffers (GPT-Neo's is context x context): the capture fails.
            log.info("fxspeed: serve's token_budget %d is above %s; each step runs at most %d tokens",
                     token_budget, context_limit or f"the model's context of {max_context} tokens", max_context)
            token_budget, max_batch = max_context, min(max_batch, max_context)
        self._compile = compile_bucket
        self.pack_linear = pack_linear
        # bucket -> seconds of one probe pass per kind of copies (pack_linear="auto",
        # runtime/kernels/packed_linear.fastest_copies)
        self.pack_probe: dict[int, dict[str, float]] = {}
        self._agree = agree
        self._agree_min = agree_min
        self._open_streams: weakref.WeakSet = weakref.WeakSet()  # tp: streams a caller may have left unfinished
        self._bind = bind
        self.vocab_size = vocab_size
        self.max_context = max_context
        self.context_limit = context_limit or f"the model's context of {max_context} tokens"
        self.device = device
        self.token_budget = token_budget
        self.max_batch = max_batch
        self.block_size = block_size
        self.buckets = sorted({*(1 << i for i in range(token_budget.bit_length()) if 1 << i < token_budget),
                               token_budget})
        # The largest bucket first: prefills need it anyway, and with several tokens the kv_cache pass
        # can check that the attention is causal (a one-token trace carries no mask). Under tensor
        # parallelism the first program also decides the layout of the weights for every bucket:
        # decode steps (about max_batch tokens) are most of serving, so their bucket goes first.
        # why: docs/decisions/serving-layout-on-the-decode-bucket.md
        decode = min((b for b in self.buckets if b >= max(2, max_batch)), default=self.buckets[-1])
        if cuda_graphs is None:
            cuda_graphs = device.type == "cuda" and agree is None
        # decode-sized buckets, where launches are most of a step's time and padding costs little
        self.static_buckets = {b for b in self.buckets if b <= decode} if cuda_graphs else set()
        self._capture = device.type == "cuda"
        # pre-packed linear weights of the CPU's small buckets, one copy shared by every bucket,
        # laid out for the decode bucket's rows (runtime/kernels/packed_linear.py); split copies
        # in as many slices as the CPU threads at serve: every bucket's program is compiled for
        # these (the pass reads no thread count of its own; a later torch.set_num_threads changes neither)
        self.packed = PackedWeights(decode, ways=torch.get_num_threads() if device.type == "cpu" else 1)
        # Not probed: it is compiled before any weight list exists (the largest bucket, usually past
        # pack_linear_tokens; under tp the decode bucket), so it packs wherever the pass applies.
        first = self._check_window(compile_bucket(decode if agree is not None else self.buckets[-1],
                                                  "none" if pack_linear == "never" else "packed", self.packed.ways))
        self._packable = (first.gm.meta.get("packable_weights", []), first.gm.meta.get("pack_linear_tokens", 0))
        self._position_tables = first.gm.meta.get("kv_cache_position_tables", ())
        # Where every layer has a sliding window a request keeps `ring` blocks at most, reused in
        # turn: a block's keys are behind every later query's window by the time it is written again
        # Where only some layers slide (Gemma3), those read a block table of their own (kv_cache's
        # "window" group) over a pool of their own, and a request keeps a ring there while the
        # global layers keep every block. The pool holds what max_batch rings can (or as many
        # blocks as the global layers' pool, if fewer): within one stream it never refuses a
        # request the other admits (its requests hold a ring at most, max_batch of them).
        self.rings = {g: ring_blocks(ws, token_budget, block_size) for g, ws in first.kv_group_windows().items()}
        self.ring = self.rings[""]
        if not isinstance(prefix_caching, bool):
            raise ConfigError(f"serve: prefix_caching must be True or False, got {prefix_caching!r}")
        self.prefix_caching = prefix_caching and set(self.rings.values()) == {None}
        self._stamps: Any = None
        # what the first program reads besides the packed copies (which refresh() follows): the
        # same list at every call, whatever buckets are compiled later
        read = [s for s in first.signature.inputs if s.kind not in (*PER_STEP, "kv_cache", *COPY_KINDS)]
        self._stamped = [t for t in map(bind, read) if isinstance(t, torch.Tensor)] if self.prefix_caching else []
        self._bytes_per_token = {g: first.kv_bytes_per_token(g) for g in self.rings}
        window_ring = self.rings.get(WINDOW_GROUP) or 0
        self.cache = _allocate_cache(first, cache_tokens, self.blocks_held(max_context) * block_size * max_batch,
                                     block_size, device, agree_min,
                                     window_blocks=lambda usable: min(usable, max_batch * window_ring))
        self.programs: dict[int, _Bound | _Static] = {}
        self.programs[first.tokens] = self._bound(first)
        self.stats: dict[str, Any] = {"steps": 0, "tokens": 0, "padded_tokens": 0, "preempted": 0,
                                      "prefix_hit_tokens": 0,
                                      "compile_s": first.capture_seconds + first.pass_seconds}
        self.record_logits: dict[int, list[torch.Tensor]] | None = None  # tests: logits per sampled token
        self._only_bucket: int | None = None  # check_against runs every step in one bucket

    def _check_window(self, program: InferenceProgram) -> InferenceProgram:
        """A program whose masks hide keys `window` or more positions back (a sliding window) is
        served as plain causal attention, so only while requests stay within the window."""
        window = program.window
        if window is not None and window < self.max_context:
            raise ConfigError(f"serve: the attention masks of {program.tokens}-token steps hide keys {window} or more "
                              f"positions back (a sliding window) but requests may reach {self.context_limit}; "
                              "fxspeed serves sliding-window attention up to the window only: set the model "
                              f"config's sliding_window to {window} (or max_position_embeddings <= {window})")
        return program

    def _bound(self, program: InferenceProgram) -> _Bound | _Static:
        """Bucket `program` ready to run: at fixed shapes (captured on CUDA) where it is one of the
        static buckets, else at each step's shapes. A capture that fails (an op that synchronizes
        with the host, say) is logged and the bucket runs without a graph."""
        bound = _Bound(program, self._bind, self.cache, self.packed)
        T = program.tokens
        if T not in self.static_buckets:
            return bound
        try:
            return _Static(bound, min(T, self.max_batch), -(-self.max_context // self.block_size), self.device,
                           capture=self._capture)
        except Exception as e:  # noqa: BLE001  any capture failure: run the bucket without a graph
            log.warning("fxspeed: serve could not capture the %d-token program as a CUDA graph (%s: %s); it runs "
                        "without one", T, type(e).__name__, e)
            self.static_buckets.discard(T)
            return bound

    def program(self, T: int) -> _Bound | _Static:
        """The bound program of bucket T, compiled on first use."""
        if T not in self.programs:
            t0 = time.perf_counter()
            program = self._check_window(self._compile(T, self._copies(T), self.packed.ways))
            if list(program.kv_layout) != self.cache.layout or \
                    program.layer_groups() != self.cache.groups:
                # Every bucket writes the same cache: under tensor parallelism its heads must be
                # split the same way in every program (the layout is solved once and kept).
                raise FxspeedError(f"serve: the program for {T} tokens lays out the KV cache as "
                                   f"{list(program.kv_layout)} (heads, head_dim, dtype per layer) but the cache holds "
                                   f"{self.cache.layout}; please report this with the model and Config")
            tables = program.gm.meta.get("kv_cache_position_tables", ())
            if tables != self._position_tables:
                # kv_cache reads `w[:T]` of a parameter or buffer at the tokens' positions (a table of
                # positions, sliced to the row's length in every bucket); a weight sliced to a constant
                # length that equals this bucket's T matches that form here only, and would be misread
                raise ConfigError(f"serve: in {T}-token steps {', '.join(tables) or 'no table'} is sliced to the step's "
                                  f"length and read by position, but in the first program's "
                                  f"{', '.join(self._position_tables) or 'none'}: the model slices a weight to "
                                  f"{T} entries, which cannot be told from a table of positions; serve with a "
                                  "token_budget below that length, or slice that weight otherwise (split, chunk)")
            self.programs[T] = self._bound(program)
            self.stats["compile_s"] += time.perf_counter() - t0
        return self.programs[T]

    def _copies(self, T: int) -> str:
        """The weight copies bucket T's linears read (see __init__'s pack_linear and
        Compiler.inference): "never" holds none beside the model's weights."""
        specs, limit = self._packable
        if self.pack_linear == "never":
            return "none"
        if self.pack_linear == "always" or not specs or T > limit:
            return "packed"
        copies, seconds = fastest_copies(specs, T, self._bind, self.packed.rows, self.packed.ways)
        self.pack_probe[T] = seconds
        log.info("fxspeed: serve: the %d-token bucket's linears read %s copies (a probe pass: %s)", T, copies,
                 ", ".join(f"{k} {s * 1e3:.2f} ms" for k, s in seconds.items()))
        return copies

    def blocks_held(self, positions: int, group: str = "") -> int:
        """Cache blocks a request holds in `group`'s pool once it has fed `positions` tokens: one
        per block_size positions, at most its ring."""
        blocks = -(-positions // self.block_size)
        ring = self.rings[group]
        return min(blocks, ring) if ring else blocks

    def needs(self, positions: int) -> dict[str, int]:
        """The blocks of each pool a request holds once it has fed `positions` tokens."""
        return {g: self.blocks_held(positions, g) for g in self.rings}

    def bytes_held(self, positions: int) -> int:
        """The cache bytes a request of `positions` fed tokens holds, over every layer."""
        return sum(n * self.block_size * self._bytes_per_token[g] for g, n in self.needs(positions).items())

    def _bucket(self, n: int) -> int:
        if self._only_bucket is not None:
            return self._only_bucket
        return next(b for b in self.buckets if b >= n)

    def check_against(self, model: nn.Module, low_precision: bool = False,
                      full_weights: Callable[[], ContextManager[None]] | None = None) -> None:
        """Serve two short requests packed together (a prefill chunk beside decode tokens) and
        compare every sampled row's logits with the model's own eager forward over the whole
        sequence. A model whose positions or attention the passes followed wrongly (positions made
        from the packed row, a mask they did not see) fails here, at serve time, instead of
        generating wrong tokens. Runs in the largest bucket only (no extra compile). `full_weights`:
        under tensor parallelism, the context in which the model holds its whole weights (gathered
        over tp) for the eager reference."""
        prompts = [[(7 * i + 3) % self.vocab_size for i in range(5)], [(11 * i + 1) % self.vocab_size for i in range(3)]]
        new = 3
        if self.cache.usable_blocks < 2 * self.blocks_held(8):
            prompts = prompts[:1]  # a cache too small for both: the check is the last guard, run it on one
        if self.max_context < 8 or self.cache.usable_blocks < self.blocks_held(8):
            log.warning("fxspeed: serve skipped its packed check against the eager model: the context (%d) or the "
                        "cache (%d blocks of %d) is smaller than one 8-token request", self.max_context,
                        self.cache.usable_blocks, self.block_size)
            return
        self._only_bucket, recorded, self.record_logits = self.buckets[-1], self.record_logits, {}
        counters = {k: self.stats[k] for k in ("steps", "tokens", "padded_tokens", "preempted", "prefix_hit_tokens")}
        try:
            outs = self.generate(prompts, max_new_tokens=new)
            got = {i: torch.stack(v) for i, v in self.record_logits.items()}
        finally:
            self._only_bucket, self.record_logits = None, recorded
            self.stats.update(counters)  # the check is not serving work
        eager = getattr(model, "_orig_mod", model)  # a torch.compile'd model: its module, not inductor's compile
        with torch.no_grad(), (full_weights() if full_weights is not None else contextlib.nullcontext()):
            for i, (p, o) in enumerate(zip(prompts, outs)):
                out = eager(torch.tensor([p + o], device=self.device))
                ref = eager_logits(out)[0, len(p) - 1:len(p) + new - 1].float()
                mine = got[i].to(ref.device)
                # Equal values agree, infinities included (a model that masks tokens with -inf: their
                # difference was NaN, so serve refused it). The tolerance scales with the logits that
                # differ, finite ones: a mask's -inf, or finfo.min, made it inf or 1e35, and any
                # error passed.
                same = mine == ref
                err = torch.where(same, 0.0, (mine - ref).abs()).max().item()
                differ = ref[~same & ref.isfinite()]
                scale = differ.abs().max().item() if differ.numel() else 0.0
                tol = (5e-2 if low_precision else 1e-3) * (1.0 + scale)
                if not err <= tol:
                    raise ConfigError(
                        f"serve: {type(model).__name__}'s compiled serving program disagrees with its eager forward "
                        f"(max logit error {err:.3g} > {tol:.3g} on a packed check of {len(prompts)} request(s)), so it would "
                        "generate wrong tokens; the model probably computes positions or masks in a way the "
                        "kv_cache pass cannot follow (e.g. from an attention_mask cumsum), or carries state from "
                        "token to token outside its attention. Please report it")

    # --- requests ---------------------------------------------------------------------------
    def _requests(self, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int], temperature: float,
                  top_k: int | None, top_p: float | None, seed: int | None,
                  eos_token_id: int | Sequence[int] | None,
                  eos_token_ids: Sequence[Any] | None) -> list[_Request | RequestError]:
        if isinstance(prompts, torch.Tensor) or not isinstance(prompts, (list, tuple)):
            # (a batch tensor is refused, not split in rows: Hugging Face's padded input_ids would
            # serve their pad ids as tokens)
            shape = getattr(prompts, "shape", None)
            got = f"a {type(prompts).__name__}" + (f" of shape {tuple(shape)}" if shape is not None else "")
            rows = "; for a batch tensor give input_ids.tolist(), without padding (each prompt its own length)"
            one = "; one prompt's ids go in a list of their own: [ids]"  # (a 1-D tensor or array is one prompt)
            hint = {1: one, 2: rows}.get(len(shape), "") if shape is not None else ""
            raise ConfigError(f"generate: prompts must be a list of token-id lists (one per request), got {got}{hint}")
        if prompts and all(_is_int(p) for p in prompts):  # each id would fail as a prompt of its own
            raise ConfigError(f"generate: prompts {_short(list(prompts))} is one prompt's token ids; give a list of "
                              f"prompts, [{_short(list(prompts))}] for this one")
        n = len(prompts)
        if isinstance(max_new_tokens, torch.Tensor) and max_new_tokens.dim() == 0 and not max_new_tokens.is_floating_point():
            max_new_tokens = int(max_new_tokens)
        if isinstance(max_new_tokens, numbers.Integral):  # one for all (a bool is refused per request below)
            max_new = [max_new_tokens] * n
        else:
            try:  # (a 0-d tensor or numpy array is Iterable, and fails here)
                max_new = None if isinstance(max_new_tokens, (str, bytes)) else list(max_new_tokens)
                if isinstance(max_new_tokens, torch.Tensor) and not max_new_tokens.is_floating_point():
                    max_new = [int(m) for m in max_new]  # a tensor of ints, as numpy's already were
            except TypeError:
                max_new = None
            if max_new is None:
                raise ConfigError(f"generate: max_new_tokens must be an int or one int per prompt, got "
                                  f"{type(max_new_tokens).__name__} {max_new_tokens!r}")
            if len(max_new) != n:
                raise ConfigError(f"generate: max_new_tokens has {len(max_new)} entries for {n} prompts; give an int "
                                  "or one per prompt")
        if eos_token_ids is not None and len(eos_token_ids) != n:
            raise ConfigError(f"generate: eos_token_ids has {len(eos_token_ids)} entries for {n} prompts (one per "
                              "prompt; eos_token_id= applies one to all)")
        if eos_token_ids is not None and eos_token_id is not None:
            # one would silently win over the other
            raise ConfigError("generate: give eos_token_id (stops every request) or eos_token_ids (one entry per "
                              "prompt), not both; put the shared ids into each entry of eos_token_ids")
        eos_each = list(eos_token_ids) if eos_token_ids is not None else [eos_token_id] * n
        name = "eos_token_ids" if eos_token_ids is not None else "eos_token_id"
        eos_sets = [_eos_set(e, name) for e in eos_each]
        outside = sorted({t for e in eos_sets for t in e if not 0 <= t < self.vocab_size})
        if outside:  # it could never be sampled: the request would silently run to max_new_tokens
            raise ConfigError(f"generate: {name} {outside[:5]} outside the vocabulary [0, {self.vocab_size}) can never "
                              "be generated; give ids of the model's vocabulary (or None for no stop token)")
        _check_sampling(temperature, top_k, top_p, seed)
        out: list[_Request | RequestError] = []
        for i, p in enumerate(prompts):
            ids, bad = _token_ids(p)
            if ids is None:
                out.append(RequestError(i, f"the prompt is not a list of integer token ids ({bad})"))
                continue
            m = max_new[i]
            err = None
            if not ids:
                err = "the prompt is empty; give at least one token id"
            elif any(t < 0 or t >= self.vocab_size for t in ids):
                bad = next(t for t in ids if t < 0 or t >= self.vocab_size)
                err = f"token id {bad} is outside the vocabulary [0, {self.vocab_size})"
            elif not _is_int(m) or m < 1:
                err = f"max_new_tokens must be an int >= 1, got {m!r}"
            elif fed_tokens(len(ids), m) > self.max_context:
                err = (f"prompt ({len(ids)} tokens) + max_new_tokens ({m}) - 1 = {fed_tokens(len(ids), m)} positions "
                       f"exceeds {self.context_limit}; shorten the prompt or lower max_new_tokens")
            elif any(n > self.cache.usable(g) for g, n in self.needs(fed_tokens(len(ids), m)).items()):
                held = self.blocks_held(fed_tokens(len(ids), m))
                ring = (f" (a ring of {held} blocks of {self.block_size}: its sliding window plus a step's token "
                        "budget)" if self.ring and held == self.ring else "")
                err = (f"needs {held * self.block_size} tokens of KV cache{ring} but the whole cache holds "
                       f"{self.cache.usable_blocks * self.block_size}; raise serve(..., cache_tokens=)")
            if err:
                out.append(RequestError(i, err))
                continue
            eos = eos_sets[i]
            gen = None
            if temperature > 0:
                gen = torch.Generator(device="cpu")
                # int(seed): numpy's ints overflowed in the arithmetic below
                base = int(seed) if seed is not None else int(torch.randint(0, 2**31, ()).item())
                # per request: results do not depend on batching; within the generator's 64 bits (a
                # seed from time.time_ns() overflowed)
                gen.manual_seed((base * 1_000_003 + i) % 2**64)
            out.append(_Request(i, ids, int(m), eos, temperature, top_k, top_p, gen))
        return out

    # --- the loop ---------------------------------------------------------------------------
    def stream(self, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int] = 16,
               *, _to_the_end: bool = False, **options: Any) -> Iterator[tuple[int, int | RequestError]]:
        """Yield (req_id, token) as tokens are produced, (req_id, RequestError) for a refused request.
        options: temperature (0.0: greedy), top_k, top_p, seed, eos_token_id (an id or a list of ids:
        stops every request), eos_token_ids (one per request).
        `_to_the_end`: the caller (generate) consumes every token, so tensor-parallel ranks need not
        check before each step that the others still iterate (a one-int all-reduce per step)."""
        g = self._stream(prompts, max_new_tokens, _to_the_end=_to_the_end, **options)
        if self._agree_min is not None and not _to_the_end:
            self._open_streams.add(g)
        return g

    def close_open_streams(self) -> None:
        """Tensor parallelism: close this rank's streams that were left unfinished but are still
        referenced (`g = engine.stream(...)`; `for t in g: break`). Until closed, such a stream has
        not told the other ranks it stopped (`_stream`'s GeneratorExit), and a rank that goes on
        with it waits for this one. The engine calls it before each generate or stream."""
        for g in list(self._open_streams):
            g.close()
        self._open_streams.clear()

    def _stream(self, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int] = 16, *,
                temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
                seed: int | None = None, eos_token_id: int | Sequence[int] | None = None,
                eos_token_ids: Sequence[Any] | None = None,
                _to_the_end: bool = False) -> Iterator[tuple[int, int | RequestError]]:
        reqs = self._requests(prompts, max_new_tokens, temperature, top_k, top_p, seed, eos_token_id, eos_token_ids)
        with torch.inference_mode(False):
            stale = self.packed.refresh()  # weights written since they were packed (an optimizer step, a load)
        if stale:
            log.info("fxspeed: serve packed %d weights again (changed since packing: %s)", len(stale),
                     ", ".join(stale[:3]) + (" ..." if len(stale) > 3 else ""))
        if self.prefix_caching and self._weights_changed(stale):
            self.cache.forget_prefixes()  # cached keys and values of the old weights
        waiting = [r for r in reqs if not isinstance(r, RequestError)]
        active: list[_Request] = []
        try:
            for r in reqs:  # inside the try: a caller stopping at a refused request stops the stream too
                if isinstance(r, RequestError):
                    yield r.req_id, r
            yield from self._loop(waiting, active, check_peers=not _to_the_end)
        except GeneratorExit:
            # The caller stopped iterating between steps. Under tensor parallelism the other ranks
            # wait at the next step's check (`_loop`): tell them this stream stops here, so one that
            # goes on gets an error instead of a collective no rank joins (a hang to dist_timeout_s).
            # Every rank holds the same requests at every yield, so they agree on "a next step".
            if not _to_the_end and self._agree_min is not None and (waiting or any(not r.done() for r in active)):
                self._agree_min(0)
            raise
        finally:
            # the caller stopped iterating (or a step failed): give the blocks back
            for r in active:
                self.cache.release(r.blocks)
                r.blocks = {}

    def _loop(self, waiting: list[_Request], active: list[_Request],
              check_peers: bool) -> Iterator[tuple[int, int | RequestError]]:
        steps = 0
        while waiting or active:
            while waiting and len(active) < self.max_batch:
                r = waiting[0]
                # the blocks of what it feeds first: its prompt (after a preemption, its tokens so far);
                # a block of room is left for each running request's next one (that may still grow),
                # so that admitting does not at once preempt
                seq = len(r.prompt) + len(r.out)
                need = self.needs(seq)
                # its first full blocks already in the cache (a shared prompt, or its own before a
                # preemption): read, not computed again; its last token is always fed, for its logits
                hits, chain = self.cache.match(r.prompt + r.out, (seq - 1) // self.block_size) \
                    if self.prefix_caching else ([], 0)
                need[""] -= len(hits)
                free = {g: self.cache.free_blocks(g) - (self.cache.idle_among(hits) if g == "" else 0) for g in need}
                room = all(free[g] >= n + self._growing(active, g) for g, n in need.items())
                blocks = None
                if room or (not active and all(free[g] >= n for g, n in need.items())):
                    self.cache.hold(hits)
                    blocks = self.cache.allocate(need)
                    assert blocks is not None  # counted above
                    blocks[""] = hits + blocks[""]
                    r.cached = len(hits) * self.block_size
                    r.indexed, r.chain, r.generation = len(hits), chain, self.cache.generation
                    self.stats["prefix_hit_tokens"] += r.cached
                if blocks is None and not active:
                    # Nothing here will give blocks back: another stream() of this engine, paused by its
                    # caller, holds them. Waiting would never end, so refuse this request.
                    waiting.pop(0)
                    short = next(g for g, n in need.items() if n > free[g])
                    # (the sliding layers' pool holds max_batch rings, whatever cache_tokens says)
                    raise_it = "serve(..., max_batch=)" if short else "serve(..., cache_tokens=)"
                    yield r.id, RequestError(r.id, f"needs {need[short]} KV-cache blocks"
                                                   + (f" of its sliding layers' pool ({self.max_batch} rings)"
                                                      if short else "")
                                                   + f" but only {free[short]} of "
                                                   f"{self.cache.usable(short)} are free: another unfinished stream() "
                                                   "of this engine holds the rest; finish or close it first, or "
                                                   f"raise {raise_it}")
                    continue
                if blocks is None:
                    break  # it fits in the cache (checked), just not now: wait for others to finish
                r.blocks = blocks
                active.append(waiting.pop(0))
            if not active:
                continue
            self._grow(active, waiting)
            if not active:  # its only request gave its blocks back: another stream holds the rest
                continue
            chunks = self._schedule(active)
            # Normal tensors whatever mode the caller is in: caches, packed copies and programs made
            # under torch.inference_mode could not be written in place outside it later. (Not around
            # the yields: a mode entered there would hold in the caller's loop.)
            if check_peers and self._agree_min is not None and self._agree_min(1) == 0:
                raise FxspeedError(
                    f"stream: another tensor-parallel rank stopped iterating this stream (closed it, broke out of its "
                    f"loop, or raised) after step {steps}, while this rank asked for the next tokens; every rank "
                    "must consume a tensor-parallel stream to the same token (break at the same place on every rank, "
                    "or use generate)")
            with torch.inference_mode(False):
                sampled = self._step(chunks)
            steps += 1
            for r, tok in sampled:  # all first: a caller that stops at any of these yields sees the step done
                r.out.append(tok)
            for r, tok in sampled:
                yield r.id, tok
            for r in [r for r in active if r.done()]:
                self.cache.release(r.blocks)
                r.blocks = {}
                active.remove(r)

    def _grow(self, active: list[_Request], waiting: list[_Request]) -> None:
        """Give each decoding request the block its next token starts, oldest first (a request
        holds the blocks of what it has fed, not of its whole length: one that stops early at
        eos never held the rest). Where none is free, the youngest running request gives its
        blocks back and waits at the head of the queue; readmitted, it feeds its prompt and its
        tokens so far again, then goes on sampling from where it was (vLLM's preemption by
        recompute). The oldest always goes on, so every request finishes."""
        for r in list(active):
            while r in active:
                want = {g: n - len(r.blocks.get(g, ())) for g, n in self.needs(r.cached + r.to_feed()).items()}
                want = {g: n for g, n in want.items() if n > 0}
                got = self.cache.allocate(want) if want else {}
                if got is not None:
                    for g, blocks in got.items():
                        r.blocks.setdefault(g, []).extend(blocks)
                    break
                victim = active.pop()
                self.cache.release(victim.blocks)  # its indexed blocks stay findable: it may read them back
                victim.blocks, victim.cached, victim.indexed, victim.chain = {}, 0, 0, 0
                waiting.insert(0, victim)
                self.stats["preempted"] += 1

    def _growing(self, active: list[_Request], group: str) -> int:
        """Running requests that may still take a block of `group`'s pool: all of them, or where
        the pool holds rings, those whose ring is not whole yet."""
        ring = self.rings[group]
        return sum(1 for r in active if not ring or len(r.blocks.get(group, ())) < ring)

    def _index_full_blocks(self, r: _Request) -> None:
        """Put the blocks the step just run filled into the cache's prefix index. Not those of a
        request admitted before the index was dropped (a paused stream's, across a weight write):
        their first positions hold the old weights' keys (h46: such a block was read as the new
        weights' by a later call)."""
        if r.generation != self.cache.generation:
            return
        bs, blocks = self.block_size, r.blocks[""]
        full = min(r.cached // bs, len(blocks))
        if r.indexed < full:
            seq = r.prompt + r.out
            for k in range(r.indexed, full):
                r.chain = self.cache.index(blocks[k], r.chain, tuple(seq[k * bs:(k + 1) * bs]))
            r.indexed = full

    def _weights_changed(self, stale: list[str]) -> bool:
        """Whether the weights were written since the last call (`stale`: packed copies refreshed
        just now; the first program's other weights by their stamps), agreed over tensor-parallel
        ranks."""
        stamps = weight_stamps(self._stamped)
        changed = bool(stale) or stamps != self._stamps
        self._stamps = stamps
        if self._agree_min is not None:
            changed = self._agree_min(0 if changed else 1) == 0
        return changed

    def _schedule(self, active: list[_Request]) -> list[tuple[_Request, int]]:
        """(request, tokens fed this step): decode tokens first (a request with one token to
        feed), then prompt chunks (a prompt, or after a preemption its prompt and tokens so far)."""
        budget = self.token_budget
        chunks: list[tuple[_Request, int]] = []
        for r in active:
            if r.to_feed() == 1 and budget > 0:
                chunks.append((r, 1))
                budget -= 1
        for r in active:
            left = r.to_feed()
            if left > 1 and budget > 0:
                c = min(left, budget)
                chunks.append((r, c))
                budget -= c
        return chunks

    def _step(self, chunks: list[tuple[_Request, int]]) -> list[tuple[_Request, int]]:
        n = sum(c for _, c in chunks)
        T = self._bucket(n)
        bound = self.program(T)
        bs = self.block_size
        tokens = torch.zeros(1, T, dtype=torch.long)
        positions = torch.zeros(1, T, dtype=torch.long)
        S, Q, NB = bound.shape(len(chunks), max(c for _, c in chunks),
                               max(-(-(r.cached + c) // bs) for r, c in chunks))
        # per block table ("": every layer, or the global ones where a model has sliding layers too)
        slots = {g: torch.zeros(T, dtype=torch.long) for g in self.rings}  # padding writes block 0
        block_table = {g: torch.zeros(S, NB, dtype=torch.long) for g in self.rings}
        query_index = torch.full((S, Q), T, dtype=torch.long)
        query_pos = torch.zeros(S, Q, dtype=torch.long)
        at = 0
        last: list[tuple[_Request, int]] = []
        for s, (r, c) in enumerate(chunks):
            feed = r.pending()[:c]
            pos = torch.arange(r.cached, r.cached + c)
            tokens[0, at:at + c] = torch.tensor(feed)
            positions[0, at:at + c] = pos
            nb = -(-(r.cached + c) // bs)
            for g, held in r.blocks.items():
                blocks = torch.tensor(held, dtype=torch.long)
                # logical block b of the sequence is block b % len(blocks) of its own: the same unless
                # a ring (sliding windows) holds fewer blocks than the sequence spans
                slots[g][at:at + c] = blocks[(pos // bs) % len(blocks)] * bs + pos % bs
                block_table[g][s, :nb] = blocks[torch.arange(nb) % len(blocks)]
            query_index[s, :c] = torch.arange(at, at + c)
            query_pos[s, :c] = pos
            r.cached += c
            if r.cached >= len(r.prompt) + len(r.out):
                last.append((r, at + c - 1))
            at += c
        rows_at = torch.tensor([i for _, i in last], dtype=torch.long)
        # a static bucket selects S rows (the extra ones read row 0 and are dropped below)
        select = torch.cat([rows_at, rows_at.new_zeros(S - len(last))]) if bound.static else rows_at
        step = {k: v.to(self.device) for k, v in (("tokens", tokens), ("positions", positions),
                                                  ("query_index", query_index), ("query_pos", query_pos),
                                                  ("logits_index", select))}
        for g in self.rings:
            step[step_key("slot_mapping", g)] = slots[g].to(self.device)
            step[step_key("block_table", g)] = block_table[g].to(self.device)
        logits = bound(step)
        if self.prefix_caching:  # after the step ran: a step that raised wrote nothing to index
            for r, _ in chunks:
                self._index_full_blocks(r)
        self.stats["steps"] += 1
        self.stats["tokens"] += n
        self.stats["padded_tokens"] += T - n
        if not last:
            return []
        rows = (logits[0, :len(last)] if bound.program.selects_logits else logits[0, rows_at.to(logits.device)]).float()
        # greedy rows in one argmax over the step's rows (per row: ~90 us each on a 50k vocabulary)
        greedy = rows.argmax(-1).tolist() if any(r.temperature == 0.0 for r, _ in last) else []
        picked = torch.tensor([greedy[i] if r.temperature == 0.0 else _sample(row, r)
                               for i, ((r, _), row) in enumerate(zip(last, rows))], dtype=torch.long)
        if self._agree is not None:
            picked = self._agree(picked)
        if self.record_logits is not None:
            for (r, _), row in zip(last, rows):
                self.record_logits.setdefault(r.id, []).append(row.detach().cpu().clone())
        return [(r, int(t)) for (r, _), t in zip(last, picked.tolist())]

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int] = 16, *,
                 on_error: str = "raise", **kw: Any) -> list[Any]:
        if on_error not in ("raise", "return"):
            raise ConfigError(f"generate: on_error must be 'raise' or 'return', got {on_error!r}")
        results: list[Any] = [[] for _ in prompts]
        for rid, tok in self.stream(prompts, max_new_tokens, **kw, _to_the_end=True):
            if isinstance(tok, RequestError):
                results[rid] = tok
            else:
                results[rid].append(tok)
        if on_error == "raise" and any(isinstance(r, RequestError) for r in results):
            raise GenerationError(results)
        return results


# Hugging Face generate() arguments a user brings along, and what fxspeed takes instead
_HF_GENERATE_HINTS = {
    "do_sample": "temperature > 0 samples, temperature=0 (the default) is greedy",
    "max_length": "give max_new_tokens (new tokens per prompt, an int or one per prompt)",
    "min_new_tokens": "not supported: a request stops at max_new_tokens or at one of its eos ids",
    "num_beams": "beam search is not supported (greedy or sampling only)",
    "pad_token_id": "not needed: requests are packed, never padded",
    "attention_mask": "not needed: give each prompt as its own list of ids, unpadded",
}


def generate_options(name: str) -> tuple[str, ...]:
    """The keyword options engine.stream / engine.generate take: read from ServingLoop's own
    signatures, so a new option is never refused by a stale list."""
    def keywords(f: Callable) -> list[str]:
        return [p.name for p in inspect.signature(f).parameters.values()
                if p.kind is inspect.Parameter.KEYWORD_ONLY and not p.name.startswith("_")]

    return tuple(keywords(ServingLoop._stream) + (keywords(ServingLoop.generate) if name == "generate" else []))


def check_generate_options(name: str, kwargs: dict) -> None:
    """An unknown keyword is refused by name with what to use instead (it failed as a TypeError
    naming the internal ServingLoop.stream)."""
    allowed = generate_options(name)
    unknown = [k for k in kwargs if k not in allowed]
    if unknown:
        hints = "; ".join(f"{k}: {_HF_GENERATE_HINTS[k]}" for k in unknown if k in _HF_GENERATE_HINTS)
        raise ConfigError(f"engine.{name}() got unknown option(s) {unknown}" + (f" ({hints})" if hints else "")
                          + f"; it takes prompts, max_new_tokens and {', '.join(allowed)}")


def _sample(logits: torch.Tensor, r: _Request) -> int:
    if r.temperature == 0.0:
        return int(torch.argmax(logits).item())
    # From the row's maximum: a tiny temperature then sends the others to -inf, not the maximum
    # to inf (softmax of an inf is NaN: temperature=1e-40 failed the whole call)
    x = logits.float()
    x = (x - x.max()) / r.temperature
    if r.top_k is not None and 0 < r.top_k < x.numel():
        kth = torch.topk(x, r.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if r.top_p is not None and r.top_p < 1.0:
        sorted_x, idx = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, -1)
        # keep the smallest prefix whose mass reaches top_p: a token goes once the mass before it
        # does (`>`: two tokens of 0.5 under top_p=0.5 were both kept; Hugging Face keeps one)
        drop = probs.cumsum(-1) - probs >= r.top_p
        x = x.clone()
        x[idx[drop]] = float("-inf")
    probs = torch.softmax(x, -1).cpu()
    return int(torch.multinomial(probs, 1, generator=r.generator).item())


def eager_logits(out: Any) -> torch.Tensor:
    """The logits in a model's eager output, the one the serving program keeps of its outputs
    (fxspeed/compiler/capture_inference.py): the "logits" entry of a Hugging Face ModelOutput or
    a dict, else the first tensor. A nanoGPT-style `(logits, loss)` tuple failed serve's check
    with a TypeError (it read out["logits"]) though its program was right."""
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "keys") and "logits" in out.keys():
        return out["logits"]
    first = next((t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)), None)
    if first is None:
        raise ConfigError(f"serve: the model's forward returned {type(out).__name__} with no tensor in it; a served "
                          "model returns its logits (a tensor, a (logits, ...) tuple, or an output with .logits)")
    return first


def fed_tokens(prompt: int, max_new: int) -> int:
    """Positions (and cache slots) a request takes: its prompt and every new token but the last,
    which is sampled and returned, never fed."""
    return prompt + max_new - 1


def _short(ids: list[Any]) -> str:
    """Token ids for a message: the first 8, as plain ints (numpy's repr as np.int64(5))."""
    return f"[{', '.join(str(int(t)) for t in ids[:8])}{', ...' if len(ids) > 8 else ''}]"


def _is_int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _check_sampling(temperature: Any, top_k: Any, top_p: Any, seed: Any) -> None:
    """generate's sampling options, refused before any work (a NaN temperature used to fail in
    the middle of a generation, a top_p of 1.5 or a negative top_k to be ignored)."""
    if not isinstance(temperature, numbers.Real) or not math.isfinite(temperature) or temperature < 0:
        raise ConfigError(f"generate: temperature must be a finite number >= 0 (0 is greedy), got {temperature!r}")
    if top_k is not None and (not _is_int(top_k) or top_k < 0):
        raise ConfigError(f"generate: top_k must be an int >= 0 (0 or None: no top-k cut), got {top_k!r}")
    if top_p is not None and (not isinstance(top_p, numbers.Real) or not 0.0 < top_p <= 1.0):
        raise ConfigError(f"generate: top_p must be a number in (0, 1] (1 or None: no nucleus cut), got {top_p!r}")
    if seed is not None and not _is_int(seed):
        raise ConfigError(f"generate: seed must be an int or None, got {seed!r}")
    if temperature == 0 and (top_k not in (None, 0) or top_p not in (None, 1.0)):
        log.warning("fxspeed: generate: top_k / top_p apply to sampling only; temperature=0 decodes greedily (set a "
                    "temperature > 0 to sample)")


def _eos_set(e: Any, name: str) -> frozenset[int]:
    """One request's stop tokens: None, an id, or a list of ids."""
    if isinstance(e, torch.Tensor) or type(e).__module__ == "numpy":  # ids as a tensor or array, as prompts may be
        e = e.tolist()
    ids = [] if e is None else [e] if not isinstance(e, (list, tuple, set, frozenset)) else list(e)
    if not all(_is_int(t) for t in ids):
        raise ConfigError(f"generate: {name} must be a token id, a list of ids or None (per request for "
                          f"eos_token_ids), got {e!r}")
    return frozenset(int(t) for t in ids)


def check_pack_linear(mode: str) -> None:
    """serve's `pack_linear` is one of the three modes (checked before serve does any work)."""
    if mode not in ("auto", "always", "never"):
        raise ConfigError(f"serve: pack_linear must be 'auto', 'always' or 'never', got {mode!r}")


def ring_blocks(windows: Sequence[int], token_budget: int, block_size: int) -> int | None:
    """The blocks a request needs at most when every layer has a sliding window (None when one
    layer has none). A step's chunk of c <= token_budget queries at positions a .. a+c-1 reads
    keys a-W+1 .. a+c-1 (W the widest window). With R blocks in turn (logical block b in block
    b % R), a slot written at position p' last held p = p' - m*R*block_size; so p is still
    where it was written for every query that sees it if R*block_size > (a+c-1) - (a-W+1), that is
    R = ceil((W + token_budget - 1) / block_size), and no fewer (a run of full chunks needs them).

        window 6, budget 8, blocks of 4: ceil(13 / 4) = 4 blocks, whatever the context."""
    if not windows or not all(w > 0 for w in windows):
        return None
    return -(-(max(windows) + token_budget - 1) // block_size)


def sliding_windows(model: nn.Module) -> tuple[int, ...] | None:
    """Each attention layer's sliding window (0: none), in layer order, from a Hugging Face
    config: `sliding_window` on the layers `layer_types` names "sliding_attention" (Gemma3,
    Qwen2, ...), or on every layer where the config has no layer kinds (Mistral, Mixtral). None
    where no layer slides, or the config does not say which layers do (another kind of layer).

    None too where the model's code never reads `sliding_window`: Hugging Face keeps any key of a
    config.json, so a Llama checkpoint may carry one its attention ignores. kv_cache refuses a
    config window the masks of a bucket longer than it do not show, but a window past the longest
    bucket cannot be checked so, and applied it gave a Llama with `sliding_window=12` other tokens
    than HF's from position 13 (h37); such a model keeps the older rule (served up to the window)."""
    cfg = getattr(model, "config", None)
    window = getattr(cfg, "sliding_window", None)
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0 \
            or not getattr(cfg, "use_sliding_window", True) or not _reads_sliding_window(type(model)):
        return None
    kinds = getattr(cfg, "layer_types", None)
    if isinstance(kinds, (list, tuple)) and kinds:
        if not set(kinds) <= {"sliding_attention", "full_attention"} or "sliding_attention" not in kinds:
            return None
        return tuple(window if k == "sliding_attention" else 0 for k in kinds)
    layers = getattr(cfg, "num_hidden_layers", None)
    return (window,) * layers if isinstance(layers, int) and layers > 0 else None


@functools.cache
def _reads_sliding_window(cls: type) -> bool:
    """Whether the source of the module defining `cls` (or a base class's) names sliding_window
    (read once per class: every bucket's compile asks)."""
    for klass in cls.__mro__:
        name = klass.__module__
        module = sys.modules.get(name)
        # (Hugging Face's shared base classes name it for the models that use it: not evidence)
        if module is None or name.startswith(("torch", "builtins")) or (
                name.startswith("transformers.") and not name.startswith("transformers.models.")):
            continue
        try:
            if "sliding_window" in inspect.getsource(module):
                return True
        except (OSError, TypeError):
            continue
    return False


# Hugging Face model types whose layers keep a recurrent state (no context length in their configs)
_RECURRENT_MODEL_TYPES = ("recurrent_gemma", "mamba", "mamba2", "falcon_mamba", "xlstm")


def model_vocab(model: nn.Module) -> int | None:
    """The model's vocabulary size: its config's vocab_size, else its input embedding's rows;
    None where neither says."""
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if vocab is None:
        emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        vocab = emb.num_embeddings if emb is not None else None
    return vocab


def model_limits(model: nn.Module) -> tuple[int, int, str]:
    """(vocab size, context length, what that length is: for an error message) from the model's
    config (Hugging Face or fxspeed's GPT)."""
    cfg = getattr(model, "config", None)
    vocab = model_vocab(model)
    ctx = None
    for name in ("max_position_embeddings", "n_positions", "block_size", "n_ctx", "max_seq_len"):
        ctx = ctx or getattr(cfg, name, None)
    attn_config = getattr(cfg, "attn_config", None)
    if getattr(cfg, "model_type", None) == "bloom" or getattr(attn_config, "alibi", False):
        # the real reason, before any context-length message (BLOOM has no context length at all)
        raise ConfigError(f"serve: {type(model).__name__} adds ALiBi position biases to its attention scores; "
                          "fxspeed.serve threads the KV cache through plain causal attention, so this model "
                          "cannot be served yet")
    if getattr(cfg, "is_encoder_decoder", False):
        raise ConfigError(f"serve: {type(model).__name__} is an encoder-decoder model; fxspeed.serve serves decoder-only "
                          "causal language models (a KV cache over one causal attention stack), so this model cannot "
                          "be served yet")
    if getattr(cfg, "model_type", None) in _RECURRENT_MODEL_TYPES:
        # the real reason: these carry a recurrent state from token to token (and no context length)
        raise ConfigError(f"serve: {type(model).__name__} ({cfg.model_type}) carries a recurrent state from token to "
                          "token (state-space or recurrent layers), not only keys and values; fxspeed.serve threads a "
                          "KV cache through causal attention, so this model cannot be served yet")
    if vocab is None or ctx is None:
        raise ConfigError(f"serve: cannot read the vocabulary size and context length of {type(model).__name__} "
                          "(model.config.vocab_size and max_position_embeddings / n_positions / block_size)")
    what = f"the model's context of {ctx} tokens"
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None)
    kind = (rope.get("rope_type") or rope.get("type")) if isinstance(rope, dict) else None
    if kind in ("longrope", "dynamic"):
        # both rewrite the rotary frequencies from the longest position of the call: a packed row
        # of several requests would give each the frequencies of the longest
        raise ConfigError(f"serve: {type(model).__name__} uses {kind!r} rotary scaling (config rope_type), which "
                          "changes the rotary frequencies with the sequence length; fxspeed.serve does not serve it "
                          "yet. Build the model with rope scaling off or of a fixed kind ('linear', 'yarn', "
                          "'llama3')")
    window = getattr(cfg, "sliding_window", None)
    layer_types = getattr(cfg, "layer_types", None)
    if isinstance(layer_types, (list, tuple)) and layer_types and "sliding_attention" not in layer_types:
        window = None  # Hugging Face's per-layer kinds: no layer slides (Qwen2's max_window_layers)
    if isinstance(window, int) and window < ctx and getattr(cfg, "use_sliding_window", True) \
            and sliding_windows(model) is None:
        # A window whose layers the config does not name is not applied (the paged attention gets
        # each layer's window from the config): served as plain causal attention, up to the window
        what = (f"the model's sliding window of {window} tokens (its context is {ctx}; fxspeed serves "
                "sliding-window attention up to the window only)")
        ctx = window
    return int(vocab), int(ctx), what
