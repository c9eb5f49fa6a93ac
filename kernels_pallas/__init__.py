"""Pallas GPU kernels for grouped expert matmuls. Independent of `moejax`."""
