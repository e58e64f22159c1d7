"""The rows one ring message carries (:data:`ring_sp.schedule.RowSet`): copied out of a shard
into the message, and a message added back into a shard's rows.

A message holds the rows some block of its receiver reads, range after range
(:func:`ring_sp.schedule.message_rows`). One range is a slice (one copy, one add); several are
one gather (``index_select``) and one scatter-add (``index_add_``), whatever their number,
so a message costs the same few kernel calls however the documents cut it. Their token
index is built on the device for the call (from the ranges, uploaded once per device: no
host-to-device copy per step) and freed with it; nothing per token is kept.
"""

from __future__ import annotations

import bisect

import torch

from ..schedule import RowSet, row_count


class MessageRows:
    """One message's ``rows`` of a shard of ``local_len`` tokens (``rows`` covering it: ``whole``)."""

    def __init__(self, rows: RowSet, local_len: int) -> None:
        self.rows = rows
        self.count = row_count(rows)
        self.whole = rows == ((0, local_len),)
        self._offsets = [0]  # where each range starts in the message
        for a, b in rows[:-1]:
            self._offsets.append(self._offsets[-1] + b - a)
        self._runs: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}  # per device: (shift, length)

    def index(self, device: torch.device) -> torch.Tensor:
        """The shard row of each message row: LongTensor ``[count]`` on ``device``, built for the call."""
        if device not in self._runs:
            starts = torch.tensor([a for a, _ in self.rows])
            lengths = torch.tensor([b - a for a, b in self.rows])
            self._runs[device] = ((starts - (lengths.cumsum(0) - lengths)).to(device), lengths.to(device))
        shift, lengths = self._runs[device]
        return (torch.repeat_interleave(shift, lengths, output_size=self.count)
                + torch.arange(self.count, device=device))

    def gather(self, shard: torch.Tensor, message: torch.Tensor) -> None:
        """``message`` ``[b, count, ...]`` = these rows of ``shard`` ``[b, n, ...]`` (dim 1)."""
        if len(self.rows) == 1:
            a, b = self.rows[0]
            message.copy_(shard[:, a:b])
        else:
            torch.index_select(shard, 1, self.index(shard.device), out=message)

    def add_to(self, shard: torch.Tensor, message: torch.Tensor, part: slice | None = None) -> None:
        """These rows of ``shard`` += ``message`` (dim 1); with ``part``, the message's rows
        ``part`` only (``message`` holds just those)."""
        part = slice(0, self.count) if part is None else part
        at = bisect.bisect_right(self._offsets, part.start) - 1
        if part.stop <= self._offsets[at] + self.rows[at][1] - self.rows[at][0]:  # inside one range: a slice
            shift = self.rows[at][0] - self._offsets[at]
            shard[:, part.start + shift:part.stop + shift] += message
        else:
            shard.index_add_(1, self.index(shard.device)[part], message)


def row_span(rows: MessageRows | None) -> int:
    """Rows a message of ``rows`` carries (0: no message)."""
    return 0 if rows is None else rows.count


def messages(rows: tuple[RowSet | None, ...], local_len: int) -> tuple[MessageRows | None, ...]:
    """Each step's :class:`MessageRows` (None: no message)."""
    return tuple(None if r is None else MessageRows(r, local_len) for r in rows)
