"""Tags on a tensor that survive the aliases frameworks hand on instead of the tensor itself.

A module's output can carry what a later module needs to know about it (how a lean norm's
output was made, which positions a RoPE table is for). A Python attribute on the tensor object
is lost when a framework passes on an alias: ZeRO-3's hooks wrap every module's inputs and
outputs in ``detach()``-ing autograd Functions. An alias shares the storage (and its version
counter), and torch keeps one Python object per storage, so the tag lives there, keyed by the
view (shape, strides, offset) and checked against the version: a view of other elements, or
the same elements changed in place since, finds nothing. A tag lives as long as the storage.
"""

from __future__ import annotations

from typing import Any

import torch

_ATTR = "ring_sp_tags"


def _view(tensor: torch.Tensor) -> tuple:
    return tuple(tensor.shape), tensor.stride(), tensor.storage_offset()


def _version(tensor: torch.Tensor) -> int | None:
    """The version counter; None for an inference tensor, which has none (and no backward)."""
    return None if tensor.is_inference() else tensor._version


def tag(tensor: torch.Tensor, key: str, value: Any) -> torch.Tensor:
    """Attach ``value`` under ``key`` to ``tensor`` and its aliases, as it is now; returns ``tensor``."""
    storage = tensor.untyped_storage()
    tags = getattr(storage, _ATTR, None)
    if tags is None:
        tags = {}
        setattr(storage, _ATTR, tags)
    tags[key, _view(tensor)] = (_version(tensor), value)
    return tensor


def tagged(tensor: torch.Tensor, key: str) -> Any:
    """The value :func:`tag` attached under ``key`` to ``tensor`` or an alias of it, None if there is
    none or the elements were changed in place since (not checked for inference tensors)."""
    found = getattr(tensor.untyped_storage(), _ATTR, {}).get((key, _view(tensor)))
    if found is None or found[0] != _version(tensor):
        return None
    return found[1]


__all__ = ["tag", "tagged"]
