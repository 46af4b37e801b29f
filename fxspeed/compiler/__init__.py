"""The compiler: capture (the only user of torch's private tracing APIs), annotate, the pass
manager, graph rewrite helpers, and pipelines.py, the one place that decides pass order."""

from .pipelines import CompiledStep, compile_step

__all__ = ["CompiledStep", "compile_step"]
