"""Named, independent random streams derived from one seed.

``derive_seed(seed, "partition")`` and ``derive_seed(seed, "init", k)`` are unrelated
streams, so changing how the model is initialised never changes the partition, and the
shuffling of client i in round t does not depend on which rank trains it.
"""
from __future__ import annotations

import hashlib


def derive_seed(seed: int, *names: object) -> int:
    """A 63-bit seed from a base seed and a path of names (stable across processes/runs).

    Args:
        seed: base seed (the config's ``seed``).
        names: stream path, e.g. ``("local", round, client, k)``.
    Returns:
        int in [0, 2**63).
    """
    key = "/".join([str(int(seed)), *map(str, names)]).encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "little") >> 1
