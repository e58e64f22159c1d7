"""Case functions that run on every rank of a pool (see harness.py).

Each rank generates the same global inputs from the case seed, computes the float64
oracle on the full sequence, runs the distributed attention on its shard and checks its
shard of out/lse/dq/dk/dv against the oracle's, raising AssertionError on any excess.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, replace
from unittest import mock

import torch
import torch.distributed as dist

import ring_sp
from oracle import (DTYPES, GRAD_TOL, LSE_ATOL, OUT_TOL, RATIO_FLOOR, assert_close, assert_lse_close,
                    make_inputs, max_abs_error, oracle_results)
from ring_sp.kernels import get_kernel, softmax_stat_dtype
from ring_sp.merge import fold_sinks

_TOPOLOGIES: dict[tuple[int, int, str, int | None], ring_sp.SequenceParallelTopology] = {}


def topology(ulysses: int, ring: int, placement: str = "ulysses_inner",
             node_size: int | None = None) -> ring_sp.SequenceParallelTopology:
    """One topology per shape per pool (group creation is collective and not free); ``node_size``:
    the emulated nodes' ranks (None: unknown)."""
    key = (ulysses, ring, placement, node_size)
    if key not in _TOPOLOGIES:
        _TOPOLOGIES[key] = ring_sp.init_sequence_parallel(ulysses, ring, placement=placement, node_size=node_size)
    return _TOPOLOGIES[key]


def nodes_of(node_size: int | None) -> contextlib.AbstractContextManager:
    """The launcher's ranks per node (``LOCAL_WORLD_SIZE``) set to ``node_size`` for the block (None: untouched)."""
    if node_size is None:
        return contextlib.nullcontext()
    return mock.patch.dict(os.environ, {"LOCAL_WORLD_SIZE": str(node_size)})


@dataclass(frozen=True)
class AttnCase:
    """One equivalence case. mode: "ring" (world = R), "ulysses" (world = U) or "hybrid"."""

    mode: str
    layout: str = "zigzag"
    causal: bool = True
    b: int = 1
    n_local: int = 4
    h: int = 4
    h_kv: int = 4
    d: int = 8
    dtype: str = "fp64"
    seed: int = 0
    ulysses: int = 1
    ring: int = 1
    placement: str = "ulysses_inner"
    backend: str = "auto"
    packed: bool = False  # random documents (cu_seqlens) from the seed
    sinks: bool | tuple[float, ...] = False  # one sink logit per query head: random (True) or these
    d_v: int | None = None  # value head size (None = d; MLA when different)
    window: int | None = None  # sliding_window (causal): query i sees keys i - window < j <= i
    kv_exchange: str = "ring"  # the ring group's KV exchange: "ring", "all_gather", "auto" or "double_ring"
    node_size: int | None = None  # emulated ranks per node (double_ring)
    spans: bool = False  # random bidirectional spans inside the documents (causal), from the seed

    def label(self) -> str:
        return (f"{self.mode} U{self.ulysses}xR{self.ring} {self.placement} {self.layout} causal={self.causal} "
                f"b={self.b} n={self.n_local} h={self.h}/{self.h_kv} d={self.d} {self.dtype} seed={self.seed}"
                f"{' packed' if self.packed else ''}{f' sinks={self.sinks}' if self.sinks else ''}"
                f"{f' d_v={self.d_v}' if self.d_v is not None else ''}"
                f"{'' if self.window is None else f' window={self.window}'}"
                f"{'' if self.kv_exchange == 'ring' else f' kv_exchange={self.kv_exchange}'}"
                f"{'' if self.node_size is None else f' nodes of {self.node_size}'}"
                f"{' spans' if self.spans else ''}")


