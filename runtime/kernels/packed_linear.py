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

`PackedWeights` holds the packed copies of one serving loop: one per weight (shared by every
bucket), made on first use, and made again when the source weight changed in place since
(`refresh`, called at every generate), so a packed copy never goes stale silently.
"""

from __future__ import annotations

from typing import Callable

import torch

from fxspeed.ir import IOSpec

# A packed weight as a program input: the Parameter (or its tp slice) named by the target, as
# [out, in] ("packed_weight": nn.Linear's layout) or transposed ("packed_weight_t": a Conv1D
# weight [in, out], GPT-2's).
PACKED_KINDS = ("packed_weight", "packed_weight_t")
LINEAR = torch.ops.mkldnn._linear_pointwise.default


def available() -> bool:
    """oneDNN is built in and enabled (it is in every x86 CPU build of torch)."""
    return torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled


def pack(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """`weight` [out, in] (any strides) reordered for oneDNN's linear at about `rows` rows."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows)


class PackedWeights:
    """The packed copies a serving loop's programs read (see the module docstring). `rows`: the
    row count the layout is chosen for (the decode bucket)."""

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self._packed: dict[IOSpec, tuple[torch.Tensor, torch.Tensor, tuple[int, int]]] = {}

    def get(self, spec: IOSpec, bind: Callable[[IOSpec], torch.Tensor]) -> torch.Tensor:
        """The packed copy behind program input `spec`; `bind` gives the source weight."""
        if spec not in self._packed:
            source = bind(IOSpec("param", spec.target))
            self._packed[spec] = (self._pack(spec, source), source, _stamp(source))
        return self._packed[spec][0]

    def _pack(self, spec: IOSpec, source: torch.Tensor) -> torch.Tensor:
        return pack(source.t() if spec.kind == "packed_weight_t" else source, self.rows)

    def refresh(self) -> list[str]:
        """Pack again every weight written since it was packed (in place: `p.data.copy_`, an
        optimizer step, `load_state_dict`); returns their names. A weight given new storage
        (`p.data = ...`) counts as written too. The bound programs hold the packed tensors, so the
        new values go into them in place."""
        stale = []
        for spec, (packed, source, stamp) in self._packed.items():
            if _stamp(source) != stamp:
                packed.copy_(self._pack(spec, source))
                self._packed[spec] = (packed, source, _stamp(source))
                stale.append(spec.target)
        return stale

    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p, _, _ in self._packed.values())


def _stamp(t: torch.Tensor) -> tuple[int, int]:
    return t._version, t.data_ptr()
