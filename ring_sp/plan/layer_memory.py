"""One layer's memory on one rank: what it keeps for its backward and what its backward holds.

Counts in bytes for ``n`` tokens on the rank, from the modules' saved tensors:

* transformers' modules (``kernels="hf"``): RMSNorm keeps its fp32 input and normalised value
  plus its output (8 bytes per hidden unit, fp32 and bf16 alike), RoPE the rotated q / k,
  the gated MLP gate, up, activation and product;
* Liger's (``kernels="fused"``): RMSNorm its output and one fp32 rstd per row (its input is
  the residual stream, kept anyway), RoPE nothing, SwiGLU gate and up (the product is
  ``down_proj``'s input);
* ring_sp's lean layers (``lean_layers=True``): RMSNorm as Liger's, RoPE nothing beyond
  positions, an untiled gated MLP gate and up only (act and product recomputed); a tiled MLP
  keeps its norm's input instead of its output (the norm runs again per tile);
* the attention: ring_sp's (:func:`ring_sp.plan.layer_cost.attention_memory`; with head
  chunks, :func:`ring_sp_attention`) or ALST's (:func:`alst_attention_memory`).

Nothing here grows with the GLOBAL sequence: every term is per token on the rank, or per
parameter (position ids, int64 per local token, are below the model's resolution).
"""

from __future__ import annotations

import math

from ..shapes import GATED_MLP_TILE_TENSORS, LOSS_TILE_TENSORS, auto_tile_tokens, kv_heads_per_rank
from .layer_cost import attention_memory
from .head_chunk_choice import choose_head_chunks
from .request import DTYPES, PlanError, dtype_bytes
from .training import HEAD_CHUNKS_AUTO, Training
from .transformer import Transformer

FP32 = 4
ALST_LOSS_TILE_BYTES = 2**30  # ALST sizes its loss tiles to 1 GiB of fp32 logits


def pieces(training: Training) -> str:
    """Whose norm / RoPE / MLP modules run: "hf", "fused" (Liger's, which lean layers leave in
    place) or "lean" (ring_sp's)."""
    return "lean" if training.lean_layers and training.kernels == "hf" else training.kernels


def norm_kept(model: Transformer, training: Training) -> int:
    """Bytes one RMSNorm keeps per token (its input, the residual stream, is counted there)."""
    e, _ = dtype_bytes(training.dtype)
    return 2 * FP32 * model.hidden if pieces(training) == "hf" else e * model.hidden + FP32


def mlp_renormalises(training: Training) -> bool:
    """Whether the MLP's norm output is kept by nobody: ring_sp's tiled MLP fed by a lean norm keeps
    the norm's input (the residual, counted there) and normalises each tile again
    (:func:`ring_sp.tiling.rowwise_origin`), so that norm keeps nothing of its own."""
    return training.library == "ring_sp" and training.tiled_mlp and pieces(training) == "lean"


def mlp_kept(model: Transformer, training: Training) -> int:
    """Bytes an untiled gated MLP keeps per token beyond its input: hf gate, up, act, product;
    Liger gate, up and the product (down_proj's input); lean gate and up."""
    e, _ = dtype_bytes(training.dtype)
    return {"hf": 4, "fused": 3, "lean": 2}[pieces(training)] * e * model.ffn


def head_chunk_count(model: Transformer, training: Training, ulysses: int, *, n: int | None = None,
                     ring: int = 1) -> int:
    """Chunks of heads ring_sp's attention runs in (1 for ALST and unchunked). A chunk holds
    whole GQA groups, so at most the KV heads a rank holds after the all-to-all; "auto" is the
    runtime's own choice for ``n`` tokens on the rank (:func:`.head_chunk_choice.choose_head_chunks`;
    ``n`` None: the finest split, what it takes at long context)."""
    if training.library != "ring_sp" or training.head_chunks in (None, 1):
        return 1
    most = kv_heads_per_rank(model.kv_heads, ulysses)
    if training.head_chunks == HEAD_CHUNKS_AUTO:
        if n is None:
            return most
        return choose_head_chunks(ulysses=ulysses, ring=ring, batch=1, local_len=n, heads=model.heads,
                                  kv_heads=model.kv_heads, head_dim=model.head_dim, value_head_dim=model.head_dim,
                                  dtype=DTYPES[training.dtype])
    if training.head_chunks > most:
        raise PlanError(f"head-chunks={training.head_chunks} exceeds the {most} KV head(s) a rank holds at "
                        f"U={ulysses} ({model.kv_heads} KV heads): a chunk holds whole GQA groups; use at most "
                        f"{most}, or 'auto'")
    return training.head_chunks


