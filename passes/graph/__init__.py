"""Single-device graph rewrites: normalization, tied weights, casts, loss scaling, DCE."""