def random_documents(seq_len: int, seed: int, multiple: int = 1) -> tuple[int, ...]:
    """Document boundaries: length-1 documents, documents spanning every shard boundary,
    and (multiple > 1) lengths that are multiples of ``multiple``."""
    g = torch.Generator().manual_seed(seed)
    units = seq_len // multiple
    cuts = {0, units}
    if multiple == 1 and units > 4:
        cuts.update({1, 2, units - 1})  # length-1 documents at both ends
    count = int(torch.randint(1, max(2, units // 3), (1,), generator=g))
    cuts.update(int(c) for c in torch.randint(1, units, (count,), generator=g))
    return tuple(multiple * c for c in sorted(cuts))


def random_spans(cu_seqlens: tuple[int, ...], seed: int) -> list[tuple[int, int]]:
    """Bidirectional spans inside each document of ``cu_seqlens``: one-token spans, spans that
    touch, spans at a document's ends and spans up to half a document (crossing shard cuts)."""
    g = torch.Generator().manual_seed(seed + 17)

    def draw(low: int, high: int) -> int:
        return int(torch.randint(low, high, (1,), generator=g))

    spans = []
    for a, b in zip(cu_seqlens, cu_seqlens[1:]):
        t = a + draw(0, 3)
        while t < b:
            stop = min(b, t + draw(1, max(2, (b - a) // 2 + 1)))
            spans.append((t, stop))
            t = stop + draw(0, 3)  # 0: the next span touches this one
    return spans


def span_pairs_mask(seq_len: int, spans: list[tuple[int, int]]) -> torch.Tensor:
    """[N, N] True where query i and key j lie in one span (written here, apart from ring_sp)."""
    ids = torch.full((seq_len,), -1)
    for index, (start, stop) in enumerate(spans):
        ids[start:stop] = index
    return (ids.unsqueeze(1) == ids.unsqueeze(0)) & (ids.unsqueeze(1) >= 0)


def document_mask(cu_seqlens: tuple[int, ...], causal: bool) -> torch.Tensor:
    """[N, N] oracle mask: same document (block diagonal), and causal if asked."""
    n = cu_seqlens[-1]
    doc = torch.searchsorted(torch.tensor(cu_seqlens), torch.arange(n), right=True)
    same = doc.unsqueeze(0) == doc.unsqueeze(1)
    return same & torch.ones(n, n, dtype=torch.bool).tril() if causal else same


def window_mask(seq_len: int, window: int) -> torch.Tensor:
    """[N, N] oracle mask of a causal sliding window: query i sees key j iff i - window < j <= i."""
    i, j = torch.arange(seq_len).unsqueeze(1), torch.arange(seq_len).unsqueeze(0)
    return (j <= i) & (j > i - window)


def case_mask(case: AttnCase, seq_len: int, cu: tuple[int, ...] | None,
              spans: list[tuple[int, int]] | None = None) -> torch.Tensor | None:
    """The oracle's explicit mask (None: plain causal / full attention): with ``spans``, transformers'
    Gemma 3 rule AND(window, OR(causal, same span)) inside each document."""
    if spans is not None:
        i, j = torch.arange(seq_len).unsqueeze(1), torch.arange(seq_len).unsqueeze(0)
        seen = (j <= i) | span_pairs_mask(seq_len, spans)
        if case.window is not None:
            seen &= j > i - case.window
        return seen if cu is None else seen & document_mask(cu, False)
    mask = None if cu is None else document_mask(cu, case.causal)
    if case.window is not None:
        mask = window_mask(seq_len, case.window) if mask is None else mask & window_mask(seq_len, case.window)
    return mask


def case_spans(case: AttnCase, seq_len: int, cu: tuple[int, ...] | None) -> list[tuple[int, int]] | None:
    return random_spans(cu or (0, seq_len), case.seed) if case.spans else None


def case_documents(case: AttnCase, sp_size: int) -> tuple[int, ...] | None:
    if not case.packed:
        return None
    return random_documents(case.n_local * sp_size, case.seed)  # any lengths, every layout (issue 14)


def _sp_coordinates(case: AttnCase) -> tuple[int, int, int]:
    """(sp_rank, sp_size, dp_rank) of this process for the case's mode."""
    if case.mode == "hybrid":
        topo = topology(case.ulysses, case.ring, case.placement, case.node_size)
        return topo.sp_rank, topo.sp_size, topo.dp_rank
    return dist.get_rank(), dist.get_world_size(), 0


def _sp_group(case: AttnCase) -> dist.ProcessGroup | None:
    return topology(case.ulysses, case.ring, case.placement, case.node_size).sp_group if case.mode == "hybrid" else None


def _run_distributed(case: AttnCase, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens=None, sinks=None,
                     spans=None):
    common = dict(causal=case.causal, layout=case.layout, backend=case.backend, cu_seqlens=cu_seqlens, sinks=sinks)
    if spans is not None:
        common["spans"] = spans
    if case.window is not None:
        common["sliding_window"] = case.window
    if case.kv_exchange != "ring":
        if case.mode == "ulysses":
            raise ValueError(f"{case.label()}: ulysses_attention has no ring group (kv_exchange)")
        common["kv_exchange"] = case.kv_exchange
    if case.mode == "ring":
        with nodes_of(case.node_size):
            return ring_sp.ring_attention(q, k, v, return_lse=True, **common)
    if case.mode == "ulysses":
        return ring_sp.ulysses_attention(q, k, v, **common), None
    topo = topology(case.ulysses, case.ring, case.placement, case.node_size)
    return ring_sp.hybrid_attention(q, k, v, topology=topo, **common), None


def _single_device(inputs: dict[str, torch.Tensor], case: AttnCase, cu_seqlens: tuple[int, ...] | None = None,
                   spans: list[tuple[int, int]] | None = None) -> dict[str, torch.Tensor]:
    """The same kernel in the same dtype on the full sequence (one call per document when
    packed), results in that dtype as a single-device user gets them: the ratio rule's yardstick."""
    q, k, v, dout = inputs["q"], inputs["k"], inputs["v"], inputs["dout"]
    kernel = get_kernel(case.backend, q.device, q.dtype, q.shape[3], v.shape[3])
    scale = q.shape[3] ** -0.5
    if case.window is not None or spans is not None:  # the windowed (span) blocks of the same kernel on one device
        from ring_sp.ring import RingSpec, ring_backward, ring_forward
        from ring_sp.spans import as_spans

        spec = RingSpec(None, "contiguous", True, kernel, scale, q.shape[1], cu_seqlens, window=case.window,
                        spans=as_spans(spans))
        out, lse = ring_forward(q, k, v, spec, inputs.get("sinks"))
        grads = ring_backward(dout, q, k, v, out, lse, spec, q.dtype)
        return {name: t.to(q.dtype) for name, t in zip(("out", "dq", "dk", "dv"), (out, *grads))}
    results: dict[str, list[torch.Tensor]] = {"out": [], "dq": [], "dk": [], "dv": []}
    for a, b in zip(cu_seqlens or (0, q.shape[1]), (cu_seqlens or (0, q.shape[1]))[1:]):
        doc = slice(a, b)
        out, lse = kernel.forward(q[:, doc], k[:, doc], v[:, doc], causal=case.causal, scale=scale)
        if "sinks" in inputs:  # the single-device fold: the same formula, on the whole row at once
            out, lse = fold_sinks(out, lse, inputs["sinks"])
        out = out.to(q.dtype)  # single-device training saves the output in the input dtype, as the ring does
        grads = kernel.backward(dout[:, doc], q[:, doc], k[:, doc], v[:, doc], out, lse, causal=case.causal, scale=scale)
        for name, t in zip(("out", "dq", "dk", "dv"), (out, *grads)):
            results[name].append(t.to(q.dtype))
    return {name: torch.cat(parts, dim=1) for name, parts in results.items()}


def _rounds_partials(case: AttnCase, inputs: dict[str, torch.Tensor]) -> bool:
    """Whether the case's kernel hands back block results (out, dq, dk, dv) in the input dtype
    rather than in the ring's accumulator dtype (flash-attn, PyTorch's CUDA ops: their APIs
    write bf16/fp16 only). Then each of the up to R blocks a row or key meets on the ring adds
    one rounding that a single device never makes, and the ratio rule's floor allows R steps."""
    q, k, v = (inputs[n][:1, :1] for n in ("q", "k", "v"))
    out, _ = get_kernel(case.backend, q.device, q.dtype, q.shape[3], v.shape[3]).forward(q, k, v, causal=False, scale=1.0)
    return out.dtype != softmax_stat_dtype(q.dtype)


def check_attention_case(case: AttnCase) -> dict[str, float]:
    """Run one case on this rank; returns max abs errors of its shard vs the oracle (and, for
    bf16/fp16/fp32, "<name> of bound": each error over the ratio rule's bound)."""
    sp_rank, sp_size, dp_rank = _sp_coordinates(case)
    dtype = DTYPES[case.dtype]
    inputs = make_inputs(case.seed * 1000 + dp_rank, case.b, case.n_local * sp_size, case.h, case.h_kv, case.d, dtype,
                         d_v=case.d_v, sinks=case.sinks)
    cu = case_documents(case, sp_size)
    spans = case_spans(case, case.n_local * sp_size, cu)
    mask = case_mask(case, case.n_local * sp_size, cu, spans)
    expected = oracle_results(inputs, causal=case.causal and mask is None, mask=mask)

    def shard(x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        return ring_sp.shard_sequence(x, rank=sp_rank, world_size=sp_size, layout=case.layout, dim=dim, cu_seqlens=cu)

    q, k, v = (shard(inputs[n]).requires_grad_() for n in ("q", "k", "v"))
    sinks = inputs["sinks"].clone().requires_grad_() if case.sinks else None
    out, lse = _run_distributed(case, q, k, v, cu, sinks, spans)
    out.backward(shard(inputs["dout"]))
    actual = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    if sinks is not None:
        actual["dsinks"] = sinks.grad
    for name, value in actual.items():
        if value.dtype != dtype:
            raise AssertionError(f"{case.label()}: {name}.dtype={value.dtype}, expected {dtype}")

    errors: dict[str, float] = {}
    for name, value in actual.items():
        tol = OUT_TOL[dtype] if name == "out" else GRAD_TOL[dtype]
        if name == "dsinks":  # each rank holds its rows' share: the sum over the SP ranks is the gradient
            total = value.double()
            dist.all_reduce(total, group=_sp_group(case))
            errors[name] = assert_close(f"{case.label()} rank {dist.get_rank()} dsinks (summed over SP)", total,
                                        expected["dsinks"], tol)
            continue
        errors[name] = assert_close(f"{case.label()} rank {dist.get_rank()} {name}", value, shard(expected[name]), tol)
    if lse is not None:
        errors["lse"] = assert_lse_close(f"{case.label()} lse", lse, shard(expected["lse"], dim=2), LSE_ATOL[dtype])
    if dtype in RATIO_FLOOR:  # no worse than 2x the same kernel's own error on one device
        single = _single_device(inputs, case, cu, spans)
        roundings = case.ring if _rounds_partials(case, inputs) else 1
        for name, value in actual.items():
            if name not in single:  # dsinks: no single-device kernel computes it
                continue
            own = max_abs_error(shard(single[name]), shard(expected[name]))
            floor = roundings * RATIO_FLOOR[dtype] * max(1.0, expected[name].abs().max().item())
            errors[f"{name} of bound"] = errors[name] / (2 * own + floor)  # the share of the rule's bound used
            if errors[name] > 2 * own + floor:
                raise AssertionError(
                    f"{case.label()} {name}: error {errors[name]:.3e} > 2 x single-device {own:.3e} + floor {floor:.1e}"
                    f" ({roundings} rounding step{'s' if roundings > 1 else ''})"
                )
    return errors


def check_attention_cases(cases: list[AttnCase]) -> list[dict[str, float]]:
    """Many cases per pool round-trip (each is cheap; the round-trip is not)."""
    return [check_attention_case(case) for case in cases]


def global_outputs(case: AttnCase) -> dict[str, torch.Tensor]:
    """The gathered global out and grads of one case (for factorisation invariance)."""
    sp_rank, sp_size, _ = _sp_coordinates(case)
    inputs = make_inputs(case.seed * 1000, case.b, case.n_local * sp_size, case.h, case.h_kv, case.d, DTYPES[case.dtype])
    shard = lambda x: ring_sp.shard_sequence(x, rank=sp_rank, world_size=sp_size, layout=case.layout)  # noqa: E731
    q, k, v = (shard(inputs[n]).requires_grad_() for n in ("q", "k", "v"))
    out, _ = _run_distributed(case, q, k, v)
    out.backward(shard(inputs["dout"]))
    if case.mode == "hybrid":
        topo = topology(case.ulysses, case.ring, case.placement, case.node_size)
        gather = lambda x: topo.gather_sequence(x.detach(), layout=case.layout)  # noqa: E731
    else:
        gather = lambda x: ring_sp.gather_sequence(x.detach(), layout=case.layout)  # noqa: E731
    return {"out": gather(out), "dq": gather(q.grad), "dk": gather(k.grad), "dv": gather(v.grad)}


def variants(case: AttnCase, **axes: list) -> list[AttnCase]:
    """The cartesian product of ``axes`` applied to ``case``."""
    cases = [case]
    for name, values in axes.items():
        cases = [replace(c, **{name: value}) for c in cases for value in values]
    return cases


class _ShardSummingGrads(torch.autograd.Function):
    """Global -> this rank's shard; backward scatters into the global shape and SUMS over
    ranks (every rank holds the same global leaf, so its gradient is the sum of all
    ranks' contributions). With gather_sequence's keep-own-slice backward this makes
    gradcheck exact; the naive wrapper is off by the world size (DESIGN.md section 9)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, rank: int, world_size: int, layout: str, group, cu_seqlens=None) -> torch.Tensor:
        ctx.meta = (rank, world_size, layout, group, cu_seqlens)
        return ring_sp.shard_sequence(x, rank=rank, world_size=world_size, layout=layout, cu_seqlens=cu_seqlens)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        rank, world_size, layout, group, cu_seqlens = ctx.meta
        parts = [torch.zeros_like(grad) for _ in range(world_size)]
        parts[rank] = grad
        full = ring_sp.unshard_sequence(torch.stack(parts), layout=layout, cu_seqlens=cu_seqlens)
        dist.all_reduce(full, group=group)
        return full, None, None, None, None, None


class _SumGradsOverRanks(torch.autograd.Function):
    """Identity for a tensor every rank uses whole (the sinks); backward sums its gradient
    over ``group``: each rank's share is its rows', the whole is the sum."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def gradcheck_case(mode: str, layout: str, causal: bool, ulysses: int = 1, ring: int = 1,
                   window: int | None = None, *, sinks: bool = False, d_v: int | None = None,
                   spans: list[tuple[int, int]] | None = None, cu_seqlens: tuple[int, ...] | None = None,
                   kv_exchange: str = "ring", node_size: int | None = None) -> bool:
    """Slow-mode float64 gradcheck of the whole distributed function on every rank
    (``window``: its ``sliding_window``; ``sinks``: their gradient too; ``d_v``: v's head size;
    ``spans``: bidirectional spans of the ``2 x SP`` tokens; ``cu_seqlens``: their documents,
    ``2 x SP`` tokens in all; ``kv_exchange``, ``node_size``: the ring's exchange on emulated nodes)."""
    topo = topology(ulysses, ring, node_size=node_size) if mode == "hybrid" else None
    sp_rank, sp_size = (topo.sp_rank, topo.sp_size) if topo else (dist.get_rank(), dist.get_world_size())
    group = topo.sp_group if topo else None
    n = 2 * sp_size  # slow-mode gradcheck costs ~2 forwards per input element
    u = dist.get_world_size() if mode == "ulysses" else ulysses
    heads, kv_heads = (2, 2) if u == 1 else (u, max(1, u // 2))  # Ulysses: the KV replication path
    inputs = make_inputs(7, 1, n, heads, kv_heads, 4, torch.float64, d_v=d_v, sinks=sinks)

    options = dict(causal=causal, layout=layout) if window is None else dict(causal=causal, layout=layout,
                                                                             sliding_window=window)
    if spans is not None:
        options["spans"] = spans
    if cu_seqlens is not None:
        options["cu_seqlens"] = cu_seqlens
    if kv_exchange != "ring":
        options["kv_exchange"] = kv_exchange

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        shard = lambda x: _ShardSummingGrads.apply(x, sp_rank, sp_size, layout, group, cu_seqlens)  # noqa: E731
        q, k, v = shard(q), shard(k), shard(v)
        extra = {"sinks": _SumGradsOverRanks.apply(rest[0], group)} if rest else {}
        if mode == "ring":
            with nodes_of(node_size):
                out = ring_sp.ring_attention(q, k, v, **options, **extra)
        elif mode == "ulysses":
            out = ring_sp.ulysses_attention(q, k, v, **options, **extra)
        else:
            out = ring_sp.hybrid_attention(q, k, v, topology=topo, **options, **extra)
        if topo:
            return topo.gather_sequence(out, layout=layout, cu_seqlens=cu_seqlens)
        return ring_sp.gather_sequence(out, layout=layout, cu_seqlens=cu_seqlens)

    names = ("q", "k", "v", "sinks") if sinks else ("q", "k", "v")
    leaves = tuple(inputs[name].clone().requires_grad_() for name in names)
    return torch.autograd.gradcheck(fn, leaves, fast_mode=False, atol=1e-8, rtol=1e-6)


def bf16_norm_errors(world_size_of_ring: int, seed: int) -> dict[str, float]:
    """Norm-relative bf16 dk/dv error of ring attention over ``world_size_of_ring`` ranks
    (a topology with R = that size and DP = the rest), summed over the whole ring."""
    topo = topology(1, world_size_of_ring)
    inputs = make_inputs(seed, 1, 256, 8, 2, 64, torch.bfloat16)
    expected = oracle_results(inputs, causal=True)
    shard = lambda x: topo.shard_sequence(x, layout="zigzag")  # noqa: E731
    q, k, v = (shard(inputs[n]).requires_grad_() for n in ("q", "k", "v"))
    out = ring_sp.ring_attention(q, k, v, group=topo.ring_group, causal=True, layout="zigzag")
    out.backward(shard(inputs["dout"]))
    sums = torch.tensor([
        (k.grad.double() - shard(expected["dk"])).pow(2).sum(), shard(expected["dk"]).pow(2).sum(),
        (v.grad.double() - shard(expected["dv"])).pow(2).sum(), shard(expected["dv"]).pow(2).sum(),
    ], dtype=torch.float64)
    dist.all_reduce(sums, group=topo.ring_group)
    return {"dk": (sums[0] / sums[1]).sqrt().item(), "dv": (sums[2] / sums[3]).sqrt().item()}
