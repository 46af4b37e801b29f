"""Linear layers over pre-packed weights on the CPU (oneDNN), for the serving programs' small
buckets (passes/inference/pack_linear_weights.py).

A decode step multiplies a handful of rows by every weight of the model. On the CPU, ATen's
`addmm`/`mm` hand that to MKL's GEMM, which for a few rows reaches a fraction of the memory
bandwidth the step is bound by (measured on the 2-core AMD EPYC dev box, 24 GPT-2 MLP weights,
fp32, milliseconds per pass over them):

    rows          1      8      16     32     128    256
    MKL addmm     13.8   39-59  69     89     189    215
    oneDNN packed 10.6   14.8   20-31  40     123    222-259

oneDNN's linear over a weight reordered once into its blocked layout
(`mkldnn::_reorder_linear_weight`, an opaque `torch._mkldnn` tensor of the same size) streams the
weight at 1.5-3x the rate; at a full prefill bucket the two are about even. The sums run in
another order than MKL's: outputs differ by about 1e-5 relative.

That table is one machine's: on another day's box of the same kind ATen's GEMM was 1.2x faster
than the packed copies at 1-2 rows (and slower from 4), so the serving loop measures which is
faster for each small bucket before it compiles it (`fastest_copies`).

`PackedWeights` holds the packed copies of one serving loop: one per weight (shared by every
bucket), made on first use, and made again when the source weight changed in place since
(`refresh`, called at every generate), so a packed copy never goes stale silently. A write
through `p.data` (`p.data.copy_(...)`, a LoRA merge `w.data += delta`) bumps no version counter
the Parameter shows, so the stamp also holds a sample of the weight's bits: its first column and
first row (a row or column written for a new token) and 4096 elements strided over the whole
(any write to all of it). A `.data` write missing all three (a few elements inside) is not seen:
write weights with `torch.no_grad(): p.copy_(...)`, which bumps the version.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import torch

from fxspeed.ir import IOSpec

# A packed weight as a program input: the Parameter (or its tp slice) named by the target, as
# [out, in] ("packed_weight": nn.Linear's layout) or transposed ("packed_weight_t": a Conv1D
# weight [in, out], GPT-2's).
PACKED_KINDS = ("packed_weight", "packed_weight_t")
# A weight as a program input for ATen's GEMM: an nn.Linear weight [out, in] copied once as a
# contiguous [in, out] (what a small bucket compiled without oneDNN reads, see `transposed`).
TRANSPOSED_KIND = "transposed_weight"
# A weight as a program input for a product split over the CPU threads (`split_linear`): an
# [out, in] weight ("split_weight") or a Conv1D's [in, out] ("split_weight_t") copied as
# [k, in, n], the k slices of n = ceil(out / k) output columns (the last zero-padded).
SPLIT_KINDS = ("split_weight", "split_weight_t")
# every kind of copy `PackedWeights` holds
COPY_KINDS = (*PACKED_KINDS, TRANSPOSED_KIND, *SPLIT_KINDS)
LINEAR = torch.ops.mkldnn._linear_pointwise.default


def available() -> bool:
    """oneDNN is built in and enabled (it is in every x86 CPU build of torch)."""
    return torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled


def pack(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """`weight` [out, in] (any strides) reordered for oneDNN's linear at about `rows` rows."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows)


