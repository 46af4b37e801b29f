"""The runtime: small and dumb. It executes programs the compiler emitted; it never imports passes."""

from .executor import StepExecutor, StepOutputs
from .flat_parameters import FlatParameters
from .loss_scale import DynamicLossScaler
from .optimizer import OptimizerSpec, build_optimizer
from fxspeed.ir.program import Program

__all__ = ["DynamicLossScaler", "FlatParameters", "OptimizerSpec", "Program", "StepExecutor", "StepOutputs", "build_optimizer"]
