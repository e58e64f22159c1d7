"""A slow link, emulated: every ring exchange stays in flight for a fixed delay.

:func:`delayed_exchanges` wraps ``ring_sp.comm.RingComm.exchange_with`` (every ring message) so
that the handle it returns completes no earlier than ``delay_s`` after the exchange was posted. If the
ring overlaps communication with compute, a step then takes ``max(compute, delay)``; if
it did not, ``compute + delay``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from ring_sp.comm import PendingExchange, RingComm


class DelayedExchange:
    """A posted exchange whose ``wait()`` also waits until ``deadline`` (perf_counter s)."""

    def __init__(self, pending: PendingExchange, deadline: float) -> None:
        self._pending, self._deadline = pending, deadline

    def wait(self) -> None:
        self._pending.wait()
        remaining = self._deadline - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)


@contextlib.contextmanager
def delayed_exchanges(delay_s: float) -> Iterator[None]:
    """Inside the block every ring exchange is in flight for at least ``delay_s`` seconds."""
    original = RingComm.exchange_with

    def delayed(self: RingComm, *args, **kwargs) -> DelayedExchange:
        posted = time.perf_counter()
        return DelayedExchange(original(self, *args, **kwargs), posted + delay_s)

    RingComm.exchange_with = delayed
    try:
        yield
    finally:
        RingComm.exchange_with = original
