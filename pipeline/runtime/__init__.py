"""Running a rank's actions: stage runtime, micro-batches, recomputation, weights, loss weights."""
