"""FedFew with every setting of the reference code pgg3/FedFew (``algorithm=fedfew_reference``).

The same algorithm as :mod:`fedfew.algorithms.fedfew`; only its config differs
(``conf/algorithm/fedfew_reference.yaml``): the unnormalised server step
theta_k += sum_i alpha_i w_ik d_ik (``normalize=false``), losses weighted by p_i = n_i / sum_j n_j
(``mu_scale=reference``) with mu = 0.01, K = 3 and identical initial models. Kept as its own
config value so that comparisons can show the reference's rule beside our default by name.
"""
from __future__ import annotations

from fedfew.algorithms import ALGORITHMS
from fedfew.algorithms.fedfew import FedFew


@ALGORITHMS.register("fedfew_reference")
class FedFewReference(FedFew):
    """FedFew under the reference code's settings (see module docstring)."""