def transposed(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [out, in] copied as a contiguous [in, out], ATen's GEMM's fast layout at a few rows.
    MKL multiplies a row by an [in, out] matrix (a sum of its rows: one stream through it) at about
    the machine's read bandwidth, and by the transpose of an [out, in] one (a dot product per
    output) at ~60% of it (2-core AMD EPYC, 1 thread, GPT-2's tied 50257 x 768 head at one row:
    8.3 ms against 13.5; reading it once with sum: 8.5 ms). The sums run in another order: logits
    differ by float rounding (~1e-6 here)."""
    return weight.detach().t().contiguous()


def split(weight: torch.Tensor, ways: int) -> torch.Tensor:
    """`weight` [out, in] copied as [ways, in, n]: slice i holds output columns i*n .. (i+1)*n - 1
    as [in, n] (n = ceil(out / ways), the last slice zero-padded), what `split_linear` reads."""
    out, inp = weight.shape
    n = -(-out // ways)
    w = weight.detach().t()  # [in, out]
    if n * ways != out:
        w = torch.nn.functional.pad(w, (0, n * ways - out))
    return w.reshape(inp, ways, n).permute(1, 0, 2).contiguous()


def split_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: int) -> torch.Tensor:
    """x [M, in] times the weight behind `split(w, k)` ([k, in, n]), plus `bias` [out]: [M, out].
    Why: at a row or two ATen's GEMM (MKL) runs the whole product on one thread and oneDNN's
    packed linear did not reach the 2-thread read bandwidth either (2-core EPYC: 1 thread ~23 GB/s,
    2 threads ~33), while a batch of k products is split over the threads, each streaming its own
    slice of the weight (GPT-2's 50257 x 768 head at one row: 34.6 GB/s). The sums over `in` run
    as in the [in, out] GEMM's, per column."""
    k, inp, n = weight.shape
    rows = x.shape[0]
    y = torch.bmm(x.unsqueeze(0).expand(k, rows, inp), weight)  # [k, M, n]
    y = y.transpose(0, 1).reshape(rows, k * n)  # (a view at one row)
    if k * n != out:
        y = y[:, :out]
    return y + bias if bias is not None else y.contiguous()


def out_in(spec: IOSpec, source: torch.Tensor) -> torch.Tensor:
    """The weight behind copy input `spec` as [out, in] (a view): a Conv1D's [in, out] transposed."""
    return source.t() if spec.kind in ("packed_weight_t", "split_weight_t") else source


class PackedWeights:
    """The packed copies a serving loop's programs read (see the module docstring), the
    [in, out] copies of [out, in] weights that small buckets running ATen's GEMM read
    (`transposed`) and the split copies of those splitting their products over the threads
    (`split`). `rows`: the row count the packed layout is chosen for (the decode bucket);
    `ways`: the slices of a split copy (the CPU threads at serve)."""

    def __init__(self, rows: int, ways: int = 1) -> None:
        self.rows = rows
        self.ways = ways
        self._packed: dict[IOSpec, tuple[torch.Tensor, torch.Tensor, tuple[int, int]]] = {}

    def get(self, spec: IOSpec, bind: Callable[[IOSpec], torch.Tensor]) -> torch.Tensor:
        """The packed copy behind program input `spec`; `bind` gives the source weight."""
        if spec not in self._packed:
            source = bind(IOSpec("param", spec.target))
            self._packed[spec] = (self._pack(spec, source), source, weight_stamp(source))
        return self._packed[spec][0]

    def _pack(self, spec: IOSpec, source: torch.Tensor) -> torch.Tensor:
        if spec.kind == TRANSPOSED_KIND:
            return transposed(source)
        if spec.kind in SPLIT_KINDS:
            return split(out_in(spec, source), self.ways)
        return pack(out_in(spec, source), self.rows)

    def refresh(self) -> list[str]:
        """Pack again every weight written since it was packed (in place: `p.data.copy_`, an
        optimizer step, `load_state_dict`); returns their names. A weight given new storage
        (`p.data = ...`) counts as written too. The bound programs hold the packed tensors, so the
        new values go into them in place."""
        stale = []
        for spec, (packed, source, stamp) in self._packed.items():
            if weight_stamp(source) != stamp:
                packed.copy_(self._pack(spec, source))
                self._packed[spec] = (packed, source, weight_stamp(source))
                stale.append(spec.target)
        return stale

    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p, _, _ in self._packed.values())


def weight_stamp(t: torch.Tensor) -> tuple[int, int, bytes]:
    """What says a weight was written: its version, its storage, and a sample of its bits (above).
    A few thousand elements: microseconds per weight against a generate's milliseconds."""
    return t._version, t.data_ptr(), _sample_bits(t).cpu().numpy().tobytes()


