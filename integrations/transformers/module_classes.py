"""Switching a module's class in place: ``mixin + its class``, and back.

The long-sequence step (:mod:`.tiled_modules`: ``Tiled`` forwards) and the lean layers
(:mod:`.lean_layers`: ``Lean`` forwards) give known transformers modules another forward by
putting a mixin in front of their class. One class is made per (mixin, class) pair, so
``copy.deepcopy`` and ``isinstance`` work; each carries ``ring_sp_hf_class`` (transformers'
own class under every ring_sp mixin), which the forwards and checks read. Mixins stack (a lean
MLP tiled later is ``Tiled + Lean + LlamaMLP``); :func:`unmix` takes one out anywhere in the
stack. Imports no transformers.
"""

from __future__ import annotations

from torch import nn

_MIXED: dict[tuple[type, type], type] = {}


def hf_class(module: nn.Module) -> type:
    """``module``'s class without ring_sp's mixins: transformers' class."""
    return getattr(type(module), "ring_sp_hf_class", type(module))


def mix(module: nn.Module, mixin: type, kind: str) -> None:
    """Give ``module`` the class ``mixin + its class`` (named ``RingSP<kind><class>``); nothing if it has it."""
    if isinstance(module, mixin):
        return
    cls = type(module)
    if (mixin, cls) not in _MIXED:
        _MIXED[mixin, cls] = type(f"RingSP{kind}{cls.__name__}", (mixin, cls),
                                  {"__module__": __name__, "ring_sp_hf_class": hf_class(module),
                                   "ring_sp_mixin": (mixin, kind)})
    module.__class__ = _MIXED[mixin, cls]


def unmix(module: nn.Module, mixin: type) -> None:
    """Take ``mixin`` out of ``module``'s class, keeping the ring_sp mixins above it."""
    above = []
    while isinstance(module, mixin):
        cls = type(module)
        outer = cls.__dict__.get("ring_sp_mixin")
        if outer is None:  # a class that subclasses the mixin itself: not ours to change
            raise TypeError(f"{cls.__name__} was not made by ring_sp's mix(); cannot take {mixin.__name__} out")
        if outer[0] is not mixin:
            above.append(outer)
        module.__class__ = cls.__bases__[1]
    for outer_mixin, kind in reversed(above):
        mix(module, outer_mixin, kind)


__all__ = ["hf_class", "mix", "unmix"]
