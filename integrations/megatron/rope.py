"""Rotary embedding sliced for this CP rank by a ring_sp layout, on any device.

``GPTModel`` computes RoPE for the global length ``N = s_local * CP`` and keeps this CP
rank's positions. Megatron-core 0.16.1 does the slicing in ``get_pos_emb_on_this_cp_rank``
(zigzag chunks ``cp_rank`` and ``2*CP-1-cp_rank``, equal to ring_sp's ``zigzag`` layout),
but with a pinned CUDA index tensor, and ``RotaryEmbedding.get_emb`` moves its
frequencies to CUDA: neither runs on a CPU-only machine. :func:`install_layout_rope`
swaps in this module, which takes the positions from :func:`ring_sp.layout_positions`
instead: the same numbers for zigzag, any device, and also the other layouts.

Packed (THD) batches: ``GPTModel`` asks for ``packed_seq=True`` angles of the longest
document (``packed_seq_params.max_seqlen_q``) and does NOT slice them; the attention's
``apply_rotary_pos_emb(..., cu_seqlens=cu_seqlens_q_padded)`` (``_apply_rotary_pos_emb_thd``,
plain torch, so it runs on CPU with ``apply_rope_fusion=False``) then takes, for every
document, this CP rank's zigzag chunks of positions ``0 .. len - 1``: positions restart per
document, in ring_sp's ``document_zigzag`` order. Here the packed call returns the same
unsliced table.
"""

from __future__ import annotations

import torch
from torch import nn

from ring_sp import layout_positions

from .config import unpacked_layout


class LayoutRotaryEmbedding(nn.Module):
    """Drop-in for a ``GPTModel.rotary_pos_emb`` (plain RoPE) that slices by ``layout``.

    ``forward(max_seq_len, offset=0, packed_seq=False, cp_group=None)`` returns this CP
    rank's rotary angles ``[max_seq_len / CP, 1, 1, rotary_dim]`` (the global positions
    of its shard, in its local order), like Megatron's; with ``packed_seq=True`` the angles
    of positions ``0 .. max_seq_len - 1`` ``[max_seq_len, 1, 1, rotary_dim]``, which
    Megatron's THD RoPE slices per document and CP rank. ``document_zigzag`` slices
    unpacked batches as ``zigzag`` (one document). Holds no parameters or buffers.
    """

    def __init__(self, rotary: nn.Module, *, layout: str, cp_group: torch.distributed.ProcessGroup | None,
                 device: torch.device) -> None:
        super().__init__()
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

        if type(rotary) is not RotaryEmbedding:  # YaRN/mRoPE return other shapes
            raise TypeError(f"only megatron-core's plain RotaryEmbedding can be replaced; got {type(rotary).__name__}")
        self.rotary = rotary
        self.layout = layout
        self.cp_group = cp_group
        self.device = torch.device(device)
        self._last: tuple[tuple[int, int, bool], torch.Tensor] | None = None  # one length per run: cache it

    def get_rotary_seq_len(self, *args, **kwargs) -> int:
        """The global length to compute RoPE for (Megatron's rule, unchanged). Refuses THD
        documents that megatron-core's THD RoPE cannot slice (see :func:`check_thd_rope_documents`)."""
        params = kwargs.get("packed_seq_params", args[4] if len(args) > 4 else None)
        group = self.cp_group
        if params is not None and params.qkv_format == "thd" and group is not None:
            check_thd_rope_documents(params, group.size())
        return self.rotary.get_rotary_seq_len(*args, **kwargs)

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False,
                cp_group: torch.distributed.ProcessGroup | None = None) -> torch.Tensor:
        if self._last is not None and self._last[0] == (max_seq_len, offset, packed_seq):
            return self._last[1]
        rotary = self.rotary
        if rotary.inv_freq.device != self.device:
            rotary.inv_freq = rotary.inv_freq.to(self.device)
        freqs = rotary.get_freqs_non_repeated(max_seq_len, offset)  # [N, rotary_dim / 2]
        if rotary.rotary_interleaved:
            emb = torch.stack((freqs, freqs), dim=-1).flatten(-2)  # f0 f0 f1 f1 ...
        else:
            emb = torch.cat((freqs, freqs), dim=-1)  # f0 f1 ... f0 f1 ...
        group = cp_group if cp_group is not None else self.cp_group
        if group is not None and group.size() > 1 and not packed_seq:
            positions = layout_positions(unpacked_layout(self.layout), group.size(), max_seq_len)[group.rank()]
            emb = emb.index_select(0, positions.to(emb.device))
        emb = emb[:, None, None, :]
        self._last = ((max_seq_len, offset, packed_seq), emb)
        return emb


def check_thd_rope_documents(params, cp_size: int) -> None:
    """megatron-core's THD RoPE (``_apply_rotary_pos_emb_thd``) splits a CP rank's tokens
    into ``len // cp_size`` per document (``cu_seqlens_q_padded``, else ``cu_seqlens_q``) and
    each piece into two equal zigzag halves: every document must be a multiple of
    ``2 x cp_size`` tokens, or its rotations land on the wrong tokens (or torch.split fails)."""
    if cp_size <= 1:
        return
    cu = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
    lengths = cu.diff().tolist()
    bad = next((i for i, n in enumerate(lengths) if n % (2 * cp_size)), None)
    if bad is not None:
        raise ValueError(
            f"packed_seq_params: document {bad} has {lengths[bad]} tokens, not a multiple of 2 x context-parallel "
            f"size = {2 * cp_size}; megatron-core's THD RoPE slices every document into 2 x CP equal chunks. Pad "
            f"each document (thd_batch_on_this_cp_rank(..., per_document_padding=True), the default), or train "
            f"without rotary embeddings (position_embedding_type='learned_absolute' or 'none') to keep documents unpadded"
        )


def install_layout_rope(model: nn.Module, *, layout: str = "zigzag", device: torch.device | str | None = None) -> None:
    """Replace ``model.rotary_pos_emb`` (a megatron-core ``GPTModel``) by :class:`LayoutRotaryEmbedding`.

    Needed on CPU (megatron-core's RoPE calls CUDA) and for layouts other than zigzag and
    document_zigzag; on GPUs with those two Megatron's own RoPE gives the same angles.
    ``device`` defaults to the model's parameters' device.
    """
    rotary = getattr(model, "rotary_pos_emb", None)
    if rotary is None:
        raise ValueError("model has no rotary_pos_emb: build GPTModel with position_embedding_type='rope'")
    if isinstance(rotary, LayoutRotaryEmbedding):
        rotary = rotary.rotary
    if device is None:
        device = next(model.parameters()).device
    model.rotary_pos_emb = LayoutRotaryEmbedding(rotary, layout=layout, cp_group=rotary.cp_group, device=device)
