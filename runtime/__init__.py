"""The runtime: small and dumb. It executes programs the compiler emitted; it never imports passes."""

from .executor import StepExecutor
from .optimizer import OptimizerSpec, build_optimizer
from .program import Program

__all__ = ["OptimizerSpec", "Program", "StepExecutor", "build_optimizer"]
