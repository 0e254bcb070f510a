"""Memory and time estimates of a training step: common.py (shared), torch_step.py (PyTorch), mlx_step.py (MLX)."""

from ..moved import forward

__getattr__ = forward(__name__, "estimate")  # the old trainer/estimate.py's names, one release
