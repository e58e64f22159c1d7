"""Agree-then-raise: make ranks that disagree fail together, clearly (DESIGN.md section 9).

On gloo, ranks that disagree on shapes do not fail cleanly: an ``all_to_all_single`` size
mismatch aborts the process, a ``batch_isend_irecv`` mismatch completes with garbage, an
``all_reduce`` mismatch hangs until the group timeout. And an error found on ONE rank only
(another rank's shard, say) leaves its peers waiting in the call's first collective. So
before the first real collective of a call, ranks exchange one small fixed-size int64 row
(one ``all_gather``; :data:`ROW` values): an error flag, the call's signature (shapes,
dtype, options) and a few values of the shard the call runs on that every rank must share
(:func:`shard_values`: the global batch the integrations' shards were cut from). If any
rank found an error, or any row differs, EVERY rank raises: its own error (same type and
message, saying that every rank failed) when every rank found one (bad everywhere, the common
case: no more words need travelling), else the same ``ValueError`` naming the offending ranks
and their errors.

Default: every call (``validate=None``), so an error on one rank is an error on all of
them. Cost: one all_gather of 256 bytes and one host sync per call (``benchmarks/
agreement_cost.py``; docs/robustness.md models it on NCCL). ``validate=False`` or
``RING_SP_VALIDATE=0`` opts out: the exchange then runs once per (group, signature) and is
cached, local errors raise on their rank alone, and a rank that switches to a DIFFERENT
already-agreed signature while its peers do not is not caught.

An error found BEFORE a call, outside it (a model's inputs, say), joins the next agreement
with :func:`raise_at_next_agreement`, so the ranks fail together at the point where they
all are: the first attention call. Where every rank of a group passes one point before any
collective of its own (``shard_batch``, a trainer fetching its step's batches),
:func:`raise_together` makes that point an agreement.
"""

from __future__ import annotations

import os
import struct
from collections import Counter, OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .layouts import LAYOUT_CHOICES
from .shapes import HEAD_CHUNKS_AUTO
from .validation import BACKENDS, KV_EXCHANGES

ENV_FLAG = "RING_SP_VALIDATE"
WIDTH = 28  # the values of every signature (padded): every agreement on a group exchanges one size
SHARD_WIDTH = 3  # the shard's values every rank must share (-1: none given)
ROW = 1 + WIDTH + SHARD_WIDTH  # error flag, signature, shard
_KINDS = ("attention", "loss", "error", "shard", "generate")
_CACHE_SIZE = 4096
_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
_OFF = ("0", "false", "no", "off")
_agreed: OrderedDict[tuple[tuple[str, tuple[int, ...]], tuple[int, ...]], None] = OrderedDict()  # bounded memo


def validation_requested(validate: bool | None) -> bool:
    """``validate`` if given, else on unless the ``RING_SP_VALIDATE`` environment variable says 0/false/no/off."""
    if validate is not None:
        return validate
    return os.environ.get(ENV_FLAG, "1").strip().lower() not in _OFF


