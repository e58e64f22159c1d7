"""A ring of ``P`` ranks run one rank after another on one device, through ring_sp's own loops.

Every rank runs :func:`ring_sp.ring.ring_forward` and :func:`ring_sp.ring.ring_backward`
themselves (their blocks, merges and accumulators), with a :class:`Loopback` in place of
:class:`ring_sp.comm.RingComm`: no communication and no overlap to hide, only the bytes a
receive would write. That is the compute a schedule costs plus the loops' own overhead,
which :mod:`.efficiency` sets against one fused kernel.

* ``ring_kv`` (KV, forward and backward): step ``t``'s receive gets the rows of rank
  ``r - t``'s shard the step reads (one copy, as the receive writes them);
* ``ring_dkv`` (dK/dV partials, backward): the receive is zeroed (the bytes it would
  write). With :meth:`Loopback.collect` on, each partial sent is also added into a
  :class:`GradStore` at its owner's rows, so that every rank's gradients are exact once all
  ranks ran: ``dk = returned + store`` (:func:`ring_grads`). The two routes of
  :mod:`ring_sp.ring.grad_exchange`: the relayed accumulator (offset ``+1``; its ``i``-th
  send holds this rank's blocks of shard ``r - i``, since what it received was zero) and the
  partials sent straight home along the KV's rows (offset ``-t``: rows ``recv_rows[t]`` of shard ``r - t``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ring_sp.comm import PendingExchange
from ring_sp.kernels import AttentionKernel, softmax_stat_dtype
from ring_sp.ring import RingSpec, ring_backward, ring_forward
from ring_sp.ring.rows import MessageRows


class GradStore:
    """dK/dV partials per ring rank's shard, ``[b, n, h_kv, d]`` each, in the ring's accumulator
    dtype (fp32; fp64 for fp64), filled by the loopbacks."""

    def __init__(self, ks: Sequence[torch.Tensor], vs: Sequence[torch.Tensor]) -> None:
        self.dtype = softmax_stat_dtype(ks[0].dtype)
        self.dk = [torch.zeros(k.shape, dtype=self.dtype, device=k.device) for k in ks]
        self.dv = [torch.zeros(v.shape, dtype=self.dtype, device=v.device) for v in vs]

    def add(self, owner: int, rows: MessageRows | None, packed: torch.Tensor) -> None:
        """Add one packed ``[dk; dv]`` message (any dtype) at ``rows`` of ``owner``'s shard (None: all of it)."""
        b, n, h, d = self.dk[owner].shape
        d_v = self.dv[owner].shape[3]
        count = packed.numel() // (b * h * (d + d_v))
        rows = rows or MessageRows(((0, n),), n)
        split = b * count * h * d
        dtype = self.dk[owner].dtype
        rows.add_to(self.dk[owner], packed[:split].view(b, count, h, d).to(dtype))
        rows.add_to(self.dv[owner], packed[split:split + b * count * h * d_v].view(b, count, h, d_v).to(dtype))


