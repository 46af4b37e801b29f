"""Inference passes: the paged KV cache threaded through a captured forward, logits of the tokens sampled."""
