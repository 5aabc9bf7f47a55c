"""fedfew as a Flower app (flwr >= 1.42, Message API): the simulator's algorithms, unchanged, with
the client step run by Flower ClientApps (docs/flower.md).

- :mod:`fedfew.flower.client`: the ClientApp (``query`` / ``train`` / ``evaluate``), one client per node;
- :mod:`fedfew.flower.server`: :class:`~fedfew.flower.server.FlowerSimulation`, the round loop over
  messages, the node bookkeeping and fault handling, the algorithms it refuses;
- :mod:`fedfew.flower.serve`: the ServerApp (``serve``: connect, train, write the run folder);
- :mod:`fedfew.flower.partitions`: each client's data directory;
- :mod:`fedfew.flower.records`: the payloads as ArrayRecord / ConfigRecord / MetricRecord;
- ``python -m fedfew.flower [hydra overrides]`` (``make flower``): Flower's simulation engine;
- ``python -m fedfew.flower.deploy``: ``flwr run`` against a SuperLink with SuperNodes.
"""
