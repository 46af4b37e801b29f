"""The compiler's IR: node annotations and the step signature (nodes), graph programs and
stage programs (program), schedules of actions (schedule). Shared by compiler and runtime."""

from .nodes import *  # noqa: F401,F403
from .nodes import __all__ as _nodes_all
from .program import Program, StageProgram, TensorMeta

__all__ = [*_nodes_all, "Program", "StageProgram", "TensorMeta"]
