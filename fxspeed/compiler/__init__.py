"""The compiler: capture (the only user of torch's private tracing APIs), annotate, the pass
manager (graph and program passes), the typed pass options (options.py: PassOptions,
derive_options), graph rewrite helpers, and pipelines.py, the one place that decides pass order."""

from .options import PassOptions, derive_options
from .pipelines import CompiledProgram, CompiledStep, Compiler, compile_program, compile_step

__all__ = ["CompiledProgram", "CompiledStep", "Compiler", "PassOptions", "compile_program", "compile_step",
           "derive_options"]
