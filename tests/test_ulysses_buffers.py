"""The Ulysses all-to-all's buffers, without a process group: each rank's send buffers are
built, the all-to-all is done by hand (rank r receives chunk r of every rank's send buffer)
and the received tensors must be exactly the head shard of the whole sequence, in either
storage order (``head_major``, the CPU kernel's preference) and with the ring reorder."""

from __future__ import annotations

import pytest
import torch

from ring_sp.kernels.torch_cpu import TorchCPUKernel, _bhsd
from ring_sp.layouts import ulysses_to_ring_order, ulysses_to_ring_reorder
from ring_sp.ulysses import head_from_recv, kv_grads_send_buffer, pack_kv, unpack_kv


def _all_to_all(sends: list[torch.Tensor]) -> list[torch.Tensor]:
    """recv[r][s] = sends[s][r] (chunks along dim 0), as ``dist.all_to_all_single`` would."""
    return [torch.stack([send[r] for send in sends]) for r in range(len(sends))]


def _head_shard(x: torch.Tensor, rank: int, u: int) -> torch.Tensor:
    """Rank ``rank``'s H/U heads of the whole ``[b, N, H, d]``."""
    per_rank = x.shape[2] // u
    return x[:, :, rank * per_rank:(rank + 1) * per_rank]


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("head_major", [False, True])
@pytest.mark.parametrize("reordered", [False, True])
def test_received_kv_is_the_head_shard_in_either_storage_order(batch: int, head_major: bool, reordered: bool) -> None:
    """k ``[b, N, 4, 8]`` and v with another head size (MLA) over U = 2 ranks, 8 tokens each:
    after pack_kv, the all-to-all, unpack_kv and head_from_recv, every rank holds its k/v heads
    of all N tokens (in the ring order of a U2xR2 zigzag grid when reordered), stored
    ``[b, h, N, d]`` when head_major."""
    u, n = 2, 8
    k, v = torch.randn(batch, u * n, 4, 8), torch.randn(batch, u * n, 4, 6)
    sends = [pack_kv(k[:, r * n:(r + 1) * n], v[:, r * n:(r + 1) * n], u) for r in range(u)]
    order = ulysses_to_ring_reorder("zigzag", u, 2, 2 * u * n, 0, torch.device("cpu")) if reordered else None
    index = ulysses_to_ring_order("zigzag", u, 2, 2 * u * n, 0) if reordered else torch.arange(u * n)
    for rank, recv in enumerate(_all_to_all(sends)):
        k_recv, v_recv = unpack_kv(recv, 2, 8)
        got_k, got_v = head_from_recv(k_recv, order, head_major), head_from_recv(v_recv, order, head_major)
        assert torch.equal(got_k, _head_shard(k, rank, u)[:, index])
        assert torch.equal(got_v, _head_shard(v, rank, u)[:, index])
        if head_major:
            assert got_k.transpose(1, 2).is_contiguous() and got_v.transpose(1, 2).is_contiguous()


@pytest.mark.parametrize("head_major", [False, True])
def test_received_q_is_the_head_shard_in_either_storage_order(head_major: bool) -> None:
    """q ``[1, N, 8, 4]`` over U = 4 ranks, sent as seq_to_head does."""
    u, n = 4, 3
    q = torch.randn(1, u * n, 8, 4)
    sends = [q[:, r * n:(r + 1) * n].reshape(1, n, u, 2, 4).permute(2, 0, 1, 3, 4).contiguous() for r in range(u)]
    for rank, recv in enumerate(_all_to_all(sends)):
        got = head_from_recv(recv, None, head_major)
        assert torch.equal(got, _head_shard(q, rank, u))
        assert got.transpose(1, 2).is_contiguous() == head_major
        assert (got.data_ptr() == recv.data_ptr()) == (not head_major)  # b == 1: a view, else one copy


def test_kv_grads_send_buffer_is_the_same_for_head_major_gradients() -> None:
    """dk/dv as the CPU kernel returns them (views of [b, h, s, d]) fill the same send buffer
    as contiguous ones, also through the reorder."""
    u = 2
    order = ulysses_to_ring_reorder("zigzag", u, 2, 32, 1, torch.device("cpu"))
    dk, dv = torch.randn(1, 16, 2, 8), torch.randn(1, 16, 2, 6)
    head_major = [x.transpose(1, 2).contiguous().transpose(1, 2) for x in (dk, dv)]
    for reorder in (None, order):
        expected = kv_grads_send_buffer(dk, dv, u, reorder, torch.float32)
        assert torch.equal(kv_grads_send_buffer(*head_major, u, reorder, torch.float32), expected)


def test_cpu_kernel_takes_head_major_inputs_without_a_copy() -> None:
    """_bhsd hands a head-major tensor (and its row blocks) to the op as it is, copies
    sequence-major ones head-major for the forward, and casts bf16 in one head-major copy;
    the kernel's results do not depend on the storage order."""
    seq_major = torch.randn(1, 16, 4, 8)
    head_major = seq_major.transpose(1, 2).contiguous().transpose(1, 2)
    assert _bhsd(head_major, dense_heads=True).data_ptr() == head_major.data_ptr()
    assert _bhsd(head_major[:, 4:12], dense_heads=True).data_ptr() == head_major[:, 4:12].data_ptr()
    assert _bhsd(seq_major, dense_heads=True).is_contiguous()
    assert _bhsd(seq_major).data_ptr() == seq_major.data_ptr()  # the backward: a view
    assert _bhsd(seq_major.bfloat16()).is_contiguous()
    kernel = TorchCPUKernel()
    k, v = torch.randn(1, 16, 2, 8), torch.randn(1, 16, 2, 8)
    out_s, lse_s = kernel.forward(seq_major, k, v, causal=True, scale=0.3)
    out_h, lse_h = kernel.forward(head_major, k, v, causal=True, scale=0.3)
    assert torch.equal(out_s, out_h) and torch.equal(lse_s, lse_h)
    dout = torch.randn_like(out_s)
    grads_s = kernel.backward(dout, seq_major, k, v, out_s, lse_s, causal=True, scale=0.3)
    grads_h = kernel.backward(dout, head_major, k, v, out_h, lse_h, causal=True, scale=0.3)
    for a, b in zip(grads_s, grads_h):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
