"""Dataset loaders, one module per dataset; the module name is the config value
(``dataset=agnews`` -> ``agnews.py``). Each registers a function
``load(cfg, data_dir) -> PooledDataset`` with :data:`DATASETS`."""
from fedfew.core.registry import Registry

DATASETS = Registry("dataset", __name__)
