"""Rotary embedding sliced for this CP rank by a ring_sp layout, on any device.

``GPTModel`` computes RoPE for the global length ``N = s_local * CP`` and keeps this CP
rank's positions. Megatron-core 0.16.1 does the slicing in ``get_pos_emb_on_this_cp_rank``
(zigzag chunks ``cp_rank`` and ``2*CP-1-cp_rank``, equal to ring_sp's ``zigzag`` layout),
but with a pinned CUDA index tensor, and ``RotaryEmbedding.get_emb`` moves its
frequencies to CUDA: neither runs on a CPU-only machine. :func:`install_layout_rope`
swaps in this module, which takes the positions from :func:`ring_sp.layouts.rank_positions`
instead: the same numbers for zigzag, any device, and also the other layouts.

Packed (THD) batches: ``GPTModel`` asks for ``packed_seq=True`` angles of the longest
document (``packed_seq_params.max_seqlen_q``) and does NOT slice them; the attention's
``apply_rotary_pos_emb(..., cu_seqlens=cu_seqlens_q_padded)`` (``_apply_rotary_pos_emb_thd``)
then takes, for every document, this CP rank's two zigzag halves of positions
``0 .. len - 1``, assuming each document is a multiple of ``2 x CP`` tokens. ring_sp's
``document_zigzag`` splits documents of ANY length (chunks of ``c`` or ``c + 1`` tokens), so
when every attention layer is ring_sp's, :func:`install_layout_rope` moves the THD rotation
into :class:`~.core_attention.RingSPCoreAttention`: the packed call here returns None (Megatron's
``SelfAttention`` then rotates nothing) and the core attention rotates query and key by
:meth:`LayoutRotaryEmbedding.document_angles`, the angles of each of its tokens' position
inside its document (the shard's GLOBAL positions), with megatron-core's own
``apply_rotary_pos_emb`` in its unpacked (per-token) form. Unpadded documents then need no
padding at all; padded ones get the same rotations as megatron-core's THD split.
"""

from __future__ import annotations

import torch
from torch import nn

from ring_sp.layouts import Boundaries, rank_positions

from .config import unpacked_layout

# GPTModel's rotary classes other than plain RoPE, by the position_embedding_type that builds them
_OTHER_ROTARIES = {"YarnRotaryEmbedding": "yarn", "MultimodalRotaryEmbedding": "mrope"}


