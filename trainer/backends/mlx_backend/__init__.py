"""The MLX backend: training on Apple Silicon (Metal) or, for the tests, mlx[cpu] on Linux.

models/ holds our own MLX ports of the diffusion models (Flux2, Z-Image) with ComfyUI's parameter names.
"""
