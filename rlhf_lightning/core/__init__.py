"""What every stage shares: base loading and optimizers (stage), the policy with its reference (policy), and
the on-policy RL loop (online)."""
