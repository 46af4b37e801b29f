"""Reference models used by the demo, tests and benchmarks (plain nn.Module code)."""

from .gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
