"""Megatron's packed sequences (``PackedSeqParams``) as ring_sp document boundaries.

What megatron-core 0.16.1 hands the core attention with packed sequences:

* ``qkv_format="thd"`` (``get_thd_batch_on_this_cp_rank``, Megatron-LM's packed/SFT path):
  ``SelfAttention`` squeezes q/k/v to ``[t, heads, head_dim]`` (one packed row) and expects
  ``[t, heads * head_dim]`` back. With CP > 1 the tokens were sharded by TransformerEngine's
  ``thd_get_partitioned_indices`` over ``cu_seqlens_q_padded``: every padded document split
  into ``2 x CP`` chunks, CP rank c holding chunks c and ``2CP-1-c`` of each, documents in
  order. That is ring_sp's ``document_zigzag`` layout (which also splits documents of any
  length, with ring_sp's own THD RoPE: :func:`thd_batch_on_this_cp_rank`, :func:`.rope.install_layout_rope`).
* ``qkv_format="sbhd"`` (``get_batch_on_this_hybrid_cp_rank``): ``[s, b, heads, head_dim]``
  as usual, sharded by ``get_batch_on_this_cp_rank`` (plain zigzag), and the boundaries
  ``[0, s]`` of the one sample per row.

TransformerEngine's convention (its ``DotProductAttention.forward`` docstring):
``cu_seqlens_q`` are the cumulative REAL lengths, ``cu_seqlens_q_padded`` the offsets where
each document starts in the tensor; document i's real tokens are
``[padded[i], padded[i] + real_len_i)``, its padding the rest up to ``padded[i + 1]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

import ring_sp
from ring_sp.data import IGNORE_INDEX
from ring_sp.layouts import as_boundaries
from ring_sp.plan.layout_choice import resolve_layout

from .config import PACKED_LAYOUTS, unpacked_layout

if TYPE_CHECKING:
    from megatron.core.packed_seq_params import PackedSeqParams

PACKED_FORMATS = ("thd", "sbhd", "bshd")


def _boundaries(params: PackedSeqParams, side: str) -> tuple[str, tuple[int, ...]]:
    """The field used for ``side`` ("q" or "kv") and its values: the padded boundaries
    when given (those are what the shards follow), else the real ones."""
    padded = f"cu_seqlens_{side}_padded"
    name = padded if getattr(params, padded) is not None else f"cu_seqlens_{side}"
    values = as_boundaries(getattr(params, name))
    if values is None:
        raise ValueError(f"packed_seq_params.cu_seqlens_{side} is None: packed sequences need the document "
                         f"boundaries (cu_seqlens_{side}, and cu_seqlens_{side}_padded when documents are padded)")
    return name, values


def _check_padding(params: PackedSeqParams, padded: tuple[int, ...], causal: bool) -> None:
    """Padding must sit at the end of each padded document; non-causal attention would let
    real tokens see it, so it needs unpadded documents."""
    if params.cu_seqlens_q_padded is None:
        return
    real = as_boundaries(params.cu_seqlens_q)
    if real is None or real == padded:
        return
    if len(real) != len(padded):
        raise ValueError(
            f"packed_seq_params.cu_seqlens_q has {len(real) - 1} documents but cu_seqlens_q_padded has "
            f"{len(padded) - 1}: both describe the same documents (real and padded lengths)"
        )
    too_long = next((i for i in range(len(real) - 1) if real[i + 1] - real[i] > padded[i + 1] - padded[i]), None)
    if too_long is not None:
        raise ValueError(
            f"packed_seq_params: document {too_long} has {real[too_long + 1] - real[too_long]} real tokens "
            f"(cu_seqlens_q) but only {padded[too_long + 1] - padded[too_long]} padded ones (cu_seqlens_q_padded)"
        )
    if not causal:
        raise ValueError(
            "packed sequences with padding (packed_seq_params.cu_seqlens_q != cu_seqlens_q_padded) need causal "
            "attention with ring_sp: without the causal mask, real tokens would attend to the padding at the end "
            "of their document. Use attn_mask_type=AttnMaskType.causal, or pack documents without padding "
            "(cu_seqlens_q_padded=None, each document a multiple of 2 x --context-parallel-size)"
        )


def _check_cp_group(params: PackedSeqParams, sp_group: dist.ProcessGroup) -> None:
    """Megatron's hybrid/dynamic CP hands a per-batch CP group; ring_sp's groups are fixed."""
    sp_ranks = dist.get_process_group_ranks(sp_group)
    group = params.cp_group
    if group is not None and group is not sp_group and dist.get_process_group_ranks(group) != sp_ranks:
        raise ValueError(
            f"packed_seq_params.cp_group (ranks {dist.get_process_group_ranks(group)}) is not the model's "
            f"context-parallel group (ranks {sp_ranks}): ring_sp runs over the CP group it was built with, so "
            f"dynamic context parallelism (--hybrid-context-parallel) is not supported; leave cp_group None"
        )
    if params.local_cp_size is not None and params.local_cp_size != len(sp_ranks):
        raise ValueError(
            f"packed_seq_params.local_cp_size={params.local_cp_size} differs from the context-parallel size "
            f"{len(sp_ranks)}: dynamic context parallelism (--hybrid-context-parallel) is not supported by ring_sp"
        )


def packed_attention_args(
    params: PackedSeqParams,
    *,
    local_len: int,
    batch: int,
    sp_group: dist.ProcessGroup,
    layout: str,
    causal: bool,
) -> tuple[tuple[int, ...], str]:
    """``(cu_seqlens, layout)`` for :func:`ring_sp.hybrid_attention` from Megatron's packed params.

    ``local_len`` is this rank's token count (``t`` of ``[t, h, d]``, ``s`` of ``[s, b, h, d]``),
    ``batch`` the batch size (1 for THD), ``sp_group`` the CP group, ``layout`` the configured
    ``--ring-sp-layout``. The boundaries are the padded ones when given (the shards follow
    them); for causal attention, treating each padded document as the document is exact for
    every real token, because its padding comes after all of them. Raises ``ValueError``
    naming the field and the fix before any collective.
    """
    if params.qkv_format not in PACKED_FORMATS:
        raise ValueError(f"packed_seq_params.qkv_format={params.qkv_format!r} is not one of {PACKED_FORMATS}")
    _check_cp_group(params, sp_group)
    if params.qkv_format != "thd" and batch != 1:
        raise ValueError(
            f"packed_seq_params.qkv_format={params.qkv_format!r} with batch size {batch}: ring_sp applies the "
            f"document boundaries to one packed row, while TransformerEngine reads them per batch row (padding "
            f"masks) for this format. Pack the batch into one row (qkv_format='thd'), or pass no packed_seq_params"
        )
    q_name, q = _boundaries(params, "q")
    kv_name, kv = _boundaries(params, "kv")
    if q != kv:
        raise ValueError(
            f"packed_seq_params.{q_name} and {kv_name} differ: ring_sp runs self-attention, whose query and "
            f"key/value documents are the same; pass equal boundaries"
        )
    sp_size = dist.get_world_size(sp_group)
    total = local_len * sp_size
    if len(q) < 2 or q[0] != 0 or q[-1] != total:
        span = f"runs from {q[0]} to {q[-1]}" if q else "is empty"
        raise ValueError(
            f"packed_seq_params.{q_name} {span}; it must run from 0 to the {total} tokens of the packed sequence "
            f"({local_len} on each of {sp_size} context-parallel ranks): the boundaries cover every token, "
            f"padding included (pad the last document rather than leave tokens after it)"
        )
    _check_padding(params, q, causal)
    if params.qkv_format != "thd":
        layout = unpacked_layout(layout)  # get_batch_on_this_cp_rank shards the row in plain zigzag
    elif sp_size > 1 and layout not in PACKED_LAYOUTS:
        raise ValueError(
            f"packed_seq_params.qkv_format='thd' at context-parallel size {sp_size} needs --ring-sp-layout "
            f"document_zigzag, document_balanced or auto (RingSPConfig(layout=...)); got {layout!r}. Megatron "
            f"shards THD batches per document (get_thd_batch_on_this_cp_rank), which is ring_sp's document_zigzag "
            f"layout; thd_batch_on_this_cp_rank(layout=...) shards them by the others."
        )
    # Zero-length documents (TransformerEngine allows them, e.g. for static shapes) hold no
    # token: dropping their repeated boundary changes nothing.
    boundaries = tuple(dict.fromkeys(q))
    return boundaries, resolve_layout(layout, boundaries, sp_size) if params.qkv_format == "thd" else layout


def thd_batch_on_this_cp_rank(
    input_ids: torch.Tensor,
    cu_seqlens: torch.Tensor | Sequence[int],
    *,
    cp_rank: int | None = None,
    cp_size: int | None = None,
    pad_id: int = 0,
    per_document_padding: bool = True,
    layout: str = "document_zigzag",
) -> tuple[dict[str, torch.Tensor], PackedSeqParams]:
    """One packed row as Megatron's THD path feeds it to a CP rank, on any device.

    ``input_ids`` ``[1, N]``: documents end to end, boundaries ``cu_seqlens``
    ``[num_docs + 1]`` (0 to N), any lengths. With ``per_document_padding=True`` (the
    default) every document is padded at its end to a multiple of ``2 x cp_size``
    (:func:`ring_sp.pad_documents`), as ``get_thd_batch_on_this_cp_rank`` and
    TransformerEngine do: megatron-core's THD RoPE (``_apply_rotary_pos_emb_thd``) cuts
    every CP rank's tokens into ``len // cp_size`` per document and each of those into two
    equal zigzag halves, so it needs documents of multiples of ``2 x CP``. With
    ``per_document_padding=False`` no document is padded (``document_zigzag`` splits any
    length) and only the end of the row is, to a multiple of ``cp_size``, as its own
    document: for models whose ring_sp layers apply RoPE themselves
    (:func:`~.rope.install_layout_rope`) or that have no rotary embedding; megatron-core's
    THD RoPE refuses such a batch (:class:`~.rope.LayoutRotaryEmbedding` says so first).

    This rank's shard is taken per document (``layout``: ``document_zigzag``, Megatron's own;
    ``document_balanced`` or ``auto`` keep short documents whole, for models whose RoPE is
    ring_sp's, :func:`~.rope.install_layout_rope`; the same ``--ring-sp-layout`` as the attention). Returns Megatron's batch
    keys ``tokens``, ``labels`` (the next token inside the document), ``loss_mask`` (0 at
    each document's last token and on padding) and ``position_ids`` (restarting per
    document), each ``[1, N_padded / cp_size]``, and the ``PackedSeqParams`` (THD; real
    lengths in ``cu_seqlens_q``, padded offsets in ``cu_seqlens_q_padded`` when documents
    are padded; ``max_seqlen_q`` the longest (padded) document, which Megatron's RoPE
    needs). ``cp_rank``/``cp_size`` default to Megatron's context-parallel group.
    """
    from megatron.core.packed_seq_params import PackedSeqParams

    if cp_rank is None or cp_size is None:
        from megatron.core import parallel_state

        cp_rank, cp_size = parallel_state.get_context_parallel_rank(), parallel_state.get_context_parallel_world_size()
    batch, cu = {"input_ids": input_ids}, as_boundaries(cu_seqlens)
    if per_document_padding:
        batch, cu = ring_sp.pad_documents(batch, cu, 2 * cp_size, pad_id=pad_id)
    if layout not in PACKED_LAYOUTS:
        raise ValueError(f"layout={layout!r} is not one of {PACKED_LAYOUTS} (the layouts of packed THD batches)")
    shard = ring_sp.shard_batch(batch, rank=cp_rank, world_size=cp_size, layout=layout, cu_seqlens=cu, pad_id=pad_id)
    ignored = shard["labels"] == IGNORE_INDEX
    tokens = {"tokens": shard["input_ids"], "labels": shard["labels"].masked_fill(ignored, 0),
              "loss_mask": (~ignored).float(), "position_ids": shard["position_ids"]}
    sharded_cu = shard["cu_seqlens"].to(device=input_ids.device)  # what the shards follow (padding included)
    longest = int(sharded_cu.diff().max())
    if per_document_padding:
        real = torch.tensor(as_boundaries(cu_seqlens), dtype=torch.int32, device=input_ids.device)
        return tokens, PackedSeqParams(qkv_format="thd", cu_seqlens_q=real, cu_seqlens_kv=real,
                                       cu_seqlens_q_padded=sharded_cu, cu_seqlens_kv_padded=sharded_cu,
                                       max_seqlen_q=longest, max_seqlen_kv=longest)
    # The row's tail padding is a document of its own: "real" for the attention, never in the loss.
    return tokens, PackedSeqParams(qkv_format="thd", cu_seqlens_q=sharded_cu, cu_seqlens_kv=sharded_cu,
                                   max_seqlen_q=longest, max_seqlen_kv=longest)
