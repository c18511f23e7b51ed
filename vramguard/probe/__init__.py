"""Facts read from this machine and from the files, not planned: the environment (:mod:`~vramguard.probe.env`),
the checkpoint on disk (:mod:`~vramguard.probe.checkpoint`) and the attention kernel a forward really runs
(:mod:`~vramguard.probe.kernels`)."""
