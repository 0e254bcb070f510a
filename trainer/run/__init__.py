"""A run: loop.py (the one story), state.py (resumable checkpoints), folders.py (run folder names), faults.py,
pause.py, distributed.py (torchrun), holdout.py (held-out loss, early stop), init_lora.py, sinks.py (TensorBoard,
W&B), plot.py."""
