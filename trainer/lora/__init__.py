"""LoRA files and what users do with them: keys.py (the in-memory LoRA and Kiln's three key layouts), adapters.py
(LoKr, LoHa, DoRA), adapter_files.py and sources.py (Kiln's adapter files, every other trainer's layout) under
files.py (read any, write, convert), report.py (inspect), tools.py (merge, resize), extract.py, targets.py."""
