"""The demo run (run.py) and its tiny Flux2-shaped DiT (tiny_dit.py, tiny_weights.py), for `./scripts/demo` and the tests."""
