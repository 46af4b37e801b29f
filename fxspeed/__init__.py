"""fxspeed: distributed training as a torch.fx compiler.

    engine = fxspeed.compile(model, devices=1, config=fxspeed.Config(lr=3e-4), example_inputs=(batch,))
    loss = engine.train_step(batch)
    print(engine.plan.summary())

    engine = fxspeed.serve(model)                       # inference: paged KV cache, continuous batching
    outs = engine.generate([[1, 2, 3], [4, 5]], max_new_tokens=16)
"""

from .api import compile, plan, serve  # noqa: A004
from .compiler.capture import extract_loss
from .config import Config
from .devices import PRESETS, DeviceSpec, devices, measured_cpu
from .runtime.deferred_init import materialize, parameters_on_meta
from .runtime.engine import Engine
from .errors import CaptureError, ConfigError, FxspeedError, PassError
from .planner.plan import Plan
from .runtime.serving import GenerationError, RequestError

__version__ = "0.1.0"
__all__ = ["CaptureError", "Config", "ConfigError", "DeviceSpec", "Engine", "FxspeedError", "GenerationError",
           "PRESETS", "PassError", "Plan", "RequestError", "compile", "devices", "extract_loss", "materialize",
           "measured_cpu", "parameters_on_meta", "plan", "serve"]