class LayoutRotaryEmbedding(nn.Module):
    """Drop-in for a ``GPTModel.rotary_pos_emb`` (plain RoPE) that slices by ``layout``.

    ``forward(max_seq_len, offset=0, packed_seq=False, cp_group=None)`` returns this CP
    rank's rotary angles ``[max_seq_len / CP, 1, 1, rotary_dim]`` (the global positions
    of its shard, in its local order), like Megatron's; with ``packed_seq=True`` the angles
    of positions ``0 .. max_seq_len - 1`` ``[max_seq_len, 1, 1, rotary_dim]``, which
    Megatron's THD RoPE slices per document and CP rank, or None when ``rotates_documents``
    (set by :func:`install_layout_rope`): then the ring_sp core attention rotates THD tokens
    itself by :meth:`document_angles`. ``document_zigzag`` slices unpacked batches as
    ``zigzag`` (one document). Holds no parameters or buffers.
    """

    def __init__(self, rotary: nn.Module, *, layout: str, cp_group: torch.distributed.ProcessGroup | None,
                 device: torch.device) -> None:
        super().__init__()
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

        if type(rotary) is not RotaryEmbedding:  # YaRN/mRoPE return other shapes
            kind = _OTHER_ROTARIES.get(type(rotary).__name__)
            option = f"position_embedding_type={kind!r} ({type(rotary).__name__})" if kind else type(rotary).__name__
            raise TypeError(
                f"{option} is not supported by ring_sp's rotary embedding: only megatron-core's plain "
                f"RotaryEmbedding (position_embedding_type='rope') can be replaced"
            )
        self.rotary = rotary
        self.layout = layout
        self.cp_group = cp_group
        self.device = torch.device(device)
        self.rotates_documents = False  # True: THD tokens are rotated by the core attention
        self._last: tuple[tuple, torch.Tensor] | None = None  # one length per run: cache it
        self._last_documents: tuple[tuple, torch.Tensor] | None = None

    def get_rotary_seq_len(self, *args, **kwargs) -> int:
        """The global length to compute RoPE for (Megatron's rule, unchanged). Refuses THD
        documents that megatron-core's THD RoPE cannot slice (see :func:`check_thd_rope_documents`)
        unless the core attention rotates them."""
        params = kwargs.get("packed_seq_params", args[4] if len(args) > 4 else None)
        group = self.cp_group
        if params is not None and params.qkv_format == "thd" and group is not None and not self.rotates_documents:
            check_thd_rope_documents(params, group.size())
        return self.rotary.get_rotary_seq_len(*args, **kwargs)

    def _angles(self, positions: torch.Tensor | None, length: int, offset: int = 0) -> torch.Tensor:
        """Angles ``[len(positions), rotary_dim]`` of ``positions + offset`` (None: ``0 .. length - 1``),
        row for row Megatron's ``get_freqs_non_repeated`` table at those positions, without the table:
        a rank computes its own N / P rows only."""
        rotary = self.rotary
        if rotary.inv_freq.device != self.device:
            rotary.inv_freq = rotary.inv_freq.to(self.device)
        if positions is None:
            freqs = rotary.get_freqs_non_repeated(length, offset)  # [length, rotary_dim / 2]
        else:  # Megatron's ops on this rank's positions (exact integers in fp32 below 2^24)
            seq = positions.to(device=self.device, dtype=rotary.inv_freq.dtype) + offset
            if rotary.seq_len_interpolation_factor is not None:
                seq *= 1 / rotary.seq_len_interpolation_factor
            freqs = torch.outer(seq, rotary.inv_freq)
        if rotary.rotary_interleaved:
            return torch.stack((freqs, freqs), dim=-1).flatten(-2)  # f0 f0 f1 f1 ...
        return torch.cat((freqs, freqs), dim=-1)  # f0 f1 ... f0 f1 ...

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False,
                cp_group: torch.distributed.ProcessGroup | None = None) -> torch.Tensor | None:
        if packed_seq and self.rotates_documents:
            return None  # the ring_sp core attention rotates each token by its document position
        group = cp_group if cp_group is not None else self.cp_group
        sharded = group is not None and group.size() > 1 and not packed_seq
        key = (max_seq_len, offset, packed_seq, group.size() if sharded else 1, group.rank() if sharded else 0)
        if self._last is not None and self._last[0] == key:  # one length per run: every layer asks alike
            return self._last[1]
        # packed (THD) for Megatron's own RoPE: positions 0 .. max_seq_len - 1, which it slices per document
        positions = (rank_positions(unpacked_layout(self.layout), group.size(), max_seq_len, group.rank())
                     if sharded else None)
        emb = self._angles(positions, max_seq_len, offset)[:, None, None, :]
        self._last = (key, emb)
        return emb

    def document_angles(self, cu_seqlens: Boundaries, layout: str, sp_size: int, sp_rank: int) -> torch.Tensor:
        """The angles ``[N / sp_size, 1, 1, rotary_dim]`` of this rank's THD shard: token j of
        the shard (``layout`` over ``sp_size`` ranks of the packed row with document boundaries
        ``cu_seqlens``, ``N = cu_seqlens[-1]``) at its position inside its document, as if the
        document ran alone from position 0. Any document lengths. Cached for the last packing
        (every layer of a step asks for the same one)."""
        key = (cu_seqlens, layout, sp_size, sp_rank)
        if self._last_documents is not None and self._last_documents[0] == key:
            return self._last_documents[1]
        positions = rank_positions(layout, sp_size, cu_seqlens[-1], sp_rank, cu_seqlens, in_document=True)
        angles = self._angles(positions, len(positions))[:, None, None, :]
        self._last_documents = (key, angles)
        return angles


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
            f"size = {2 * cp_size}; megatron-core's THD RoPE slices every document into 2 x CP equal chunks. Use "
            f"ring_sp's core attention in every layer (get_gpt_layer_ring_sp_spec) and install_layout_rope(model), "
            f"which rotate each token by its position inside its document (any length); or pad each document "
            f"(thd_batch_on_this_cp_rank(..., per_document_padding=True)); or train without rotary embeddings "
            f"(position_embedding_type='learned_absolute' or 'none')"
        )