@dataclass(frozen=True)
class CallSignature:
    """What every rank of one call must agree on, as :data:`WIDTH` fixed-width integers."""

    values: tuple[int, ...]
    text: str

    @staticmethod
    def of(q: object, k: object, v: object, *, causal: object, layout: object, softmax_scale: object,
           backend: object, ulysses_size: int, ring_size: int, cu_seqlens: tuple[int, ...] | None = None,
           sinks: object = None, sliding_window: object = None, kv_exchange: object = "ring",
           head_chunks: object = None, spans: tuple[int, ...] | None = None,
           node_size: int | None = None) -> CallSignature:
        def shape(t: object) -> tuple[int, int, int, int]:
            dims = tuple(t.shape) if isinstance(t, torch.Tensor) and t.dim() == 4 else (-1, -1, -1, -1)
            return dims  # type: ignore[return-value]

        def code(value: object, choices: tuple) -> int:
            return choices.index(value) if value in choices else -1

        dtype = q.dtype if isinstance(q, torch.Tensor) else None
        device = q.device.type if isinstance(q, torch.Tensor) else "?"
        values = (*shape(q), *shape(k), *shape(v), code(dtype, _DTYPES), code(device, ("cpu", "cuda")),
                  int(causal is True), code(layout, LAYOUT_CHOICES), code(backend, BACKENDS), _scale_bits(softmax_scale), ulysses_size, ring_size,
                  -1 if cu_seqlens is None else len(cu_seqlens), _masks_checksum(cu_seqlens, spans), *_sinks_code(sinks),
                  _window_code(sliding_window), _exchange_code(kv_exchange, node_size), _chunks_code(head_chunks))
        text = (f"q {shape(q)}, k {shape(k)}, v {shape(v)}, dtype {dtype}, device {device}, causal={causal!r}, "
                f"layout={layout!r}, softmax_scale={softmax_scale!r}, backend={backend!r}, ulysses x ring = {ulysses_size} x {ring_size}, "
                f"cu_seqlens={'None' if cu_seqlens is None else f'{len(cu_seqlens) - 1} documents (checksum {_checksum(cu_seqlens)})'}, "
                f"spans={'None' if spans is None else f'{len(spans) // 2} spans (checksum {_checksum(spans)})'}, "
                f"sinks={_describe_sinks(sinks)}, sliding_window={sliding_window!r}, kv_exchange={kv_exchange!r}"
                f"{f' (nodes of {node_size} ranks)' if kv_exchange == 'double_ring' else ''}, head_chunks={head_chunks!r}")
        return CallSignature.named("attention", values, text)

    @staticmethod
    def named(kind: str, values: tuple[int, ...], text: str) -> CallSignature:
        """A signature of ``kind`` (``attention``, ``loss``, ``error``, ``shard``): ``values`` padded to :data:`WIDTH`."""
        if len(values) >= WIDTH:
            raise ValueError(f"a signature holds at most {WIDTH - 1} values; got {len(values)}")
        return CallSignature((_KINDS.index(kind), *values, *(-1,) * (WIDTH - 1 - len(values))), f"{kind}: {text}")


def _exchange_code(kv_exchange: object, node_size: int | None) -> int:
    """The exchange's index in :data:`KV_EXCHANGES`; the double ring's with the node size its inner rings
    follow (ranks that read another from their launcher's environment would pair other partners)."""
    index = KV_EXCHANGES.index(kv_exchange) if kv_exchange in KV_EXCHANGES else -1
    return index + len(KV_EXCHANGES) * (node_size or 0) if kv_exchange == "double_ring" else index


def _sinks_code(sinks: object) -> tuple[int, int]:
    """(length, dtype code) of the sinks: their shape and dtype, not their values (-1, -1 for None)."""
    if sinks is None:
        return -1, -1
    if not isinstance(sinks, torch.Tensor):
        return -2, -2
    return (sinks.shape[0] if sinks.dim() == 1 else -3), (_DTYPES.index(sinks.dtype) if sinks.dtype in _DTYPES else -3)


def _describe_sinks(sinks: object) -> str:
    if isinstance(sinks, torch.Tensor):
        return f"Tensor(shape={tuple(sinks.shape)}, dtype={sinks.dtype})"
    return repr(sinks)


def _window_code(sliding_window: object) -> int:
    """The window itself, -1 for None, -2 for anything that is not an int (the local check names it)."""
    if sliding_window is None:
        return -1
    return min(sliding_window, 2**62) if isinstance(sliding_window, int) and not isinstance(sliding_window, bool) else -2


def _chunks_code(head_chunks: object) -> int:
    """The count itself (None is 1: the same call), 0 for "auto", -2 for anything else (the local check names it)."""
    if head_chunks is None:
        return 1
    if isinstance(head_chunks, str) and head_chunks == HEAD_CHUNKS_AUTO:
        return 0
    return min(head_chunks, 2**62) if isinstance(head_chunks, int) and not isinstance(head_chunks, bool) else -2


def _checksum(values: tuple[int, ...] | None) -> int:
    """Order-sensitive and equal on every process (unlike str hashes, int tuple hashes are not salted)."""
    return -1 if values is None else hash(values) & (2**62 - 1)


