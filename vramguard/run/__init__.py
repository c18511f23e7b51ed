"""``run``: generation that plans before it starts and recovers from out-of-memory errors.

Parts: :mod:`~vramguard.run.generate` (the guarded ``generate`` and its strategies),
:mod:`~vramguard.run.fastdecode` (batch-1 decode replaying one CUDA graph per token),
:mod:`~vramguard.run.prompt` (the user's prompt as token ids, the context check) and
:mod:`~vramguard.run.context` (long prompts: retrieval or summaries within the token budget).
"""
