"""`python -m trainer ...`: main.py (the parser and commands; the only module that reaches the pack's headless.py),
lora_commands.py (merge, resize, extract, convert), console.py (progress and Ctrl-C), launch.py (a torchrun child)."""