def _masks_checksum(cu_seqlens: tuple[int, ...] | None, spans: tuple[int, ...] | None) -> int:
    """The documents' checksum, or with spans that of documents and spans together (one value:
    the row keeps its size)."""
    if spans is None:
        return _checksum(cu_seqlens)
    return _checksum((-1 if cu_seqlens is None else len(cu_seqlens), *(cu_seqlens or ()), *spans))


def _scale_bits(softmax_scale: object) -> int:
    """The float's exact bits (-1 for None, -2 for a non-number) so scales compare exactly."""
    if softmax_scale is None:
        return -1
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        return -2
    return struct.unpack("<q", struct.pack("<d", float(softmax_scale)))[0]


# ---- what a call carries besides its arguments -------------------------------------------

@dataclass
class _Pending:
    error: Exception | None
    consumed: bool = False


_shard: ContextVar[torch.Tensor | None] = ContextVar("ring_sp_shard_values", default=None)
_pending: ContextVar[_Pending | None] = ContextVar("ring_sp_pending_error", default=None)


@contextmanager
def shard_values(values: torch.Tensor | None) -> Iterator[None]:
    """Agreements inside the block also compare ``values`` (int64 ``[SHARD_WIDTH]``, on any
    device: no host sync until the exchange's own) across the ranks: what every rank's shard
    must share, e.g. the global batch it was cut from. None: nothing (``-1`` on the wire)."""
    if values is not None and (values.dtype != torch.int64 or values.shape != (SHARD_WIDTH,)):
        raise ValueError(f"shard values must be an int64 tensor [{SHARD_WIDTH}]; got {values.dtype} {tuple(values.shape)}")
    token = _shard.set(values)
    try:
        yield
    finally:
        _shard.reset(token)


@contextmanager
def raise_at_next_agreement(error: Exception | None = None) -> Iterator[None]:
    """``error`` (found on this rank before a collective call, e.g. in a model's inputs), or the
    first one :func:`defer` gets inside the block, joins the first agreement inside the block,
    so every rank of that call's group raises (naming this rank) where they all are, before
    its first collective. Raised here, on this rank alone, if the block ends without an
    agreement (a group of one rank)."""
    pending = _Pending(error)
    token = _pending.set(pending)
    try:
        yield
    finally:
        _pending.reset(token)
    if pending.error is not None and not pending.consumed:
        raise pending.error


def defer(error: Exception) -> bool:
    """Inside a :func:`raise_at_next_agreement` block: keep ``error`` for its next agreement (the
    first error kept wins) and return True; outside one, False (the caller raises it)."""
    pending = _pending.get()
    if pending is None or pending.consumed:
        return False
    if pending.error is None:
        pending.error = error
    return True


def _group_key(group: dist.ProcessGroup) -> tuple[str, tuple[int, ...]]:
    return getattr(group, "group_name", ""), tuple(dist.get_process_group_ranks(group))


def _device_for(group: dist.ProcessGroup, hint: torch.device) -> torch.device:
    """NCCL collectives need CUDA tensors (the current device when ``hint`` is not one, e.g. a
    collator's CPU batch); gloo takes CPU ones."""
    if dist.get_backend(group) != "nccl":
        return torch.device("cpu")
    return hint if hint.type == "cuda" else torch.device("cuda", torch.cuda.current_device())


