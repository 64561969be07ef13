"""Training: optimizers, sharding, the train step and the loop."""
