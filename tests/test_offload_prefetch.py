"""OffloadedCheckpoint's prefetch choice (on, off, auto by ring_sp.shapes.prefetch_checkpoint) and the
planner counting the same checkpoints on the device."""

from __future__ import annotations

import pytest
import torch

import ring_sp.offload as offload
from ring_sp.offload import OffloadedCheckpoint
from ring_sp.plan import step_memory as sm
from ring_sp.plan.cli import _parser, max_seq_len_request
from ring_sp.plan.request import PlanError
from ring_sp.shapes import PREFETCH_SHARE, prefetch_checkpoint

GIB = 2**30
LAYERS = 3


class RecordingMover:
    """Keeps copies on the host side (nothing shared) and records ``(event, handle)`` in order,
    and the shape of each tensor sent to the host."""

    def __init__(self) -> None:
        self.log: list[tuple[str, int]] = []
        self.kept: list[torch.Tensor] = []
        self.shapes: list[tuple[int, ...]] = []

    def to_host(self, tensor: torch.Tensor) -> int:
        self.kept.append(tensor.clone())
        self.shapes.append(tuple(tensor.shape))
        self.log.append(("to_host", len(self.kept) - 1))
        return len(self.kept) - 1

    def to_device(self, handle: int) -> int:
        self.log.append(("to_device", handle))
        return handle

    def wait(self, pending: int) -> torch.Tensor:
        self.log.append(("wait", pending))
        return self.kept[pending].clone()


def _stack() -> torch.nn.ModuleList:
    torch.manual_seed(0)
    return torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(LAYERS))


def _run(checkpoint_fn) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Forward and backward of the 3-layer stack, each layer through ``checkpoint_fn`` (None: plain)."""
    layers = _stack()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1)).requires_grad_()
    h = x
    for layer in layers:
        step = lambda t, layer=layer: torch.tanh(layer(t))  # noqa: E731
        h = step(h) if checkpoint_fn is None else checkpoint_fn(step, h)
    h.square().sum().backward()
    return x.grad, [p.grad for p in layers.parameters()]


def _backward_log(**kwargs) -> list[tuple[str, int]]:
    """What moves in the backward (handle i is layer i's input), and the gradients checked against a plain run."""
    mover = RecordingMover()
    x_grad, grads = _run(OffloadedCheckpoint(mover, **kwargs))
    plain_x, plain = _run(None)
    assert torch.equal(x_grad, plain_x) and all(torch.equal(a, b) for a, b in zip(grads, plain, strict=True))
    assert mover.log[:LAYERS] == [("to_host", i) for i in range(LAYERS)]
    return mover.log[LAYERS:]


PREFETCHED = [("to_device", 2), ("to_device", 1), ("wait", 2), ("to_device", 0), ("wait", 1), ("wait", 0)]
ON_DEMAND = [("to_device", 2), ("wait", 2), ("to_device", 1), ("wait", 1), ("to_device", 0), ("wait", 0)]


def test_prefetch_on_starts_the_previous_layers_copy_at_a_layers_first_unpack() -> None:
    assert _backward_log(prefetch=True) == PREFETCHED


def test_prefetch_off_copies_each_layer_back_at_its_own_unpack() -> None:
    assert _backward_log(prefetch=False) == ON_DEMAND


def test_auto_prefetches_by_the_previous_layers_bytes_and_the_device_memory(monkeypatch) -> None:
    assert offload._device_memory(torch.device("cpu")) is None
    assert _backward_log() == PREFETCHED  # CPU tensors: no device memory to spare, prefetch
    checkpoint_bytes = 4 * 8 * 4  # each layer's input: [4, 8] fp32
    monkeypatch.setattr(offload, "_device_memory", lambda device: checkpoint_bytes * PREFETCH_SHARE - 1)
    assert _backward_log() == ON_DEMAND
    monkeypatch.setattr(offload, "_device_memory", lambda device: checkpoint_bytes * PREFETCH_SHARE)
    assert _backward_log() == PREFETCHED


@pytest.mark.parametrize("bad", ["auto", 1, 0, "yes"])
def test_bad_prefetch_is_a_type_error_naming_it(bad) -> None:
    with pytest.raises(TypeError, match=r"prefetch=.* must be True, False or None"):
        OffloadedCheckpoint(prefetch=bad)


def test_prefetch_checkpoint_rule() -> None:
    assert prefetch_checkpoint(1.25 * GIB, 80 * GIB)
    assert not prefetch_checkpoint(6 * GIB, 80 * GIB)
    assert prefetch_checkpoint(6 * GIB, None)


# ---------------------------------------------------------------- the planner counts the same

LLAMA_8B = sm.PRESETS["llama-3-8b"]


def _checkpoints(training: sm.Training, seq_len: int) -> tuple[float, int]:
    step = sm.step_memory(LLAMA_8B, training, seq_len=seq_len, ring=8, memory_bytes=80 * GIB)
    return step.checkpoints, step.tokens_per_rank


def test_planner_counts_one_checkpoint_when_auto_stops_prefetching() -> None:
    checkpoints, n = _checkpoints(sm.long_sequence(), 2**23)  # 8 GiB per checkpoint: no prefetch
    assert checkpoints == n * 2 * 4096
    checkpoints, n = _checkpoints(sm.long_sequence(), 2**17)  # 128 MiB: prefetched
    assert checkpoints == 2 * n * 2 * 4096
    for seq_len in (2**17, 2**23):
        checkpoints, n = _checkpoints(sm.long_sequence(prefetch_checkpoints=True), seq_len)
        assert checkpoints == 2 * n * 2 * 4096
        checkpoints, n = _checkpoints(sm.long_sequence(prefetch_checkpoints=False), seq_len)
        assert checkpoints == n * 2 * 4096
    # no memory given: prefetch, as the runtime off a GPU
    assert sm.step_memory(LLAMA_8B, sm.long_sequence(), seq_len=2**23, ring=8).checkpoints == 2 * 2**20 * 2 * 4096


def test_planner_validates_prefetch_checkpoints() -> None:
    with pytest.raises(PlanError, match="prefetch-checkpoints=True is ring_sp's choice"):
        sm.Training(library="alst", prefetch_checkpoints=True).check()
    with pytest.raises(PlanError, match="prefetch-checkpoints='yes' must be True, False or None"):
        sm.Training(prefetch_checkpoints="yes").check()
    assert sm.alst().device_checkpoint_layers(1.0, None) == 1


def test_cli_maps_prefetch_checkpoints_to_ring_sps_recipe() -> None:
    base = ["--model", "llama-3-8b", "--world-size", "8", "--max-seq-len", "--alst"]
    for flag, value in ((None, None), ("on", True), ("off", False)):
        args = _parser().parse_args(base + ([] if flag is None else ["--prefetch-checkpoints", flag]))
        recipes = {name: training for name, training, _ in max_seq_len_request(args, LLAMA_8B).recipes}
        assert recipes["ring_sp"].prefetch_checkpoints is value and recipes["ALST"].prefetch_checkpoints is None
