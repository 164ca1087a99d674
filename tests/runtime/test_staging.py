"""Checkpoint copies through bounded pinned staging (megatrain/runtime/staging.py) and their price (megatrain/planner/transfers.py)."""

import pytest
import torch

from megatrain.ir.program import STAGING_BYTES
from megatrain.planner import hardware_preset
from megatrain.planner.transfers import copy_seconds, staging_bytes
from megatrain.runtime.staging import Staging
from megatrain.runtime.stream_device import SimDevice


@pytest.mark.parametrize("numel", [1, 1000, 4096, 4097, 10_000])
def test_staged_copies_round_trip_through_two_small_buffers(numel):
    with SimDevice() as dev:
        st = Staging(dev, chunk=1024)  # bytes: a 10,000-element fp32 tensor crosses in 40 chunks
        src = torch.randn(numel)
        host, back = torch.empty(numel), torch.empty(numel)
        st.to_host(host, src)
        st.to_device(back, host)
        assert torch.equal(host, src) and torch.equal(back, src)
        assert st.pinned_bytes() == 2 * 2 * 1024  # two buffers per copy stream, whatever the size
    with pytest.raises(ValueError, match="contiguous"):
        Staging(SimDevice(), 64).to_host(torch.empty(4, 4), torch.randn(4, 4).t())


def test_copy_price_is_the_link_time_plus_the_pipeline_fill():
    hw = hardware_preset("h200")
    chunk = STAGING_BYTES
    small = copy_seconds(chunk, hw.d2h_bytes_per_s, hw)
    assert small == pytest.approx(chunk / hw.d2h_bytes_per_s + hw.copy_latency_s)
    carry = 8 * 2**30  # one 1M-token carry of a d=4096 model in bf16: 32 chunks
    big = copy_seconds(carry, hw.d2h_bytes_per_s, hw)
    link = carry / hw.d2h_bytes_per_s
    memcpy = chunk / (hw.host_memory_bytes_per_s / 2)
    assert big == pytest.approx(link + memcpy + 32 * hw.copy_latency_s)  # link-bound: the memcpy only fills
    assert staging_bytes(carry) == 4 * chunk and staging_bytes(chunk) == 0
