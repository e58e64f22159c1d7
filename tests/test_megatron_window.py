"""Issue 12: Megatron's sliding windows through the ring_sp core attention.

A megatron-core GPTModel with ``window_size=(left, 0)`` and ``window_attn_skip_freq=2``
(layer 1 windowed, layer 2 full, as Gemma-3 / gpt-oss alternate them) at CP = 4 with the
ring_sp spec gives the loss and reduced gradients of the same model at CP = 1 whose core
attention applies Megatron's own window mask (``i - left <= j <= i``) explicitly. The
harness is test_megatron's; only the config and the reference attention change here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'megatron-core==0.16.1')")

from megatron.core.transformer.utils import is_layer_window_attention  # noqa: E402

import ring_sp.integrations.megatron as rsm  # noqa: E402
import test_megatron as tm  # noqa: E402
from ring_sp.integrations.megatron.arguments import sliding_window_from_megatron  # noqa: E402

WINDOW = (5, 0)  # 6 keys: crosses the zigzag chunks of 64 tokens over 4 CP ranks (8 tokens each)
SKIP_FREQ = 2  # layer_number % 2 != 0 is a window layer: layer 1 windowed, layer 2 full


class WindowedPlainCoreAttention(tm.PlainCoreAttention):
    """The CP = 1 reference: Megatron's sliding-window mask, written out, on window layers."""

    def __init__(self, config, layer_number: int, *args, **kwargs) -> None:
        super().__init__(config, layer_number, *args, **kwargs)
        self.left = (config.window_size[0] if is_layer_window_attention(
            config.window_size, config.window_attn_skip_freq, layer_number) else None)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None) -> torch.Tensor:
        if self.left is None:
            return super().forward(query, key, value, attention_mask)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, h, s, d]
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        i, j = torch.arange(q.shape[2]).unsqueeze(1), torch.arange(q.shape[2]).unsqueeze(0)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=(j <= i) & (j >= i - self.left))
        return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)


@contextlib.contextmanager
def _windowed_models() -> Iterator[None]:
    """test_megatron's model builder with the window config, its reference with the window mask."""
    config, plain = tm._config, tm.PlainCoreAttention
    tm._config = lambda *args, **kwargs: dataclasses.replace(config(*args, **kwargs), window_size=WINDOW,
                                                             window_attn_skip_freq=SKIP_FREQ)
    tm.PlainCoreAttention = WindowedPlainCoreAttention
    try:
        yield
    finally:
        tm._config, tm.PlainCoreAttention = config, plain


def windowed_gpt_case(cp: int, ulysses: int) -> dict[str, object]:
    with _windowed_models():
        result = tm.gpt_case(1, cp, ulysses, False)
        # the window really changes the model: the plain causal reference differs
    result["plain_loss"] = tm._reference()[0]
    return result


@pytest.mark.parametrize("ulysses", [pytest.param(1, id="cp4-u1xr4"), pytest.param(2, id="cp4-u2xr2")])
def test_windowed_gpt_equals_megatrons_mask_at_cp1(pools, ulysses: int) -> None:
    for r in pools.get(4).run(windowed_gpt_case, 4, ulysses, timeout=240):
        assert math.isclose(r["loss"], r["ref_loss"], rel_tol=1e-6), r
        assert not math.isclose(r["ref_loss"], r["plain_loss"], rel_tol=1e-4), r  # the window matters
        assert r["ref_grad_max"] > 1e-3 and r["grad_err"] <= 1e-6 and r["per_token_grad_err"] <= 1e-6, r


@pytest.mark.parametrize("window_size,expected", [(None, None), ((-1, 0), None), ((0, 0), 1), ((4095, 0), 4096)])
def test_megatron_window_size_is_left_plus_one(window_size, expected) -> None:
    assert sliding_window_from_megatron(window_size) == expected


@pytest.mark.parametrize("window_size", [(4, 4), (4, -1), (-1, -1), (-2, 0), (3,), "wide"])
def test_windows_that_look_ahead_are_refused(window_size) -> None:
    with pytest.raises(ValueError, match="window_size"):
        sliding_window_from_megatron(window_size)


def test_megatron_lm_window_argument_is_checked() -> None:
    args = tm._parse("--ring-sp")
    args.window_size = (8, 8)
    with pytest.raises(ValueError, match="--window-size=.*only causal sliding windows"):
        rsm.validate_ring_sp_args(args)
    args.window_size = (8, 0)
    assert rsm.validate_ring_sp_args(args) is not None
