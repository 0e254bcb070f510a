"""A run: loop.py (the one story), callbacks.py (a front end's one object), steplog.py (step figures, reports),
state.py (resumable checkpoints: listed, read, restored), checkpoint_writer.py, folders.py (run folder names),
faults.py (the loop's guard), pause.py, distributed.py (torchrun), holdout.py (held-out loss, early stop),
init_lora.py, sinks.py (TensorBoard, W&B), plot.py."""
