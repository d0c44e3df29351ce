"""What every stage shares: the model built in ``configure_model`` with optimizers and checkpoints (stage), optimizer
state every layout resumes (optimizer_ids), the policy with its reference and its sampler (policy), what the on-policy
loop trains on (experience), collection (collect), the on-policy loop (online) and how it packs micro-batches by tokens
(micro_batches), its policy-gradient loss (policy_gradient), pass@k on held-out prompts (held_out_pass_at_k), what DPO
and KTO share (offline), and the strategy, its device mesh and what is computed over ranks (distributed)."""
