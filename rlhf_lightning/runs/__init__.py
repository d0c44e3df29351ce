"""A run's bookkeeping on disk: its folder and what may go into it (``run_folder``), the rules of resuming
(``resume``), the offline W&B history reader (``wandb_offline``) and PNG curves of a run folder (``plots``)."""
