"""Memory facts taken from transformers itself (needs torch and transformers): the module tree on the meta device,
the quantizer's rules, and a replay of the forward that tracks every storage. The hand-written family models in
:mod:`vramguard.memory` are the fast path that needs no torch; this package plans any causal LM.
"""
