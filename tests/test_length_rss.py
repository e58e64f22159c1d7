"""The peak-RSS view of the long-sequence step (issue 30): the meter, and ring_sp's defaults against ALST.

The meter (``benchmarks.length_rss.PeakRssGrowth``) must see a buffer made and freed inside its
block and not one freed before it (the negative control). The side-by-side point (``-m slow``,
~35 s) is the issue's measured table at N=8,192: ring_sp's defaults at most ALST's peak, losses equal.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from benchmarks.length_rss import ALST_RSS, DEFAULTS, PeakRssGrowth, return_freed_buffers, rss_point


def test_peak_rss_growth_sees_a_buffer_freed_inside_the_block_and_not_one_freed_before() -> None:
    return_freed_buffers()
    before = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    del before  # unmapped at once (mmap threshold 64 KiB): not in the next block's peak
    with PeakRssGrowth() as quiet:
        pass
    with PeakRssGrowth() as busy:
        buffer = torch.ones(64 * 2**20 // 4)
        del buffer
    assert quiet.bytes < 8 * 2**20, quiet.bytes
    assert 60 * 2**20 <= busy.bytes < 80 * 2**20, busy.bytes


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
def test_ring_sp_defaults_peak_no_more_than_alst_at_8k() -> None:
    ours, alst = rss_point(DEFAULTS, 8192), rss_point(ALST_RSS, 8192)
    assert abs(ours["loss"] - alst["loss"]) <= 1e-5 * abs(alst["loss"])
    assert ours["rss_growth_bytes"] <= alst["rss_growth_bytes"], (ours, alst)