class Loopback:
    """Stands in for :class:`ring_sp.comm.RingComm` for ring rank ``rank`` (module docstring)."""

    def __init__(self, rank: int, ks: Sequence[torch.Tensor], vs: Sequence[torch.Tensor]) -> None:
        self.rank, self.world_size, self.ks, self.vs = rank, len(ks), ks, vs
        self.recv_rows: tuple = ()  # the spec's, set once it is built
        self.store: GradStore | None = None
        self.relayed = 0  # relayed dK/dV sends so far in this backward

    def collect(self, store: GradStore | None) -> None:
        """Add the dK/dV partials this rank sends into ``store`` (None: only zero the receives)."""
        self.store, self.relayed = store, 0

    def exchange(self, send: torch.Tensor | None, recv: torch.Tensor | None, kind: str = "ring_kv",
                 offset: int = 1) -> PendingExchange:
        """The neighbour exchange (the relayed dK/dV accumulator: its i-th send carries shard r - i, whole)."""
        if kind != "ring_dkv" or offset != 1:
            raise ValueError(f"the loopback's neighbour exchange is the relayed 'ring_dkv'; got {kind!r}, offset {offset}")
        if recv is not None:
            recv.zero_()
        if send is not None and self.store is not None:
            self.store.add((self.rank - self.relayed) % self.world_size, None, send)
            self.relayed += 1
        return PendingExchange([])

    def exchange_with(self, send: torch.Tensor | None, to: int, recv: torch.Tensor | None, source: int,
                      kind: str = "ring_kv") -> PendingExchange:
        """A flat ring's message: the KV of ``source`` (step ``r - source``), or a partial straight home to ``to``
        (rows ``recv_rows[r - to]`` of its shard)."""
        if kind == "ring_kv":
            if recv is not None:
                rows = self.recv_rows[(self.rank - source) % self.world_size]
                k, v = self.ks[source], self.vs[source]
                size = k.shape[0] * rows.count * k.shape[2] * k.shape[3]
                rows.gather(k, recv[:size].view(k.shape[0], rows.count, *k.shape[2:]))
                rows.gather(v, recv[size:].view(v.shape[0], rows.count, *v.shape[2:]))
        elif kind == "ring_dkv":
            if recv is not None:
                recv.zero_()
            if send is not None and self.store is not None:
                self.store.add(to, self.recv_rows[(self.rank - to) % self.world_size], send)
        else:
            raise ValueError(f"the loopback stands in for the ring's 'ring_kv' and 'ring_dkv' exchanges; got {kind!r}")
        return PendingExchange([])


def rank_specs(kernel: AttentionKernel, scale: float, layout: str, local_len: int, cu_seqlens: tuple[int, ...] | None,
               window: int | None, ks: Sequence[torch.Tensor], vs: Sequence[torch.Tensor]) -> list[RingSpec]:
    """Every ring rank's :class:`RingSpec` over a :class:`Loopback` (its schedule, built here, outside the timings)."""
    specs = []
    for rank in range(len(ks)):
        comm = Loopback(rank, ks, vs)
        spec = RingSpec(comm, layout, True, kernel, scale, local_len, cu_seqlens, window)  # type: ignore[arg-type]
        comm.recv_rows = spec.recv_rows
        specs.append(spec)
    return specs


def ring_outputs(specs: Sequence[RingSpec], qs: Sequence[torch.Tensor], ks: Sequence[torch.Tensor],
                 vs: Sequence[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every rank's (out ``[b, n, h, d_v]``, lse ``[b, h, n]``) from :func:`ring_sp.ring.ring_forward`."""
    return [ring_forward(q, k, v, spec) for spec, q, k, v in zip(specs, qs, ks, vs)]


def ring_rank_backward(spec: RingSpec, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank ``spec.rank``'s :func:`ring_sp.ring.ring_backward` (dK/dV delivered in q's dtype, as the ring does)."""
    return ring_backward(dout, q, k, v, out, lse, spec, q.dtype)


def ring_grads(specs: Sequence[RingSpec], douts: Sequence[torch.Tensor], qs: Sequence[torch.Tensor],
               ks: Sequence[torch.Tensor], vs: Sequence[torch.Tensor],
               outputs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, ...]]:
    """Every rank's exact (dq, dk, dv) of its own shards: each rank's backward with the
    partials it sends collected, then each owner's returned dK/dV plus what was sent to it."""
    store = GradStore(ks, vs)
    grads = []
    for rank, spec in enumerate(specs):
        spec.comm.collect(store)  # type: ignore[union-attr]
        try:
            grads.append(ring_rank_backward(spec, douts[rank], qs[rank], ks[rank], vs[rank], *outputs[rank]))
        finally:
            spec.comm.collect(None)  # type: ignore[union-attr]
    return [(dq.to(store.dtype), dk.to(store.dtype) + store.dk[r], dv.to(store.dtype) + store.dv[r])
            for r, (dq, dk, dv) in enumerate(grads)]
