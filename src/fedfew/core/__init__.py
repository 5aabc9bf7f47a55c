"""What everything is built from: the model set and its state vectors, local training, aggregation,
the budget, non-finite bookkeeping, checkpoints, run folders, the key table, seeding, the registry and
atomic file writes. The round loop that runs algorithms is one layer up, in :mod:`fedfew.simulator`."""
