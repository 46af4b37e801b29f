"""Kernels the compiled programs call (call_function targets): CPU/torch implementations here,
Triton ones where a GPU is present."""

from .accumulate import accumulate_rows_

__all__ = ["accumulate_rows_"]