def agree(group: dist.ProcessGroup, signature: CallSignature, local_error: Exception | None, *,
          always: bool, device: torch.device) -> None:
    """Raise on every rank of ``group`` if ranks disagree (signature or :func:`shard_values`) or any
    rank has an error (one kept by :func:`raise_at_next_agreement`, else ``local_error``); else return.

    ``always=False``: skip the exchange for a signature this group already agreed on (and no error).
    """
    pending = _pending.get()
    if pending is not None and pending.error is not None and not pending.consumed:
        pending.consumed = True
        local_error = pending.error  # found first (before the call): it explains the call's own, if any
    key = (_group_key(group), signature.values)
    if not always and local_error is None and key in _agreed:
        _agreed.move_to_end(key)
        return
    target = _device_for(group, device)
    mine = torch.tensor([int(local_error is not None), *signature.values, *(-1,) * SHARD_WIDTH], dtype=torch.int64,
                        device=target)
    shard = _shard.get()
    if shard is not None:
        mine[-SHARD_WIDTH:] = shard.to(target)
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(rows, mine, group=group)
    table = [tuple(row) for row in torch.stack(rows).tolist()]  # the one host sync
    if all(row[0] == 0 for row in table) and len(set(table)) == 1:
        _agreed[key] = None
        if len(_agreed) > _CACHE_SIZE:
            _agreed.popitem(last=False)
        return
    if local_error is not None and all(row[0] for row in table):
        everywhere = _everywhere(local_error, dist.get_process_group_ranks(group), dist.get_rank(group))
        if everywhere is local_error:
            raise local_error
        raise everywhere from local_error
    # The failure path may be slow: gather every rank's own words and build one message.
    reports: list[tuple[str | None, str] | None] = [None] * len(table)
    shards_differ = len({row[-SHARD_WIDTH:] for row in table}) > 1
    text = signature.text + (_describe_shard(table[dist.get_rank(group)][-SHARD_WIDTH:]) if shards_differ else "")
    dist.all_gather_object(reports, (None if local_error is None else f"{type(local_error).__name__}: {local_error}", text),
                           group=group)
    raise ValueError(_disagreement_message(dist.get_process_group_ranks(group), table, reports))


def raise_together(group: dist.ProcessGroup, signature: CallSignature, error: Exception | None, *,
                   validate: bool | None = None, device: torch.device = torch.device("cpu")) -> None:
    """Raise ``error`` (this rank's, or None) on every rank of ``group`` if any rank has one: with
    validation on (:func:`validation_requested`) and more than one rank, one :func:`agree` (every
    rank of ``group`` calls this at the same point, before any collective of its own); else
    ``error`` raises here, on this rank alone. Returns when no rank has an error."""
    if validation_requested(validate) and dist.get_world_size(group) > 1:
        agree(group, signature, error, always=True, device=device)
    if error is not None:
        raise error


def _everywhere(error: Exception, ranks: list[int], me: int) -> Exception:
    """Bad everywhere (the common case): this rank's own error, of its own type, saying that every
    rank failed; no more words need travelling."""
    text = (f"argument check failed on rank(s) {ranks} of the group {ranks} (every rank); rank {ranks[me]}: "
            f"{type(error).__name__}: {error}")
    try:
        return type(error)(text)
    except Exception:  # noqa: BLE001 - an exception type that takes other arguments: raise it as is
        return error


def _describe_shard(values: tuple[int, ...]) -> str:
    if all(v == -1 for v in values):
        return "; a shard without a ring_sp fingerprint (hand-built)"
    length, layout, batch = values
    name = LAYOUT_CHOICES[layout] if 0 <= layout < len(LAYOUT_CHOICES) else layout
    return f"; shard of a global batch of {length} tokens (checksum {batch}) cut with layout={name!r}"


def _disagreement_message(ranks: list[int], table: list[tuple[int, ...]], reports: list) -> str:
    failed = [i for i, row in enumerate(table) if row[0]]
    lines = []
    if failed:
        lines.append(f"argument check failed on rank(s) {[ranks[i] for i in failed]} of the group {ranks}:")
        lines.extend(f"  rank {ranks[i]}: {reports[i][0]}" for i in failed)
    majority, _ = Counter(row[1:] for row in table).most_common(1)[0]
    odd = [i for i, row in enumerate(table) if row[1:] != majority and i not in failed]
    if odd:
        reference = next(i for i, row in enumerate(table) if row[1:] == majority)
        what = "the call's arguments" if any(table[i][1:-SHARD_WIDTH] != majority[:-SHARD_WIDTH] for i in odd) else \
            "the global batch their shards were cut from (every rank must shard the SAME global batch)"
        lines.append(f"ranks disagree on {what}: rank(s) {[ranks[i] for i in odd]} differ from the others:")
        lines.extend(f"  rank {ranks[i]}: {reports[i][1]}" for i in odd)
        lines.append(f"  rank {ranks[reference]} (and the rest): {reports[reference][1]}")
    lines.append("Every rank of a sequence-parallel group must call with the same shapes, dtype and options, on shards "
                 "of the same global batch.")
    return "\n".join(lines)