def install_layout_rope(model: nn.Module, *, layout: str = "zigzag", device: torch.device | str | None = None) -> None:
    """Replace ``model.rotary_pos_emb`` (a megatron-core ``GPTModel``) by :class:`LayoutRotaryEmbedding`.

    Needed on CPU (megatron-core's RoPE calls CUDA), for layouts other than zigzag and
    document_zigzag, and for packed (THD) documents of any length: when every attention
    layer's ``core_attention`` is a :class:`~.core_attention.RingSPCoreAttention`, each is
    handed the rotary and rotates THD query/key itself by the positions of its shard inside
    their documents (megatron-core's THD RoPE needs documents of multiples of ``2 x CP``).
    ``device`` defaults to the model's parameters' device. Raises ``ValueError`` for
    ``apply_rope_fusion=True`` where TransformerEngine's fused RoPE cannot run (CPU, or
    TransformerEngine missing), and for a mix of ring_sp and other core attentions.
    """
    from megatron.core.transformer.attention import Attention

    # deferred like megatron itself: .core_attention imports megatron-core at its top (no circle)
    from .core_attention import RingSPCoreAttention

    rotary = getattr(model, "rotary_pos_emb", None)
    if rotary is None:
        raise ValueError("model has no rotary_pos_emb: build GPTModel with position_embedding_type='rope'")
    if isinstance(rotary, LayoutRotaryEmbedding):
        rotary = rotary.rotary
    if device is None:
        device = next(model.parameters()).device
    _check_rope_fusion(model.config, torch.device(device))
    layout_rope = LayoutRotaryEmbedding(rotary, layout=layout, cp_group=rotary.cp_group, device=device)
    cores = [m.core_attention for m in model.modules() if isinstance(m, Attention)]
    ours = [c for c in cores if isinstance(c, RingSPCoreAttention)]
    if ours and len(ours) != len(cores):
        raise ValueError(
            f"{len(ours)} of the model's {len(cores)} attention layers use RingSPCoreAttention: with rotary "
            f"embeddings on packed (THD) batches either every layer or none must, since ring_sp's layers rotate "
            f"their own query/key; build every layer from get_gpt_layer_ring_sp_spec"
        )
    for core in ours:
        core.use_document_rope(layout_rope)
    layout_rope.rotates_documents = bool(ours)
    model.rotary_pos_emb = layout_rope


def _check_rope_fusion(config, device: torch.device) -> None:
    """``apply_rope_fusion`` runs TransformerEngine's CUDA kernel: refuse it where it cannot run."""
    from megatron.core.models.common.embeddings import rope_utils

    if getattr(config, "apply_rope_fusion", False) and (device.type != "cuda" or rope_utils.fused_apply_rotary_pos_emb is None):
        where = "on CPU" if device.type != "cuda" else "without TransformerEngine"
        raise ValueError(
            f"apply_rope_fusion=True (TransformerConfig; Megatron-LM's default, turned off by --no-rope-fusion) "
            f"needs TransformerEngine's fused RoPE on CUDA and cannot run {where}; set apply_rope_fusion=False "
            f"(--no-rope-fusion)"
        )
