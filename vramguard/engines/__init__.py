"""Other serving engines' own memory models: what a model needs when it is served by that engine instead of by
transformers in one process (:mod:`vramguard.engines.vllm`: vLLM's V1 engine)."""
