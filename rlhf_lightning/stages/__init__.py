"""One module per stage, each a thin named class over ``core/`` with its hooks, its defaults and its paper: PPO
(``ppo``), GRPO (``grpo``), RLOO (``rloo``), REINFORCE++ (``reinforce_pp``), on-policy distillation (``distill``),
online DPO (``online_dpo``), DPO (``dpo``), KTO (``kto``), SFT (``sft``), the Bradley-Terry reward model
(``reward_model``) and the process reward model (``process_reward_model``)."""
