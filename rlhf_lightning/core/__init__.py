"""What every stage shares: the model built in ``configure_model`` with optimizers and checkpoints (stage), the
policy with its reference (policy), the on-policy RL loop (online), and the strategy's device mesh
(distributed)."""
