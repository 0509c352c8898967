"""Compute kernels that are heron's own, by device."""
