"""Studies built on the framework: reward-model over-optimisation on the embedded task (Gao et al. 2022).

Run ``python -m rlhf_lightning.study.overoptimisation --help``.
"""

from rlhf_lightning.study.best_of_n import best_of_n_curve, best_of_n_expectation, best_of_n_weights
from rlhf_lightning.study.gao import GaoFit, best_of_n_kl, fit_gao, gao_curve

__all__ = ["GaoFit", "best_of_n_curve", "best_of_n_expectation", "best_of_n_kl", "best_of_n_weights",
           "fit_gao", "gao_curve"]