def weight_stamps(ts: Sequence[torch.Tensor]) -> tuple[tuple[tuple[int, int], ...], bytes]:
    """`weight_stamp` of many weights, their samples copied to the host at once (one wait for a
    GPU, not one per weight)."""
    bits = [_sample_bits(t) for t in ts]
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for b in bits:
        by_device.setdefault(b.device, []).append(b)
    host = b"".join(torch.cat(bs).cpu().numpy().tobytes() for bs in by_device.values())
    return tuple((t._version, t.data_ptr()) for t in ts), host


def _sample_bits(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().reshape(-1)
    parts = [flat[::max(1, flat.numel() // 4096)]]
    if t.dim() == 2:
        parts += [t.detach()[:, 0], t.detach()[0, :]]
    return torch.cat([x.reshape(-1) for x in parts]).contiguous().view(torch.uint8).reshape(-1)


def fastest_copies(specs: Sequence[IOSpec], rows: int, bind: Callable[[IOSpec], torch.Tensor], layout_rows: int,
                   ways: int = 1, budget_bytes: int = 96 << 20, repeats: int = 3) -> tuple[str, dict[str, float]]:
    """Which copies make a program of `rows` rows run its linears fastest on this machine: the
    packed ones (oneDNN), the [in, out] ones (ATen's GEMM) or, with `ways` > 1 threads, the split
    ones (`split_linear`); returns (that kind, as Compiler.inference's `copies`, and the seconds
    of one pass each way). The pass runs over the first weights of `specs` (the program's
    "packed_weight"/"packed_weight_t" inputs) up to `budget_bytes`, more than a CPU's caches
    hold, so each streams from memory as a decode step does. Best of `repeats`, alternating.
    Which is faster depends on the CPU, its BLAS and the threads: one 2-core EPYC box measured
    packing 1.3x faster at one row, another 1.2x slower (why:
    docs/decisions/pack-linear-weights-on-cpu.md). `layout_rows`: the rows the serving loop's
    copies are packed for (PackedWeights.rows); the probe's own copies are freed on return."""
    weights, total = [], 0  # each [out, in]
    for spec in specs:
        if total >= budget_bytes:
            break
        src = bind(IOSpec("param", spec.target))
        weights.append(out_in(spec, src))
        total += src.numel() * src.element_size()
    # the unpacked program's product: addmm(b, x, c) over a Conv1D's [in, out], and over the [in, out]
    # copy of an nn.Linear's [out, in] (`transposed`; a Conv1D's is its parameter, not copied)
    gemm = [w.t().contiguous() for w in weights]
    ready = [pack(w, layout_rows) for w in weights]
    sliced = [split(w, ways) for w in weights] if ways > 1 else []
    del weights
    g = torch.Generator().manual_seed(0)  # the user's RNG stays untouched (unseeded sampling draws from it)
    xs = {w.shape[0]: torch.randn(rows, w.shape[0], dtype=w.dtype, generator=g) for w in gemm}

    def run_gemm() -> None:
        for w in gemm:
            torch.mm(xs[w.shape[0]], w)

    def run_packed() -> None:
        for w, p in zip(gemm, ready):
            LINEAR(xs[w.shape[0]], p, None, "none", [], "")

    def run_split() -> None:
        for w, s in zip(gemm, sliced):
            split_linear(xs[w.shape[0]], s, None, w.shape[1])

    runs = {"packed": run_packed, "transposed": run_gemm, **({"split": run_split} if sliced else {})}
    best = dict.fromkeys(runs, float("inf"))
    with torch.no_grad():
        for _ in range(repeats + 1):  # one more round: the first also faults in oneDNN's kernels
            for kind, fn in runs.items():
                t0 = time.perf_counter()
                fn()
                best[kind] = min(best[kind], time.perf_counter() - t0)
    return min(best, key=best.__getitem__), best
