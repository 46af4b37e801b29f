"""Memory rewrites: buffer reuse (later: recompute, offload)."""
