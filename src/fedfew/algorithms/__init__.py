"""Federated algorithms, one module per algorithm; the module name is the config value
(``algorithm=fedfew`` -> ``fedfew.py``). Each registers an :class:`~fedfew.algorithms.base.Algorithm`
subclass with :data:`ALGORITHMS`."""
from fedfew.core.registry import Registry

ALGORITHMS = Registry("algorithm", __name__)
