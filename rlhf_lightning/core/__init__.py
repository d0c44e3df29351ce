"""What every stage shares: the model built in ``configure_model`` with optimizers and checkpoints (stage), the
policy with its reference and its sampler (policy), pass@k and maj@k on held-out prompts (held_out_pass_at_k), what
the on-policy loop trains on (experience), collection (collect), the on-policy loop (online) and how it packs
micro-batches by tokens (micro_batches), its policy-gradient loss (policy_gradient), what DPO and KTO share
(offline), the strategy's device mesh (distributed) and optimizer state that resumes in any layout
(optimizer_ids)."""
