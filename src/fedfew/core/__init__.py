"""The simulator's core: the round loop, the model set, local training, aggregation, evaluation, budget, checkpoints, seeding, the registry and atomic file writes."""
