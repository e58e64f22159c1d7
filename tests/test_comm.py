"""C14: exactly the designed collectives, and the bytes of DESIGN.md section 5."""

from __future__ import annotations

import contextlib
from collections import Counter

import pytest
import torch
import torch.distributed as dist

import ring_sp
from ring_sp.plan import layer_bytes  # DESIGN section 5 as implemented; test_plan checks it by hand

# isend/irecv are not wrapped: P2POp checks them by identity (batch_isend_irecv counts them)
_COLLECTIVES = ("batch_isend_irecv", "send", "recv", "all_to_all_single", "all_to_all",
                "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast", "barrier",
                "all_gather_single", "reduce_scatter_single")


@contextlib.contextmanager
def _count_torch_collectives():
    """Count every torch.distributed collective called, whoever calls it."""
    counts: Counter[str] = Counter()
    originals = {name: getattr(dist, name) for name in _COLLECTIVES if hasattr(dist, name)}

    def wrap(name, fn):
        def counted(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return counted

    for name, fn in originals.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def measure(u: int, r: int, b: int, n: int, h: int, h_kv: int, d: int, dtype: str, d_v: int | None = None) -> dict:
    topo = ring_sp.init_sequence_parallel(u, r)
    dt = getattr(torch, dtype)
    q = torch.randn(b, n, h, d, dtype=dt, requires_grad=True)
    k = torch.randn(b, n, h_kv, d, dtype=dt, requires_grad=True)
    v = torch.randn(b, n, h_kv, d if d_v is None else d_v, dtype=dt, requires_grad=True)
    with _count_torch_collectives() as first_calls:  # the first call of a shape agrees on it
        ring_sp.hybrid_attention(q, k, v, topology=topo, causal=True)
    with _count_torch_collectives() as fwd_calls, ring_sp.count_communication() as fwd:
        out = ring_sp.hybrid_attention(q, k, v, topology=topo, causal=True)
    with _count_torch_collectives() as bwd_calls, ring_sp.count_communication() as bwd:
        out.backward(torch.randn_like(out))
    return {"fwd": fwd.bytes_sent, "bwd": bwd.bytes_sent, "fwd_calls": dict(fwd_calls), "bwd_calls": dict(bwd_calls),
            "first_calls": dict(first_calls)}


@pytest.mark.parametrize("u,r,h,h_kv,dtype,d_v", [
    (1, 4, 8, 2, "bfloat16", None), (4, 1, 8, 2, "bfloat16", None), (2, 2, 8, 2, "bfloat16", None),
    (2, 2, 8, 1, "float32", None), (4, 1, 4, 4, "float32", None),
    (2, 2, 8, 2, "bfloat16", 8), (2, 2, 8, 1, "float32", 24),  # MLA: one packed message, d + d_v wide
])
def test_bytes_and_calls_match_the_design(pools, u: int, r: int, h: int, h_kv: int, dtype: str, d_v: int | None) -> None:
    b, n, d = 2, 8, 16
    results = pools.get(4).run(measure, u, r, b, n, h, h_kv, d, dtype, d_v)
    for rank, res in enumerate(results):  # ring rank rank // U (Ulysses-inner placement)
        fwd, bwd = layer_bytes(ulysses=u, ring=r, batch=b, local_len=n, heads=h, kv_heads=h_kv, head_dim=d,
                               dtype="bf16" if dtype == "bfloat16" else "fp32", value_head_dim=d_v, ring_rank=rank // u)
        assert res["fwd"] == fwd and res["bwd"] == bwd
        # nothing but the designed collectives: R-1 (fwd) / 2R-1 (bwd) exchanges, 3 all-to-alls each way,
        # and in every forward one small all_gather (the agreement, on by default: issue 31)
        ring_fwd, ring_bwd = (r - 1, 2 * r - 1) if r > 1 else (0, 0)
        a2a = 3 if u > 1 else 0
        assert res["fwd_calls"] == {k: v for k, v in {"batch_isend_irecv": ring_fwd, "all_to_all_single": a2a,
                                                      "all_gather": 1}.items() if v}
        assert res["bwd_calls"] == {k: v for k, v in {"batch_isend_irecv": ring_bwd, "all_to_all_single": a2a}.items() if v}
        assert res["first_calls"] == res["fwd_calls"]  # no more on a new shape than on any call
