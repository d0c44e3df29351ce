"""What every stage shares: the model built in ``configure_model`` with optimizers and checkpoints without frozen
weights (``stage``), the policy adapter with its reference, log-probs and sampler (``policy``), the evaluation of
held-out samples with the gold reward per task (``held_out``), pass@k and maj@k on held-out prompts
(``held_out_pass_at_k``), what the on-policy loop trains on (``experience``: ``Experience``), a
batch of prompts collected into an ``Experience`` (``collect``), which passes an iteration runs, decided once from
the settings (``pass_plan``), the on-policy loop: collect, shape, the algorithm, update, log (``online``), its
update: epochs over minibatches, one optimizer step each, and the statistics it logs (``update``), how it splits a
rollout into minibatches and micro-batches, equal parts or packed by a token budget (``micro_batches``), its policy-gradient loss: the registered policy loss, the KL
penalty, entropy and PPO-ptx (``policy_gradient``), what DPO and KTO share (``offline``), the strategy, its device
mesh and what a stage computes over ranks (``distributed``: ``Ranks``) and optimizer state that resumes in any
layout (``optimizer_ids``)."""
