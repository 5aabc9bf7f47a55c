"""FedFew's own maths: the STCH-Set scalarization, mu schedules and K = auto (no Fabric, no config)."""
