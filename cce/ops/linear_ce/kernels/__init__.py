"""Triton kernels of linear cross entropy and their launchers: one file per algorithm (forward,
backward_exact, backward_sparse, fused_grads), the tile statistics, plan, kept tiles, dC rows of
the skipped tiles, dense slabs and gradient stash of the sparse one, the fused path's scaled-fp16
dC sum, the dZ tile (dz) and what all share (common)."""
