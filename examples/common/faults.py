"""A rank that dies mid-run: the error its peers raise, and the faults the tests inject.

* :class:`LostRanks` (``with LostRanks(hint) as lost:`` around the training loop, on every
  rank): each rank's node and pid are gathered once at the start. When the loop raises a
  communication error (gloo: "Connection closed by peer [address]", a collective timeout),
  the error is raised again naming the lost ranks and how to resume, chained to the original
  (gloo names an address, not a rank). A rank of this node is lost when its process is gone; a
  rank of another node when it does not report to the job's store (the launcher's rendezvous
  store) within ``wait_s`` as every survivor does, or all of them when the store itself is gone.
* :func:`fault_from_env` (tests/test_resume.py, test_multinode.py): ``RING_SP_EXAMPLE_FAULT=kill:RANK:STEP``
  makes rank RANK kill itself with SIGKILL in the middle of step STEP (in the forward, before
  the armed block); ``half-save:RANK:STEP`` kills it halfway through writing its optimizer
  shard of the step-STEP DeepSpeed checkpoint (half the bytes on disk); ``stop:RANK:STEP``
  stops it with SIGSTOP where ``kill`` kills it (a hung rank: alive, never answering). Unset: nothing.
"""

from __future__ import annotations

import io
import os
import signal
import socket
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

FAULT_ENV = "RING_SP_EXAMPLE_FAULT"


def _gone(pid: int) -> bool:
    """The process ``pid`` of this host has exited (a zombie not yet reaped by its launcher counts)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rpartition(")")[2].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False


def node_name() -> str:
    """This process's node: its host, and the launcher's node rank (two launchers on one host
    emulate two nodes: torchrun's GROUP_RANK, the DeepSpeed launcher's CROSS_RANK)."""
    return f"{socket.gethostname()}/{os.environ.get('GROUP_RANK', os.environ.get('CROSS_RANK', '0'))}"


# What a peer's loss looks like from a collective: gloo's closed connections, NCCL's and the store's errors, timeouts
_LOST_PEER = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "timed out", "Timed out", "NCCL")


def _communication_error(error: BaseException | None) -> bool:
    return isinstance(error, dist.DistError) or any(text in str(error) for text in _LOST_PEER)


class LostRanks:
    """Re-raises a communication error of the ``with`` body naming the ranks that died.

    ``hint`` ends the message (how to resume); ``at_step`` (called by the loop) says where it was.
    Errors with no lost rank pass through unchanged. ``wait_s``: how long a survivor waits for its
    own node's process to be reaped; ``remote_wait_s``: for the other nodes' survivors to report
    (asked only for an error of the communication itself).
    """

    def __init__(self, hint: str, *, wait_s: float = 2.0, remote_wait_s: float = 10.0) -> None:
        self.hint, self.wait_s, self.remote_wait_s, self.step = hint, wait_s, remote_wait_s, 0
        self.rank, self.node = dist.get_rank(), node_name()
        self.peers: list[tuple[str, int]] = [("", 0)] * dist.get_world_size()
        dist.all_gather_object(self.peers, (self.node, os.getpid()))
        others = [rank for rank in range(len(self.peers)) if rank != self.rank]
        self.local = [rank for rank in others if self.peers[rank][0] == self.node]  # checked by pid
        self.remote = [rank for rank in others if self.peers[rank][0] != self.node]  # asked through the store

    def dead(self, error: BaseException | None = None) -> list[int]:
        """The lost ranks: this node's whose processes are gone (waiting up to ``wait_s`` for one), then,
        when ``error`` is a communication error, the other nodes' that did not report to the store."""
        deadline = time.monotonic() + self.wait_s
        while True:
            dead = [rank for rank in self.local if _gone(self.peers[rank][1])]
            if dead or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        return sorted(dead + self._silent(self.remote)) if self.remote and _communication_error(error) else dead

    def _silent(self, ranks: list[int]) -> list[int]:
        """Those of ``ranks`` that do not report alive to the default store within ``remote_wait_s``
        (every survivor reports on its way out); all of them when the store is unreachable."""
        key = "ring_sp/lost_ranks/alive/"
        try:
            store = dist.distributed_c10d._get_default_store()  # the launcher's rendezvous store
            store.set(f"{key}{self.rank}", "alive")
            deadline = time.monotonic() + self.remote_wait_s
            while True:
                silent = [rank for rank in ranks if not store.check([f"{key}{rank}"])]
                if not silent or time.monotonic() > deadline:
                    return silent
                time.sleep(0.1)
        except (RuntimeError, ValueError):  # the store's host is gone (DistStoreError is a RuntimeError)
            return ranks

    def at_step(self, step: int) -> None:
        self.step = step

    def __enter__(self) -> LostRanks:
        return self

    def __exit__(self, kind: type | None, error: BaseException | None, traceback: object) -> None:
        if not isinstance(error, RuntimeError):  # torch.distributed's errors are RuntimeErrors
            return
        dead = self.dead(error)
        if not dead:
            return
        names = ", ".join(f"rank {rank} (pid {self.peers[rank][1]}"
                          f"{'' if self.peers[rank][0] == self.node else ' on node ' + self.peers[rank][0]})" for rank in dead)
        raise RuntimeError(f"rank {self.rank}: lost {names} in step {self.step}: its process is gone (killed?) or, on "
                           f"another node, no longer answers (a lost node), so this rank stops too; {self.hint}") from error


class Fault:
    """One injected fault on this rank (see the module docstring); ``at_step`` tells it the step."""

    def __init__(self, kind: str, step: int) -> None:
        if kind not in ("kill", "stop", "half-save"):
            raise ValueError(f"{FAULT_ENV}: kind must be 'kill', 'stop' or 'half-save'; got {kind!r}")
        self.kind, self.step, self.current = kind, step, 0

    def at_step(self, step: int) -> None:
        self.current = step

    def arm(self, block: torch.nn.Module) -> None:
        """``kill`` / ``stop``: when ``block``'s forward starts in the step; ``half-save``: in the step's save."""
        if self.kind != "half-save":
            block.register_forward_pre_hook(lambda *_: self._die(f"before the forward of {type(block).__name__}")
                                            if self.current == self.step else None)
            return
        from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

        TorchCheckpointEngine.save = self._half_save(TorchCheckpointEngine.save)

    def _half_save(self, save: Callable) -> Callable:
        def half_save(engine: object, state_dict: object, path: str) -> None:
            if self.current != self.step or "optim_states" not in os.path.basename(path):
                return save(engine, state_dict, path)
            buffer = io.BytesIO()
            torch.save(state_dict, buffer)
            with open(path, "wb") as handle:
                handle.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
            self._die(f"halfway through writing {path}")
        return half_save

    def _die(self, where: str) -> None:
        how = "stops itself (SIGSTOP)" if self.kind == "stop" else "kills itself (SIGKILL)"
        print(f"[fault injection] rank {dist.get_rank()} {how} in step {self.step}, {where}; t={time.time():.3f}",
              file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGSTOP if self.kind == "stop" else signal.SIGKILL)


def fault_from_env() -> Fault | None:
    """This rank's fault from ``RING_SP_EXAMPLE_FAULT=KIND:RANK:STEP``, or None. Injected once per
    launch: the workers torchrun restarts (``--max-restarts``; ``TORCHELASTIC_RESTART_COUNT`` > 0) run clean."""
    spec = os.environ.get(FAULT_ENV)
    if not spec or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        return None
    kind, rank, step = spec.split(":")
    return Fault(kind, int(step)) if int(rank) == dist.get_rank() else None
