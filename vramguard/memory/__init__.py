"""The planner's core, pure (no torch, no transformers, nothing of vramguard above it): the
:class:`~vramguard.memory.model.MemoryModel` interface and the hand-written families' model behind it (``weights``,
``kv``, ``forward``: functions ``(ModelSpec, Settings) -> int bytes``), the reserve formula (``runtime``) and the
caching-allocator model (``allocator``, ``decode_steps``)."""
