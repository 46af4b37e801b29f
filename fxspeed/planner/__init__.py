"""The planner: cost model, liveness memory, the schedule simulator and generators, symbolic
fits, and the Plan. It reads compiled programs; it never rewrites them."""

from .estimate import *  # noqa: F401,F403
from .estimate import __all__ as _estimate_all
from .plan import Plan

__all__ = [*_estimate_all, "Plan"]
