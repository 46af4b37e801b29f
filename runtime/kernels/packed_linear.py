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
faster for each small bucket before it compiles it (`packing_pays`).

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
# every kind of copy `PackedWeights` holds
COPY_KINDS = (*PACKED_KINDS, TRANSPOSED_KIND)
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


def out_in(spec: IOSpec, source: torch.Tensor) -> torch.Tensor:
    """The weight behind packed input `spec` as [out, in] (a view): a Conv1D's [in, out] transposed."""
    return source.t() if spec.kind == "packed_weight_t" else source


class PackedWeights:
    """The packed copies a serving loop's programs read (see the module docstring), and the
    [in, out] copies of [out, in] weights that small buckets running ATen's GEMM read
    (`transposed`). `rows`: the row count the packed layout is chosen for (the decode bucket)."""

    def __init__(self, rows: int) -> None:
        self.rows = rows
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


def packing_pays(specs: Sequence[IOSpec], rows: int, bind: Callable[[IOSpec], torch.Tensor], layout_rows: int,
                 budget_bytes: int = 96 << 20, repeats: int = 3) -> tuple[bool, float, float]:
    """Whether a program of `rows` rows runs its linears faster over the packed weights than
    through ATen's GEMM on this machine: (packs, packed seconds, GEMM seconds) of one pass over
    the first weights of `specs` (the program's "packed_weight"/"packed_weight_t" inputs) up to
    `budget_bytes`, more than a CPU's caches hold, so both stream from memory as a decode step
    does. Best of `repeats`, alternating. Which is faster depends on the CPU and its BLAS: one
    2-core EPYC box measured packing 1.3x faster at one row, another 1.2x slower (why:
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
    g = torch.Generator().manual_seed(0)  # the user's RNG stays untouched (unseeded sampling draws from it)
    xs = {w.shape[0]: torch.randn(rows, w.shape[0], dtype=w.dtype, generator=g) for w in gemm}

    def run_gemm() -> None:
        for w in gemm:
            torch.mm(xs[w.shape[0]], w)

    def run_packed() -> None:
        for w, p in zip(gemm, ready):
            LINEAR(xs[w.shape[0]], p, None, "none", [], "")

    best = {run_gemm: float("inf"), run_packed: float("inf")}
    with torch.no_grad():
        for _ in range(repeats + 1):  # one more round: the first also faults in oneDNN's kernels
            for fn in best:
                t0 = time.perf_counter()
                fn()
                best[fn] = min(best[fn], time.perf_counter() - t0)
    return best[run_packed] < best[run_gemm], best[run_packed], best[run_gemm]
