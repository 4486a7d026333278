"""AEPO algorithm core: pure functions over tensors and dataclasses (no I/O, no orchestration)."""
