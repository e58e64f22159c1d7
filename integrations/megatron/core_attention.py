"""``RingSPCoreAttention``: a megatron-core ``core_attention`` submodule running ring_sp.

Megatron's ``SelfAttention`` projects q/k/v (heads already split by tensor parallelism),
applies RoPE to this CP rank's positions and calls ``core_attention(query, key, value,
attention_mask, attn_mask_type=..., attention_bias=..., packed_seq_params=...)`` with
``[s_local, b, heads, head_dim]`` tensors; it expects ``[s_local, b, heads * head_dim]``
back. Packed THD batches come as ``[t_local, heads, head_dim]`` (the batch dim of 1
squeezed) and go back as ``[t_local, heads * head_dim]`` (:mod:`.packed`). Key/value
arrive with the (per-TP-rank) query-group count, not expanded: ring_sp keeps them that way
(only KV heads travel) and expands inside the local kernel.

Attention sinks: ``softmax_type='learnable'`` holds the per-head offset as megatron-core's
``DotProductAttention`` (and TransformerEngine's) does, a parameter ``softmax_offset`` of
this TP rank's heads in ``params_dtype`` with the same sharded checkpoint entry, so
checkpoints move between them; ``'off-by-one'`` is a sink of 0 (a buffer, not saved).
Multi-latent attention (``MLASelfAttention``) hands ``k_channels``/``v_channels`` and a
value head size different from q/k's: ring_sp attends with it as it is.

RoPE on packed (THD) batches: megatron-core's ``SelfAttention`` rotates THD query/key with
``_apply_rotary_pos_emb_thd``, which needs every document to be a multiple of ``2 x CP``
tokens. After :func:`~.rope.install_layout_rope` the rotary hands this module nothing for
THD batches and this module rotates query/key itself, each token by its position inside
its document over ring_sp's ``document_zigzag`` shard (:meth:`~.rope.LayoutRotaryEmbedding.document_angles`),
so documents of any length need no padding.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import _yarn_get_concentration_factor_from_config
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention, make_sharded_tensors_for_checkpoint

from ring_sp import SequenceParallelTopology, hybrid_attention
from ring_sp.integrations.versions import require_supported

from .arguments import megatron_lm_args, ring_sp_config_from_args, sliding_window_from_megatron
from .config import RingSPConfig, unpacked_layout
from .packed import packed_attention_args
from .topology import topology_from_parallel_state


def _default_config() -> RingSPConfig:
    args = megatron_lm_args()
    return ring_sp_config_from_args(args) if args is not None else RingSPConfig()


class RingSPCoreAttention(MegatronModule):
    """Exact causal (or unmasked) attention over Megatron's context-parallel group.

    Built by Megatron from a layer spec with the same arguments as ``DotProductAttention``
    plus, from the spec's params, an optional ``ring_sp_config`` (default: Megatron-LM's
    ``--ring-sp-*`` arguments when running under Megatron-LM, else a pure ring) and an
    optional ``topology`` (default: :func:`topology_from_parallel_state` over
    ``pg_collection.cp``). Inputs must be sharded in ``ring_sp_config.layout`` by CP rank:
    zigzag is what ``get_batch_on_this_cp_rank`` produces, document_zigzag what
    ``get_thd_batch_on_this_cp_rank`` produces for packed sequences. No parameters, except the
    ``softmax_offset`` of ``softmax_type='learnable'`` (one sink logit per head).

    Sliding windows: a layer that Megatron's ``window_size=(left, 0)`` and
    ``window_attn_skip_freq`` make a window layer (``is_layer_window_attention``, as in
    ``DotProductAttention``) attends over ``left + 1`` keys (``sliding_window``; None for
    full layers), exchanging only the halo; other window shapes are refused.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
        ring_sp_config: Optional[RingSPConfig] = None,
        topology: Optional[SequenceParallelTopology] = None,
        k_channels: Optional[int] = None,
        v_channels: Optional[int] = None,
    ) -> None:
        require_supported("megatron-core", "ring_sp.integrations.megatron.RingSPCoreAttention")
        super().__init__(config=config)
        # cp_comm_type picks TransformerEngine's CP algorithm; the head sizes MLA passes are
        # read from the tensors.
        del cp_comm_type, k_channels, v_channels
        ring_sp_config = ring_sp_config if ring_sp_config is not None else _default_config()
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        self._check_supported(config, attention_type, attention_dropout)
        cp_group = pg_collection.cp
        ring_sp_config.check(
            context_parallel_size=cp_group.size(),
            num_attention_heads=config.num_attention_heads,
            num_query_groups=config.num_query_groups,
            tensor_model_parallel_size=pg_collection.tp.size(),
        )
        if topology is None:
            topology = topology_from_parallel_state(
                ring_sp_config, cp_group=cp_group, hcp_groups=getattr(pg_collection, "hcp", None),
                dp_group=getattr(pg_collection, "dp", None), dp_cp_group=getattr(pg_collection, "dp_cp", None),
            )
        elif topology.sp_size != cp_group.size() or topology.sp_rank != cp_group.rank():
            raise ValueError(
                f"topology {topology!r} does not match this rank's context-parallel group "
                f"(size {cp_group.size()}, rank {cp_group.rank()}): its SP group must be the CP group"
            )
        self.attn_mask_type = attn_mask_type
        self.tp_group = pg_collection.tp
        self._init_softmax_offset(config, config.num_attention_heads // pg_collection.tp.size())
        # this layer's window (Gemma 3 / gpt-oss style configs alternate window and full layers)
        self.sliding_window = (sliding_window_from_megatron(config.window_size) if is_layer_window_attention(
            config.window_size, config.window_attn_skip_freq, layer_number) else None)
        self.ring_sp_config = ring_sp_config
        self.topology = topology
        # Megatron's per-layer switch (SelfAttention skips RoPE on these layers too)
        self._no_rope = bool(config.no_rope_freq[layer_number - 1]) if config.no_rope_freq else False
        self._document_rope: tuple = ()  # (LayoutRotaryEmbedding,) once install_layout_rope hands it over
        # None means 1/sqrt(head_dim), as in DotProductAttention. Its
        # apply_query_key_layer_scaling divides the scale by layer_number and multiplies the
        # scores back inside the softmax: a no-op here, where softmax statistics are fp32.
        self.softmax_scale = softmax_scale

    def use_document_rope(self, rope) -> None:
        """Rotate THD query/key here, by :meth:`~.rope.LayoutRotaryEmbedding.document_angles` of
        ``rope`` (called by :func:`~.rope.install_layout_rope`, which also stops the rotary from
        handing ``SelfAttention`` angles for THD batches)."""
        self._document_rope = (rope,)  # a tuple: one rotary shared by every layer, not a submodule of each

    @property
    def document_rope(self):
        """The rotary that rotates THD query/key in this module, or None (Megatron's THD RoPE)."""
        return self._document_rope[0] if self._document_rope else None

    @staticmethod
    def _check_supported(config: TransformerConfig, attention_type: str, attention_dropout: Optional[float]) -> None:
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(
                f"attention_dropout={dropout} (--attention-dropout) is not supported by ring_sp attention, "
                f"which is exact and has no dropout; set it to 0"
            )
        if attention_type != "self":
            raise ValueError(f"attention_type={attention_type!r}: ring_sp supports self-attention only")
        if config.softmax_type not in ("vanilla", "off-by-one", "learnable"):
            raise ValueError(f"softmax_type={config.softmax_type!r} is not one of 'vanilla', 'off-by-one', 'learnable'")
        sliding_window_from_megatron(config.window_size)  # refuses windows that look ahead

    def _init_softmax_offset(self, config: TransformerConfig, heads: int) -> None:
        """``softmax_offset`` ``[heads]`` as megatron-core's DotProductAttention makes it: None
        (vanilla), zeros (off-by-one), or a parameter initialised by ``config.init_method``."""
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        if config.softmax_type == "vanilla":
            self.softmax_offset = None
        elif config.softmax_type == "off-by-one":
            self.register_buffer("softmax_offset", torch.zeros(heads, device=device, dtype=config.params_dtype),
                                 persistent=False)
        else:
            self.softmax_offset = torch.nn.Parameter(torch.empty(heads, device=device, dtype=config.params_dtype))
            if config.perform_initialization:
                config.init_method(self.softmax_offset)

    def sharded_state_dict(
        self,
        prefix: str = "",
        sharded_offsets: Tuple[Tuple[int, int, int], ...] = (),
        metadata: Optional[dict] = None,
    ):
        """The learnable ``softmax_offset``, TP-sharded on dim 0, under DotProductAttention's key."""
        if self.config.softmax_type != "learnable":
            return super().sharded_state_dict(prefix, sharded_offsets, metadata)
        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True), prefix, {"softmax_offset": 0}, sharded_offsets,
            tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"],
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
    ) -> torch.Tensor:
        """query ``[s, b, h, d]``, key ``[s, b, h_kv, d]``, value ``[s, b, h_kv, d_v]`` (this CP
        rank's shard, this TP rank's heads; ``d_v != d`` under MLA) -> context ``[s, b, h * d_v]``;
        with ``packed_seq_params`` in THD format query ``[t, h, d]``, key/value ``[t, h_kv, d]``
        -> ``[t, h * d_v]``. ``softmax_type`` other than vanilla adds the per-head sinks.

        Packed sequences attend inside their documents (``packed_seq_params``'s padded
        boundaries when given). ``attention_mask`` is ignored for the causal mask types
        (Megatron's causal mask is what the ring computes, as with TransformerEngine);
        other masks and attention bias are rejected.
        """
        causal = self._causal(self.attn_mask_type if attn_mask_type is None else attn_mask_type, attention_mask,
                              packed=packed_seq_params is not None)
        if self.sliding_window is not None and not causal:
            raise ValueError(
                f"window_size={self.config.window_size} (sliding window {self.sliding_window}) needs a causal "
                f"attn_mask_type; got {(self.attn_mask_type if attn_mask_type is None else attn_mask_type).name}"
            )
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported by ring_sp attention")
        thd = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        if thd and query.dim() != 3:
            raise ValueError(
                f"packed_seq_params.qkv_format='thd' needs query/key/value as [t, heads, head_dim] (Megatron's "
                f"SelfAttention squeezes the batch dim of 1); got query of shape {tuple(query.shape)}"
            )
        # [s, b, h, d] -> ring_sp's [b, s, h, d]; THD's [t, h, d] is one packed row.
        q, k, v = (t.unsqueeze(0) if thd else t.transpose(0, 1) for t in (query, key, value))
        # At CP = 1 every layout is the identity: contiguous has no length constraint.
        layout = self.ring_sp_config.layout if self.topology.sp_size > 1 else "contiguous"
        cu_seqlens = None
        if packed_seq_params is not None:
            cu_seqlens, layout = packed_attention_args(packed_seq_params, local_len=q.shape[1], batch=q.shape[0],
                                                       sp_group=self.topology.sp_group, layout=layout, causal=causal)
            if thd and self._document_rope and not self._no_rope:
                q, k = self._rotate_documents(q, k, cu_seqlens, layout)
        else:
            layout = unpacked_layout(layout)
        out = hybrid_attention(q, k, v, topology=self.topology, causal=causal, layout=layout,
                               softmax_scale=self.softmax_scale, backend=self.ring_sp_config.backend,
                               cu_seqlens=cu_seqlens, sinks=self.softmax_offset, sliding_window=self.sliding_window,
                               kv_exchange=self.ring_sp_config.kv_exchange)
        return out.reshape(q.shape[1], -1) if thd else out.transpose(0, 1).reshape(query.shape[0], query.shape[1], -1)

    def _rotate_documents(self, q: torch.Tensor, k: torch.Tensor, cu_seqlens: tuple[int, ...],
                          layout: str) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE on THD query ``[1, t, h, d]`` and key ``[1, t, h_kv, d]``: every token at its
        position inside its document (``cu_seqlens``, sharded in ``layout`` by SP rank), with
        megatron-core's ``apply_rotary_pos_emb`` in its per-token (sbhd) form, so the config's
        ``rotary_interleaved`` / ``apply_rope_fusion`` apply as in ``SelfAttention``."""
        angles = self._document_rope[0].document_angles(cu_seqlens, layout, self.topology.sp_size,
                                                        self.topology.sp_rank)  # [t, 1, 1, rotary_dim]
        mscale = _yarn_get_concentration_factor_from_config(self.config)
        # [1, t, h, d] is sbhd with s = 1 and b = t: move t to the sequence dim for the angles
        return tuple(apply_rotary_pos_emb(x.transpose(0, 1), angles, config=self.config, mscale=mscale,
                                          cp_group=self.topology.sp_group).transpose(0, 1) for x in (q, k))

    @staticmethod
    def _causal(mask_type: AttnMaskType, attention_mask: Optional[torch.Tensor], *, packed: bool) -> bool:
        """Causal or not; TransformerEngine's THD mask types (``padding_causal``/``padding``,
        the padding given by the packed boundaries) are accepted with packed sequences."""
        if mask_type == AttnMaskType.causal or (packed and mask_type == AttnMaskType.padding_causal):
            return True
        if mask_type == AttnMaskType.no_mask or (mask_type == AttnMaskType.padding and attention_mask is None):
            return False
        raise ValueError(
            f"attn_mask_type={mask_type.name} with an explicit mask is not supported by ring_sp attention; "
            f"use AttnMaskType.causal or AttnMaskType.no_mask (packed sequences: pass packed_seq_params)"
        )

    def extra_repr(self) -> str:
        t = self.topology
        window = "" if self.sliding_window is None else f", sliding_window={self.sliding_window}"
        return (f"ulysses={t.ulysses_size}, ring={t.ring_size}, layout={self.ring_sp_config.layout!r}, "
                f"backend={self.ring_sp_config.backend!r}, kv_exchange={self.ring_sp_config.kv_exchange!r}{window}")