def alst_attention_memory(model: Transformer, *, n: int, ulysses: int, dtype: str) -> tuple[float, float]:
    """(kept, backward working) bytes of one layer's attention in ALST on ``n`` tokens per rank:
    ``UlyssesSPAttentionHF`` all-to-alls q, k, v to head layout (KV heads replicated up to one
    per rank when fewer than ``ulysses``) and the output back; flash-attention 2 keeps its
    inputs, output and lse, and in the backward holds an fp32 dq accumulator and, for GQA,
    dk / dv expanded to the q heads; the output is kept again in sequence layout (o_proj's input)."""
    e, _ = dtype_bytes(dtype)
    q = n * model.q_width  # elements of q (or out, dq) on this rank in either layout
    m = max(1, model.kv_heads // ulysses)
    kv = 2 * n * ulysses * m * model.head_dim  # k and v after the all-to-all
    lse = n * model.heads * FP32
    kept = e * (q + kv + q + q) + lse  # q, k, v and out in head layout; out in sequence layout
    expanded = model.heads // ulysses > m  # flash-attention 2 expands dk / dv to the q heads (GQA)
    working = e * q * 2 + FP32 * q + e * q + e * (2 * q if expanded else kv)  # dout x 2 layouts, dq accum, dq, dk/dv
    return kept, working


def o_proj_input_bytes(model: Transformer, training: Training, *, n: int, ulysses: int) -> float:
    """Bytes o_proj keeps of ring_sp's attention output beyond what the attention keeps: with
    Ulysses the sequence-layout copy (the all-to-all's result) beside the head-layout one the
    ring keeps; without it the two are the same tensor (0). Freed by o_proj's backward, before
    the attention's backward runs."""
    return dtype_bytes(training.dtype)[0] * n * model.q_width if ulysses > 1 else 0


def _rounded(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def kernel_backward(model: Transformer, training: Training, *, rows: int, heads: int, kv_heads: int) -> float:
    """Bytes ONE backward call of the attention kernel allocates over ``rows`` queries and keys of
    ``heads`` q / ``kv_heads`` KV heads: its dq, dk, dv and its own workspace.

    ``attention_kernel="cpu"`` (torch's CPU flash op): the gradients, fp32 for bf16 / fp16 inputs
    (it computes in fp32), and per-thread scratch only. ``"flash"``: flash-attention 2's backward
    (``mha_bwd``: Dao-AILab/flash-attention ``csrc/flash_attn/flash_api.cpp``, and PyTorch's port
    ``aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp``, which ring_sp's ``torch``
    backend and SDPA's flash backend call on CUDA): dq, dk, dv in the input dtype, an fp32 dq
    accumulator ``[b, s_q rounded up to 128, h, d rounded up to 32]``, ``softmax_d`` fp32
    ``[b, h, s_q rounded]`` and, for GQA, dk and dv expanded to the q heads ``[b, s_k, h, d]`` in
    the input dtype (summed into dk, dv at the end)."""
    e, acc = dtype_bytes(training.dtype)
    d = model.head_dim
    if training.attention_kernel == "cpu":
        return acc * rows * d * (heads + 2 * kv_heads)
    gradients = e * rows * d * (heads + 2 * kv_heads)
    dq_accum = FP32 * _rounded(rows, 128) * heads * _rounded(d, 32)
    softmax_d = FP32 * heads * _rounded(rows, 128)
    expanded = 2 * e * rows * heads * d if heads > kv_heads else 0
    return gradients + dq_accum + softmax_d + expanded


def kernel_workspace(model: Transformer, training: Training, *, n: int, ulysses: int) -> float:
    """Bytes ring_sp's attention kernel holds in ONE backward call over the rank's largest block
    (``n x U`` tokens of ``heads / U`` q heads against as many KV rows) beyond the fp32 dq, dk,
    dv of that block that :func:`attention_memory` counts (:func:`kernel_backward`); 0 for the
    CPU kernel. The GPU run showed the term: without it ring_sp's one-rank model was 1.21x low
    wherever a layer's backward, not the loss, was the step's peak (issue 40)."""
    e, acc = dtype_bytes(training.dtype)
    rows, heads = n * ulysses, model.heads // ulysses
    kv_heads = kv_heads_per_rank(model.kv_heads, ulysses)
    counted = acc * rows * model.head_dim * (heads + 2 * kv_heads)
    return kernel_backward(model, training, rows=rows, heads=heads, kv_heads=kv_heads) - counted


def alst_one_gpu_attention(model: Transformer, training: Training, *, n: int) -> tuple[float, float]:
    """(kept, backward working) bytes of one layer's attention in ALST's one-GPU recipe
    (``sequence_parallel_size: 1``: transformers' attention, no all-to-all): the attention keeps
    q and k after RoPE, v, its output and lse (RoPE, transformers' or Liger's, keeps only cos /
    sin); o_proj's input is that output itself where the kernel writes it in sequence layout
    (flash-attention 2), a contiguous copy otherwise (the CPU op). The backward holds dout and one
    kernel call (:func:`kernel_backward`)."""
    e, _ = dtype_bytes(training.dtype)
    q, kv = n * model.q_width, n * model.kv_width
    out_copy = e * q if training.attention_kernel == "cpu" else 0
    kept = e * (q + 2 * kv + q) + out_copy + FP32 * n * model.heads
    working = e * q + kernel_backward(model, training, rows=n, heads=model.heads, kv_heads=model.kv_heads)
    return kept, working


def ring_sp_attention(model: Transformer, training: Training, *, n: int, ulysses: int, ring: int
                      ) -> tuple[float, float]:
    """(kept, backward working) bytes of ring_sp's attention on this rank, q / k / v in sequence
    layout included. Unchunked: :func:`attention_memory` (with Ulysses the head-layout q, packed
    k / v, out and lse are kept, and o_proj keeps the sequence-layout out; without it the ring
    keeps q, k, v themselves, its out is o_proj's input). In ``k`` head
    chunks: the sequence-layout q, k, v and out (o_proj's input, the same tensor) and lse are
    kept once; the backward fills whole sequence-layout dq, dk, dv one chunk at a time, and the
    largest chunk's share of the unchunked working set exists at once, plus its head-layout
    q, out (and dout, already in the working set), its k / v after the all-to-all and one
    all-to-all's send copy (without Ulysses: contiguous copies of the chunk's q, out, dout)."""
    e, acc = dtype_bytes(training.dtype)
    q, kv = model.q_width, model.kv_width
    mem = attention_memory(ulysses=ulysses, ring=ring, batch=1, local_len=n, heads=model.heads,
                           kv_heads=model.kv_heads, head_dim=model.head_dim, dtype=training.dtype)
    chunks = head_chunk_count(model, training, ulysses, n=n, ring=ring)
    o_proj_input = o_proj_input_bytes(model, training, n=n, ulysses=ulysses)
    workspace = kernel_workspace(model, training, n=n, ulysses=ulysses)
    if chunks == 1:
        # without Ulysses the ring keeps q, k, v (rotation keeps no input); with it the
        # all-to-all keeps nothing and the head-layout copies are in mem.kept
        return (e * n * (q + 2 * kv) if ulysses == 1 else o_proj_input) + mem.kept, mem.working + workspace
    m = kv_heads_per_rank(model.kv_heads, ulysses)
    share = math.ceil(m / chunks) / m  # the largest chunk's share of the rank's heads
    kv_shard = 2 * n * ulysses * m * model.head_dim  # packed [k; v] in head layout, all chunks
    kept = e * n * (2 * q + 2 * kv) + n * model.heads * acc + o_proj_input
    per_chunk = mem.working + workspace + e * (3 * n * q + (kv_shard if ulysses > 1 else 0))
    return kept, e * n * (q + 2 * kv) + share * per_chunk


def recompute_entry(model: Transformer, training: Training, *, n: int, ulysses: int, ring: int) -> float:
    """Bytes one checkpointed ring_sp attention keeps on the device from its first run to its
    backward (:attr:`Training.keeps_recompute_entries`): its out and lse, and the fingerprint; 0 if none."""
    if not training.keeps_recompute_entries:
        return 0.0
    return attention_memory(ulysses=ulysses, ring=ring, batch=1, local_len=n, heads=model.heads,
                            kv_heads=model.kv_heads, head_dim=model.head_dim, dtype=training.dtype).kept_checkpointed


def attention(model: Transformer, training: Training, *, n: int, ulysses: int, ring: int) -> tuple[float, float]:
    """(kept, backward working) bytes of one layer's attention on this rank, either library."""
    if training.library == "alst":
        if ring != 1:
            raise PlanError("ALST has no ring: its sequence-parallel degree is the Ulysses size (ring=1)")
        if ulysses == 1:
            return alst_one_gpu_attention(model, training, n=n)
        return alst_attention_memory(model, n=n, ulysses=ulysses, dtype=training.dtype)
    return ring_sp_attention(model, training, n=n, ulysses=ulysses, ring=ring)


def layer_kept(model: Transformer, training: Training, *, n: int, ulysses: int, ring: int) -> float:
    """Bytes one layer keeps for its backward (no checkpointing), ``n`` tokens on this rank,
    its output (the next layer's input) included; the MLP's norm keeps nothing when the tiled
    MLP normalises its tiles again (:func:`mlp_renormalises`)."""
    e, _ = dtype_bytes(training.dtype)
    residual = e * model.hidden  # the residual after attention; the layer's output below
    mlp = 0 if training.tiled_mlp else mlp_kept(model, training)
    kept_attention = attention(model, training, n=n, ulysses=ulysses, ring=ring)[0]
    norms = (1 if mlp_renormalises(training) else 2) * norm_kept(model, training)
    return n * (norms + 2 * residual + mlp) + kept_attention


def mlp_tile(model: Transformer, training: Training, n: int) -> int:
    """Tokens per MLP tile (``n`` untiled)."""
    if not training.tiled_mlp:
        return n
    if training.mlp_tile_tokens is not None:
        return min(n, training.mlp_tile_tokens)
    if training.library == "alst":  # ALST: ceil(n / hidden) tiles
        return math.ceil(n / math.ceil(n / model.hidden))
    width = dtype_bytes(training.dtype)[0]  # ring_sp sizes the tile: its working set no larger than [n, hidden]
    return auto_tile_tokens(n, kept_width=model.hidden, kept_bytes=width, tile_width=GATED_MLP_TILE_TENSORS * model.ffn,
                            tile_bytes=width)


def loss_tile(model: Transformer, training: Training, n: int) -> int:
    """Tokens per loss tile (``n`` untiled); Liger's own chunks are :func:`liger_chunk`."""
    if not training.tiled_loss:
        return n
    if training.loss_tile_tokens is not None:
        return min(n, training.loss_tile_tokens)
    if training.library == "alst":
        return min(n, max(1, ALST_LOSS_TILE_BYTES // (FP32 * model.vocab)))
    # ring_sp sizes the tile: its fp32 logits and their gradient no larger than the [n, hidden] hidden state
    return auto_tile_tokens(n, kept_width=model.hidden, kept_bytes=dtype_bytes(training.dtype)[0],
                            tile_width=LOSS_TILE_TENSORS * model.vocab, tile_bytes=FP32)


def liger_chunk(model: Transformer, n: int) -> int:
    """Tokens per chunk of Liger's fused linear cross entropy (liger_kernel/ops/
    fused_linear_cross_entropy.py): ``next_power_of_2(ceil(n / ceil(vocab / hidden)))``, at most n."""
    chunk = math.ceil(n / math.ceil(model.vocab / model.hidden))
    return min(n, 1 << max(0, chunk - 1).bit_length())


def loss_phase(model: Transformer, training: Training, n: int) -> float:
    """The loss's peak on top of what the step keeps.

    Untiled, at its backward: log-softmax's fp32 output and two fp32 gradients of ``[n, vocab]``.
    ring_sp tiled (``tiling.py``): one tile's fp32 logits and their gradient (plus the head's
    output and its gradient in the model dtype when it is not fp32), the head's gradient summed
    into ONE fp32 accumulator by GEMMs on the model's dtype (:func:`ring_sp.gemm.accumulate_matmul`:
    on CUDA straight into it; elsewhere a product in row blocks of at most one ``[t, vocab]``
    tensor in the model dtype, made after the tile's fp32 logits and gradient are freed, so
    within their bytes), the ``[n, hidden]`` input gradient. ALST's tiled loss:
    cross entropy's own backward per tile (three fp32 ``[t, vocab]``; each tile's head gradient
    added to .grad after they are freed). Liger's fused linear cross entropy (ALST with Liger):
    one chunk's logits in the model dtype (the gradient is written in place), the input gradient,
    the head's gradient in the parameter's dtype and an fp32 loss per token, all taken in the
    forward. Plus the final norm's kept tensors and, under ZeRO-3, the gathered head.
    """
    e, _ = dtype_bytes(training.dtype)
    h, v = model.hidden, model.vocab
    final = n * (2 * FP32 * h if pieces(training) == "hf" else e * h)
    t = loss_tile(model, training, n)
    if training.liger_loss:
        logits = liger_chunk(model, n) * v * e + n * e * h + v * h * e + n * FP32
    elif not training.tiled_loss:
        logits = t * v * 3 * FP32
    elif training.library == "ring_sp":
        logits = t * v * (2 * FP32 + (2 * e if e != FP32 else 0)) + v * h * FP32 + n * e * h
    else:
        logits = t * v * 3 * FP32 + n * e * h
    head = v * h * e if training.zero_stage >= 3 else 0.0
    return final + logits + head


def mlp_gradient_sums(model: Transformer, training: Training) -> int:
    """Bytes of ring_sp's tiled MLP's weight-gradient sums during its backward: the three
    ``[ffn, hidden]`` weights' gradients summed over the tiles in fp32 (fp64 for fp64)
    (:func:`ring_sp.tiling.tiled_map`). Their GEMMs on the model's dtype add nothing beyond the
    tile's working set: on CUDA they write into the sums (``out_dtype``), elsewhere each one's
    product comes in row blocks no larger than one ``[tile, ffn]`` tensor, written while that
    working set is short of its peak by one (:func:`ring_sp.gemm.accumulate_matmul`)."""
    if training.library != "ring_sp" or not training.tiled_mlp:
        return 0
    return 3 * model.ffn * model.hidden * max(FP32, dtype_bytes(training.dtype)[0])


def layer_backward_phase(model: Transformer, training: Training, *, n: int, ulysses: int, ring: int,
                         recompute: float) -> float:
    """One layer's backward: the incoming gradient and the residual's, the layer's activations
    (``recompute``: its kept tensors when checkpointed, else 0) and the larger of the MLP's
    working set (two ``[tokens, ffn]`` gradients; tiled: one tile's activations and gradients,
    the ``[n, hidden]`` input gradient and output the tiles fill, ring_sp's fp32 weight-gradient
    sums) and the attention's backward."""
    e, _ = dtype_bytes(training.dtype)
    h = model.hidden
    tile = mlp_tile(model, training, n)
    # lean recomputes act and product; ALST tiles transformers' MLP (ArcticTraining turns Liger's SwiGLU off under
    # TiledMLP: arctic_training/model/liger_factory.py)
    mlp_pieces = "hf" if training.library == "alst" and training.tiled_mlp else pieces(training)
    acts = {"hf": 4, "fused": 3, "lean": 4}[mlp_pieces] * e * model.ffn
    mlp = 2 * e * model.ffn * tile + ((acts * tile + 2 * n * e * h) if training.tiled_mlp else 0)
    mlp += mlp_gradient_sums(model, training)
    if mlp_renormalises(training):  # the tile's norm again, under autograd: its fp32 rows and normalised rows
        mlp += 2 * FP32 * h * tile
    att = attention(model, training, n=n, ulysses=ulysses, ring=ring)[1]
    if training.library == "ring_sp":  # o_proj's backward has freed its input by then
        att -= o_proj_input_bytes(model, training, n=n, ulysses=ulysses)
    return 2 * n * e * h + recompute + max(mlp, att)


__all__ = ["ALST_LOSS_TILE_BYTES", "alst_attention_memory", "alst_one_gpu_attention", "attention", "head_chunk_count",
           "kernel_backward", "kernel_workspace", "layer_backward_phase", "layer_kept", "liger_chunk", "loss_phase",
           "loss_tile", "mlp_gradient_sums", "mlp_kept", "mlp_renormalises", "mlp_tile", "norm_kept",
           "o_proj_input_bytes", "pieces", "recompute_entry", "ring_sp_attention"]
