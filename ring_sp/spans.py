"""Bidirectional spans inside causal documents: what they are, how they are given and checked.

A span is a contiguous range ``[start, stop)`` of GLOBAL token positions inside one document
(an image's tokens, a prefix-LM's prefix). Attention stays causal, except that a query in a
span also sees the span's LATER tokens: query ``i`` of document ``[d0, d1)`` sees keys
``[d0, hi(i)]`` with ``hi(i) = stop - 1`` when ``i`` lies in a span ``[start, stop)``, else
``i`` (transformers' OR(causal, same block) of Gemma 3 and PaliGemma); with a sliding window
the lower edge becomes ``max(d0, i - window + 1)`` (Gemma 3's AND(window, OR(causal, block)):
the window only ever cuts keys BEFORE the query, so a span's later tokens stay visible).

Spans are given as ``[num_spans, 2]`` (start, stop) pairs, the same on every rank, sorted
and disjoint (two spans may touch: two images back to back); a span of one token changes
nothing. Internally they are one flat hashable tuple ``(start_0, stop_0, start_1, ...)``
(:data:`Spans`), like ``cu_seqlens``' :data:`~ring_sp.layouts.Boundaries`, so schedules are
cached on it. :func:`spans_from_block_ids` turns per-token block ids as transformers builds
them (``-1`` outside any block) into spans.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .layouts import Boundaries

# (start_0, stop_0, start_1, stop_1, ...): global half-open spans, sorted and disjoint
Spans = tuple[int, ...]


def _describe(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return f"Tensor(shape={tuple(x.shape)}, dtype={x.dtype})"
    return f"{type(x).__name__} {x!r}"


def as_spans(spans: torch.Tensor | Sequence[Sequence[int]] | None, *, name: str = "spans") -> Spans | None:
    """``spans`` (an integer tensor ``[num_spans, 2]``, a sequence of (start, stop) pairs, or already
    a flat :data:`Spans` tuple of ints) as a flat :data:`Spans` tuple; None stays None. Raises
    ``TypeError`` for any other form. A CUDA tensor costs one device-to-host copy."""
    if spans is None:
        return None
    if isinstance(spans, tuple) and spans and all(isinstance(x, int) and not isinstance(x, bool) for x in spans):
        if len(spans) % 2:
            raise TypeError(f"{name} as a flat tuple must hold (start, stop) pairs: an even number of ints; got "
                            f"{len(spans)}")
        return spans
    if isinstance(spans, torch.Tensor):
        if spans.is_floating_point() or spans.is_complex() or spans.dtype == torch.bool or spans.dim() != 2 \
                or spans.shape[1] != 2:
            raise TypeError(f"{name} must be an integer tensor [num_spans, 2] of (start, stop) global positions; "
                            f"got {_describe(spans)}")
        return tuple(int(x) for x in spans.reshape(-1).tolist())
    if isinstance(spans, (str, bytes)) or not isinstance(spans, Sequence):
        raise TypeError(f"{name} must be a [num_spans, 2] integer tensor or a sequence of (start, stop) pairs; "
                        f"got {_describe(spans)}")
    flat: list[int] = []
    for i, pair in enumerate(spans):
        if isinstance(pair, torch.Tensor):
            pair = pair.tolist()
        if isinstance(pair, (str, bytes)) or not isinstance(pair, Sequence) or len(pair) != 2 or not all(
                isinstance(x, int) and not isinstance(x, bool) for x in pair):
            raise TypeError(f"{name}[{i}] must be a (start, stop) pair of ints; got {_describe(pair)}")
        flat.extend(pair)
    return tuple(flat)


def check_spans(spans: Spans, seq_len: int, cu_seqlens: Boundaries | None = None, *, causal: object = True,
                name: str = "spans") -> None:
    """Raise ``ValueError`` unless every span is non-empty, inside ``[0, seq_len)``, the spans
    are sorted and disjoint, and each lies inside one document of ``cu_seqlens`` (None: one
    document), and the attention is ``causal``. O(spans), vectorised; the message names the
    first bad span and the fix."""
    if causal is not True:
        raise ValueError(f"{name} need causal=True (a span makes a causal document see a span's later tokens; "
                         f"without causal every key of a document is visible already); got causal={causal!r}")
    if len(spans) == 0:
        return
    start, stop = torch.tensor(spans[0::2]), torch.tensor(spans[1::2])

    def first(bad: torch.Tensor) -> int | None:
        hits = bad.nonzero()
        return int(hits[0]) if hits.numel() else None

    def pair(i: int) -> str:
        return f"{name}[{i}]=({spans[2 * i]}, {spans[2 * i + 1]})"

    fix = ("spans are GLOBAL (start, stop) positions of the whole packed sequence, the same on every rank, "
           "sorted, disjoint and each inside one document")
    if (i := first(stop <= start)) is not None:
        raise ValueError(f"{pair(i)} is empty or reversed (start must be < stop; a span of one token is (t, t + 1)); {fix}")
    if (i := first((start < 0) | (stop > seq_len))) is not None:
        raise ValueError(f"{pair(i)} lies outside the sequence of {seq_len} tokens (another batch's, or local positions "
                         f"of a shard?); {fix}")
    if (i := first(start[1:] < start[:-1])) is not None:
        raise ValueError(f"{name} are unsorted: {pair(i + 1)} starts before {pair(i)}; sort them by start; {fix}")
    if (i := first(start[1:] < stop[:-1])) is not None:
        raise ValueError(f"{name} overlap: {pair(i)} and {pair(i + 1)} share tokens; merge them or cut them apart; {fix}")
    if cu_seqlens is not None:
        bounds = torch.tensor(cu_seqlens)
        doc_first = torch.searchsorted(bounds, start, right=True)
        doc_last = torch.searchsorted(bounds, stop - 1, right=True)
        if (i := first(doc_first != doc_last)) is not None:
            d = int(doc_first[i]) - 1
            raise ValueError(f"{pair(i)} crosses a document: it starts in document {d} [{cu_seqlens[d]}, "
                             f"{cu_seqlens[d + 1]}) of cu_seqlens and ends in a later one; a token never sees another "
                             f"document, so cut the span at the boundary; {fix}")


def spans_from_block_ids(block_ids: torch.Tensor) -> Spans:
    """Spans of per-token block ids ``[N]`` (or ``[1, N]``) as transformers builds them (Gemma 3's
    ``get_block_sequence_ids_for_mask``: ``-1`` outside blocks): each maximal run of one id
    ``>= 0`` is a span. Blocks are contiguous there; one id in two separate runs is refused
    (the spans here are contiguous: the run between would be a hole)."""
    if not isinstance(block_ids, torch.Tensor) or block_ids.is_floating_point() or block_ids.dim() not in (1, 2) or (
            block_ids.dim() == 2 and block_ids.shape[0] != 1):
        raise TypeError(f"block_ids must be an integer tensor [N] or [1, N] (one row); got {_describe(block_ids)}")
    ids = block_ids.reshape(-1).cpu()
    if ids.numel() == 0:
        return ()
    change = torch.ones(ids.numel(), dtype=torch.bool)
    change[1:] = ids[1:] != ids[:-1]
    starts = change.nonzero().flatten()
    stops = torch.cat((starts[1:], torch.tensor([ids.numel()])))
    run_ids = ids[starts]
    inside = run_ids >= 0
    starts, stops, run_ids = starts[inside], stops[inside], run_ids[inside]
    if torch.unique(run_ids).numel() != run_ids.numel():
        repeated = int(run_ids[torch.unique(run_ids, return_counts=True)[1].argmax()])
        raise ValueError(f"block id {repeated} appears in two separate runs of block_ids; a block must be one contiguous "
                         f"run of tokens")
    return tuple(int(x) for x in torch.stack((starts, stops), 1).flatten().tolist())

