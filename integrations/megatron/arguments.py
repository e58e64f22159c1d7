"""The Megatron-LM argument switch: ``add_ring_sp_args`` (an ``extra_args_provider``) and
``validate_ring_sp_args`` (cross-argument checks once every argument is known)."""

from __future__ import annotations

import argparse
from typing import Any

from ring_sp.kernels import BACKENDS
from ring_sp.topology import PLACEMENTS
from ring_sp.validation import KV_EXCHANGES

from .config import MEGATRON_LAYOUTS, RingSPConfig, unpacked_layout


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def add_ring_sp_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``ring_sp`` argument group to ``parser`` and return it.

    Usable as Megatron-LM's ``pretrain(..., extra_args_provider=add_ring_sp_args)``.
    ``--ring-sp`` / ``--no-ring-sp`` switch it on/off (off by default); the context-parallel
    degree stays Megatron's ``--context-parallel-size``, split into
    ``--ring-sp-ulysses-size`` x ring. argparse itself rejects bad single values with a
    message naming the argument; :func:`validate_ring_sp_args` checks combinations.
    """
    group = parser.add_argument_group("ring_sp", "exact ring x Ulysses context-parallel attention")
    group.add_argument("--ring-sp", action=argparse.BooleanOptionalAction, default=False,
                       help="use ring_sp core attention over the context-parallel group")
    group.add_argument("--ring-sp-ulysses-size", type=_positive_int, default=1, metavar="U",
                       help="Ulysses degree U; the ring size is --context-parallel-size / U (default 1: pure ring)")
    group.add_argument("--ring-sp-layout", choices=MEGATRON_LAYOUTS, default="zigzag",
                       help="sequence layout over CP ranks; zigzag is Megatron's get_batch_on_this_cp_rank (default), "
                            "document_zigzag its packed-sequence (THD) sharding and zigzag for unpacked batches")
    group.add_argument("--ring-sp-placement", choices=PLACEMENTS, default="ulysses_inner",
                       help="ulysses_inner: each Ulysses group on neighbouring CP ranks (default)")
    group.add_argument("--ring-sp-backend", choices=BACKENDS, default="auto",
                       help="local attention kernel (default auto: ring_sp.kernels.AUTO_ORDER's first that can run)")
    group.add_argument("--ring-sp-kv-exchange", choices=KV_EXCHANGES, default="ring",
                       help="how a ring group exchanges KV: ring (default), all_gather (gather once, reduce-scatter "
                            "dK/dV), auto (the planner's choice per call) or double_ring (a ring spanning nodes: an "
                            "inner ring per node, each KV shard crossing to every other node once)")
    return parser


def _flag(args: Any, name: str, default: Any = None) -> Any:
    return getattr(args, name, default)


def sliding_window_from_megatron(window_size: Any, *, name: str = "window_size") -> int | None:
    """ring_sp's ``sliding_window`` for Megatron's ``window_size=(left, right)`` (-1 = unbounded).

    Megatron's mask lets query i see keys ``i - left <= j <= i + right``; ring_sp runs causal
    windows, so ``(left, 0)`` becomes ``left + 1`` keys (itself included) and ``(-1, 0)``
    (or None) plain causal attention. Anything looking ahead (``right != 0``) raises.
    """
    if window_size is None:
        return None
    try:
        left, right = (int(x) for x in window_size)
    except (TypeError, ValueError):
        raise ValueError(f"{name}={window_size!r} must be a pair (left, right) of ints") from None
    if right != 0 or left < -1:
        raise ValueError(
            f"{name}={tuple(window_size)} is not supported by ring_sp attention: only causal sliding windows "
            f"(left, 0) with left >= 0 (query i sees keys i - left .. i), or (-1, 0) for no window"
        )
    return None if left == -1 else left + 1


def validate_ring_sp_args(args: argparse.Namespace, *, rope_follows_layout: bool = False) -> RingSPConfig | None:
    """The :class:`RingSPConfig` of parsed arguments, or None when ``--ring-sp`` is off.

    See :func:`ring_sp_config_from_args` for the checks.
    """
    if not _flag(args, "ring_sp", False):
        return None
    return ring_sp_config_from_args(args, rope_follows_layout=rope_follows_layout)


def ring_sp_config_from_args(args: argparse.Namespace, *, rope_follows_layout: bool = False) -> RingSPConfig:
    """The :class:`RingSPConfig` the ``--ring-sp-*`` arguments describe (whatever ``--ring-sp`` says).

    Raises ``ValueError`` naming the offending argument(s) when the combination cannot
    work: sizes that do not divide, attention dropout (ring attention is exact and has
    none), per-document attention masks, or a layout Megatron's
    RoPE does not slice by (zigzag, and per document for packed THD batches: pass
    ``rope_follows_layout=True`` when the model uses :func:`install_layout_rope`).
    Megatron-LM's argument names are read with defaults, so a smaller parser works too.
    """
    config = RingSPConfig(
        ulysses_size=_flag(args, "ring_sp_ulysses_size", 1), layout=_flag(args, "ring_sp_layout", "zigzag"),
        placement=_flag(args, "ring_sp_placement", "ulysses_inner"), backend=_flag(args, "ring_sp_backend", "auto"),
        kv_exchange=_flag(args, "ring_sp_kv_exchange", "ring"),
    )
    config.check(
        context_parallel_size=_flag(args, "context_parallel_size", 1),
        num_attention_heads=args.num_attention_heads,
        num_query_groups=_flag(args, "num_query_groups") if _flag(args, "group_query_attention", True) else None,
        tensor_model_parallel_size=_flag(args, "tensor_model_parallel_size", 1),
    )
    dropout = _flag(args, "attention_dropout", 0.0)
    if dropout:
        raise ValueError(
            f"--attention-dropout={dropout} is not supported with --ring-sp: ring_sp attention is exact "
            f"and has no dropout; pass --attention-dropout 0"
        )
    if _flag(args, "reset_attention_mask", False):
        raise ValueError(
            "--reset-attention-mask is not supported with --ring-sp: ring_sp ignores attention-mask tensors; "
            "pack documents as THD batches (packed_seq_params, --ring-sp-layout document_zigzag) instead"
        )
    sliding_window_from_megatron(_flag(args, "window_size"), name="--window-size")
    rope = _flag(args, "position_embedding_type") in ("rope", "yarn", "mrope")
    if unpacked_layout(config.layout) != "zigzag" and rope and not rope_follows_layout:
        raise ValueError(
            f"--ring-sp-layout={config.layout} does not match --position-embedding-type="
            f"{args.position_embedding_type}: Megatron's rotary embedding always slices positions in the zigzag "
            f"layout by CP rank (get_pos_emb_on_this_cp_rank; per document for THD batches). Use "
            f"--ring-sp-layout zigzag or document_zigzag, or install "
            f"ring_sp.integrations.megatron.install_layout_rope on the model as examples/megatron does."
        )
    return config


def megatron_lm_args() -> argparse.Namespace | None:
    """Megatron-LM's parsed arguments when running under its ``pretrain``, else None."""
    try:
        from megatron.training.global_vars import get_args
    except ImportError:  # megatron-core alone
        return None
    try:
        return get_args()
    except AssertionError:  # Megatron-LM installed but its arguments are not parsed
        return None
