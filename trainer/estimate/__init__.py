"""Memory and time estimates of a training step: common.py (shared), torch_step.py (PyTorch), mlx_step.py (MLX)."""
