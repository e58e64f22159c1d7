"""Ring attention: the one forward loop and the one backward loop that every layout, mask
and KV exchange shares (:mod:`.loops`), the spec they run from (:mod:`.spec`: ring, kernel
and the schedule of :mod:`ring_sp.schedule`), and the two exchange strategies they call:
where each step's KV comes from (:mod:`.kv_exchange`: ring messages or one all-gather) and
where the dK/dV partials go (:mod:`.grad_exchange`: relayed, sent home, or reduce-scattered).
"""

from .loops import ring_backward, ring_forward
from .spec import RingSpec, ring_comm_for

__all__ = ["RingSpec", "ring_backward", "ring_comm_for", "ring_forward"]
