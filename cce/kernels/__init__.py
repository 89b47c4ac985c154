"""Triton kernels and their launchers (checks, allocation, grid, strides; no autograd)."""
