"""The memory model: pure functions ``(ModelSpec, Settings) -> int bytes``, one module per component."""
