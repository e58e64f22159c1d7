"""ring_sp: exact ring attention and ring x Ulysses (2D) sequence parallelism.

Importing this package has no side effects: no process groups, no CUDA, no flash-attn.
"""

from .attention import hybrid_attention, ring_attention, ulysses_attention
from .chunk_prefill import chunk_attention, stored_attention
from .comm import count_communication
from .decode import ShardedKVCache, decode_attention
from .data import IGNORE_INDEX, document_positions, pad_documents, shard_batch, shift_labels
from .layouts import LAYOUT_CHOICES, LAYOUTS, layout_positions
from .sequence_shards import gather_sequence, shard_sequence, unshard_sequence
from .loss import sequence_parallel_cross_entropy, sequence_parallel_loss
from .module import SequenceParallelAttention
from .topology import PLACEMENTS, SequenceParallelTopology, init_sequence_parallel, rank_grid

__version__ = "0.1.0"

__all__ = [
    "IGNORE_INDEX",
    "LAYOUTS",
    "LAYOUT_CHOICES",
    "PLACEMENTS",
    "SequenceParallelAttention",
    "SequenceParallelTopology",
    "ShardedKVCache",
    "chunk_attention",
    "count_communication",
    "decode_attention",
    "document_positions",
    "gather_sequence",
    "hybrid_attention",
    "init_sequence_parallel",
    "layout_positions",
    "pad_documents",
    "rank_grid",
    "ring_attention",
    "sequence_parallel_cross_entropy",
    "sequence_parallel_loss",
    "shard_batch",
    "shard_sequence",
    "shift_labels",
    "stored_attention",
    "ulysses_attention",
    "unshard_sequence",
]
