"""fedfew.core.resources: the current resident size follows an allocation up and down; the peak
only goes up."""
from __future__ import annotations

import sys

import numpy as np
import pytest

from fedfew.core.resources import current_host_mib, peak_host_mib


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmRSS comes from /proc (Linux)")
def test_current_size_follows_a_256_mib_array_and_the_peak_keeps_it():
    before = current_host_mib()
    block = np.ones(256 * 2**20 // 8)  # 256 MiB of float64, every page touched
    held = current_host_mib()
    assert held - before == pytest.approx(256, abs=32)
    del block  # a block this large is its own mapping: freeing it returns the pages
    after = current_host_mib()
    assert held - after == pytest.approx(256, abs=32)
    assert peak_host_mib() >= held - 1  # the peak remembers it (KiB rounding)
