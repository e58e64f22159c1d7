"""Agree-then-raise: make ranks that disagree fail together, clearly (DESIGN.md section 9).

On gloo, ranks that disagree on shapes do not fail cleanly: an ``all_to_all_single`` size
mismatch aborts the process, a ``batch_isend_irecv`` mismatch completes with garbage, an
``all_reduce`` mismatch hangs until the group timeout. So before the first real
collective of a call, ranks exchange a small fixed-size signature of their arguments
(one ``all_gather`` of ~24 int64) and, if any differs or any rank found a local error,
EVERY rank raises the same ``ValueError`` naming the offending ranks.

Cost: the exchange runs once per (group, signature) and is then cached, so a training
loop pays it on its first step only. With ``validate=True`` (or the environment variable
``RING_SP_VALIDATE=1``) it runs on every call and local argument errors are folded into
it, so even an error on ONE rank is raised on all ranks instead of leaving peers waiting.
Residual risk without validation: a rank that switches to a DIFFERENT already-agreed
signature while its peers do not (e.g. alternating lengths out of step) is not caught.
"""

from __future__ import annotations

import os
import struct
from collections import Counter, OrderedDict
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .layouts import LAYOUTS
from .validation import BACKENDS, KV_EXCHANGES

ENV_FLAG = "RING_SP_VALIDATE"
_CACHE_SIZE = 4096
_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
_agreed: OrderedDict[tuple[tuple[str, tuple[int, ...]], tuple[int, ...]], None] = OrderedDict()  # bounded memo


def validation_requested(validate: bool | None) -> bool:
    """``validate`` if given, else the ``RING_SP_VALIDATE`` environment variable."""
    if validate is not None:
        return validate
    return os.environ.get(ENV_FLAG, "0").lower() not in ("", "0", "false", "no")


@dataclass(frozen=True)
class CallSignature:
    """What every rank of one call must agree on, as fixed-width integers."""

    values: tuple[int, ...]
    text: str

    @staticmethod
    def of(q: object, k: object, v: object, *, causal: object, layout: object, softmax_scale: object,
           backend: object, ulysses_size: int, ring_size: int, cu_seqlens: tuple[int, ...] | None = None,
           sinks: object = None, sliding_window: object = None, kv_exchange: object = "ring") -> CallSignature:
        def shape(t: object) -> tuple[int, int, int, int]:
            dims = tuple(t.shape) if isinstance(t, torch.Tensor) and t.dim() == 4 else (-1, -1, -1, -1)
            return dims  # type: ignore[return-value]

        def code(value: object, choices: tuple) -> int:
            return choices.index(value) if value in choices else -1

        dtype = q.dtype if isinstance(q, torch.Tensor) else None
        device = q.device.type if isinstance(q, torch.Tensor) else "?"
        values = (*shape(q), *shape(k), *shape(v), code(dtype, _DTYPES), code(device, ("cpu", "cuda")),
                  int(causal is True), code(layout, LAYOUTS), code(backend, BACKENDS), _scale_bits(softmax_scale), ulysses_size, ring_size,
                  -1 if cu_seqlens is None else len(cu_seqlens), _checksum(cu_seqlens), *_sinks_code(sinks),
                  _window_code(sliding_window), code(kv_exchange, KV_EXCHANGES))
        text = (f"q {shape(q)}, k {shape(k)}, v {shape(v)}, dtype {dtype}, device {device}, causal={causal!r}, "
                f"layout={layout!r}, softmax_scale={softmax_scale!r}, backend={backend!r}, ulysses x ring = {ulysses_size} x {ring_size}, "
                f"cu_seqlens={'None' if cu_seqlens is None else f'{len(cu_seqlens) - 1} documents (checksum {_checksum(cu_seqlens)})'}, "
                f"sinks={_describe_sinks(sinks)}, sliding_window={sliding_window!r}, kv_exchange={kv_exchange!r}")
        return CallSignature(values, text)


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


def _checksum(values: tuple[int, ...] | None) -> int:
    """Order-sensitive and equal on every process (unlike str hashes, int tuple hashes are not salted)."""
    return -1 if values is None else hash(values) & (2**62 - 1)


def _scale_bits(softmax_scale: object) -> int:
    """The float's exact bits (-1 for None, -2 for a non-number) so scales compare exactly."""
    if softmax_scale is None:
        return -1
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        return -2
    return struct.unpack("<q", struct.pack("<d", float(softmax_scale)))[0]


def _group_key(group: dist.ProcessGroup) -> tuple[str, tuple[int, ...]]:
    return getattr(group, "group_name", ""), tuple(dist.get_process_group_ranks(group))


def _device_for(group: dist.ProcessGroup, hint: torch.device) -> torch.device:
    """NCCL collectives need CUDA tensors; gloo takes CPU ones."""
    return hint if dist.get_backend(group) == "nccl" else torch.device("cpu")


def agree(group: dist.ProcessGroup, signature: CallSignature, local_error: Exception | None, *,
          always: bool, device: torch.device) -> None:
    """Raise the same ``ValueError`` on every rank of ``group`` if ranks disagree or any
    rank has ``local_error``; else return (and remember the signature as agreed)."""
    key = (_group_key(group), signature.values)
    if not always and local_error is None and key in _agreed:
        _agreed.move_to_end(key)
        return
    mine = torch.tensor([int(local_error is not None), *signature.values], dtype=torch.int64, device=_device_for(group, device))
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(rows, mine, group=group)
    table = [tuple(row.tolist()) for row in rows]
    if all(row[0] == 0 for row in table) and len(set(table)) == 1:
        _agreed[key] = None
        if len(_agreed) > _CACHE_SIZE:
            _agreed.popitem(last=False)
        return
    # The failure path may be slow: gather every rank's own words and build one message.
    reports: list[tuple[str | None, str] | None] = [None] * len(table)
    dist.all_gather_object(reports, (None if local_error is None else f"{type(local_error).__name__}: {local_error}", signature.text), group=group)
    raise ValueError(_disagreement_message(dist.get_process_group_ranks(group), table, reports))


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
        lines.append(f"ranks disagree on the call's arguments: rank(s) {[ranks[i] for i in odd]} differ from the others:")
        lines.extend(f"  rank {ranks[i]}: {reports[i][1]}" for i in odd)
        lines.append(f"  rank {ranks[reference]} (and the rest): {reports[reference][1]}")
    lines.append("Every rank of a sequence-parallel group must call with the same shapes, dtype and options.")
    return "\n".join(lines)
