"""The runtime: loading a model (:mod:`~vramguard.runtime.load`) and reading the device's memory
(:mod:`~vramguard.runtime.device`)."""
