"""Studies built on the framework, on the embedded task whose true (gold) reward is known.

* ``python -m rlhf_lightning.study.family`` (``family``): every method of the family at several KL strengths over
  seeds of the pipeline: gold per nat of KL and per CPU-second, at matched KL. Its methods (``methods``), its units
  of work and how they run (``family_units``), every method measured alike on held-out prompts (``evaluation``), its
  numbers (``frontier``), results and summary (``family_summary``) and figures (``family_plot``).
* ``python -m rlhf_lightning.study.overoptimisation`` (``overoptimisation``): PPO against the reward model without
  and with a KL penalty, and best-of-n, on one seed (Gao et al. 2022). Its PPO runs (``runs``), numbers
  (``analysis``) and figure (``plot``).
* ``python -m rlhf_lightning.study.spread`` (``spread``): the quick start's pipeline over seeds and thread counts, one
  row per sample: how often the main job learns. Its samples of the pipeline, each stage a subprocess as a user runs
  it (``pipeline_runs``).
* ``python -m rlhf_lightning.study.ensembles`` (``ensembles``): reward-model ensembles against over-optimisation
  (Coste et al. 2023) over seeds of the pipeline: best-of-n by one member, the mean, WCO and UWO, with and without
  label noise, and PPO at a small KL coefficient; its tables and figure (``ensemble_summary``).

The family, over-optimisation and ensemble studies use best-of-n sampling against the proxy (``best_of_n``) and Gao
et al.'s functional forms and fits (``gao``).
"""

from rlhf_lightning.study.best_of_n import best_of_n_curve, best_of_n_expectation, best_of_n_weights
from rlhf_lightning.study.gao import GaoFit, best_of_n_kl, fit_gao, gao_curve

__all__ = ["GaoFit", "best_of_n_curve", "best_of_n_expectation", "best_of_n_kl", "best_of_n_weights",
           "fit_gao", "gao_curve"]
