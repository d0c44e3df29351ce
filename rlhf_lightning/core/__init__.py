"""What every stage shares: the model built in ``configure_model`` with optimizers and checkpoints (stage), the policy
with its reference and its sampler (policy), the evaluation of held-out samples with the gold reward per task
(held_out), pass@k and maj@k on held-out prompts (held_out_pass_at_k), what the on-policy loop trains on
(experience), collection (collect), asynchronous training's fixed-lag schedule of rollouts drawn ahead (overlap),
which passes an iteration runs (pass_plan), the on-policy loop (online), how it
splits a rollout into minibatches and micro-batches (micro_batches) and sums up its update's statistics
(update_statistics), its policy-gradient loss (policy_gradient), what DPO and KTO share (offline), the strategy's
device mesh (distributed) and optimizer state that resumes in any layout (optimizer_ids)."""
