"""Program passes: they turn one graph into a multi-program distributed program (stages, I/W
split) and rewrite stage programs (gradient accumulation into buffers)."""
