"""Context-parallel baselines for the distributed benchmark, each on our own per-rank FFA so
that only the parallel strategy differs from magi-jax: ring attention (:mod:`.ring`),
all-gather CP (:mod:`.allgather`) and Ulysses (:mod:`.ulysses`); shared layout and planning
in :mod:`.common`."""
