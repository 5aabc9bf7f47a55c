"""The simulator: the round loop (:mod:`.simulation`) and evaluation, above the algorithms it runs.

``core`` holds what algorithms are built from (the model set, local training, aggregation,
seeding); the loop that hands algorithms their cohorts and scores their models sits one layer up,
so that no module of ``core`` imports an algorithm."""
