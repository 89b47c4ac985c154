"""Triton kernels of linear cross entropy and their launchers: one file per algorithm (forward,
backward_exact, backward_sparse, fused_grads), the tile statistics and the gradient stash
of the sparse one, the dZ tile (dz) and what all share (common)."""
