"""Sequence tiling: per-token work over tiles of tokens, so one tile's intermediates exist at a time.

At long context the per-token parts of a training step, not attention, hold the most memory:
the ``[tokens, vocab]`` logits of the loss and the ``[tokens, ffn]`` intermediates of the MLP.
Both are per-token, so they can run over tiles of ``tile_tokens`` tokens: the forward keeps
no tile's intermediates (only the input, which the caller holds anyway), and the backward
recomputes one tile at a time (the MLP), or each tile's gradients are taken in the forward
right after its loss (the loss, which is the forward's last op). At most one tile of
intermediates exists at once.

* :func:`tiled_map`: ``fn(x_tile, *params)`` over token tiles (an MLP); a linear of ``fn``
  written as :func:`tile_linear` sums its weight's gradient straight into the call's fp32 sum;
* :func:`tiled_linear_cross_entropy`: ``hidden @ weight.T`` (+ bias, optional logit
  soft-capping) and the summed cross entropy over tiles (an LM head and its loss).

Each is ONE autograd Function over all tiles, with the weights as its inputs: the
weights are read once per forward and once per backward (a ZeRO-3 engine gathers them once
per call, not once per tile), and their gradients are summed over the tiles inside and
handed to autograd once (one gradient hook per parameter per step). The sums are fp32 for a
bf16 / fp16 model, and their GEMMs run on operands of the model's dtype
(:func:`ring_sp.gemm.accumulate_matmul`). Framework-agnostic: no distributed calls here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from .data import IGNORE_INDEX
from .gemm import accumulate_matmul, linear_grads
from .shapes import LOSS_TILE_TENSORS, auto_tile_tokens
from .tensor_tags import tag, tagged

DEFAULT_TILE_TOKENS = None
"""``tile_tokens=None``, the default everywhere: the library sizes each tile from the model
and the shard (:func:`ring_sp.shapes.auto_tile_tokens`): one tile's intermediates are no
larger than the shard's ``[n, hidden]`` hidden state, so no tile is the step's peak."""


def check_tile_tokens(tile_tokens: int | None, *, name: str = "tile_tokens") -> int | None:
    """``tile_tokens`` as a positive int, or None (the library sizes the tiles); else a clear error."""
    if tile_tokens is None:
        return None
    if isinstance(tile_tokens, bool) or not isinstance(tile_tokens, int):
        raise TypeError(f"{name} must be a positive int (tokens per tile) or None (sized by the library from the "
                        f"model and the shard); got {type(tile_tokens).__name__} {tile_tokens!r}")
    if tile_tokens <= 0:
        raise ValueError(f"{name}={tile_tokens} must be >= 1 (tokens per tile); pass e.g. {name}=2048 or None "
                         f"(sized by the library)")
    return tile_tokens


def tile_tokens_for(tile_tokens: int | None, tokens: int, *, kept: torch.Tensor, tile_width: int,
                    tile_dtype: torch.dtype) -> int:
    """The tile size to use: ``tile_tokens`` when given, else :func:`auto_tile_tokens` for a
    shard of ``tokens`` rows of ``kept`` ``[..., hidden]`` and a tile working set of
    ``tile_width`` elements of ``tile_dtype`` per token."""
    tile_tokens = check_tile_tokens(tile_tokens)
    if tile_tokens is not None:
        return tile_tokens
    return auto_tile_tokens(tokens, kept_width=kept.shape[-1], kept_bytes=kept.element_size(), tile_width=tile_width,
                            tile_bytes=tile_dtype.itemsize)


@dataclass(frozen=True)
class RowwiseOrigin:
    """How a tensor was made row by row: ``fn(source, *params())``, each row from its own row of
    ``source`` (an RMSNorm's output from its input). A consumer that recomputes its input tile by
    tile (the tiled MLP) keeps ``source`` instead, which the model keeps anyway (the residual
    stream), and folds ``fn`` into its tiles: the tensor itself is then kept by nobody.
    ``params`` is called where the consumer runs (a ZeRO-3 engine gathers the weights there)."""

    source: torch.Tensor
    fn: Callable[..., torch.Tensor]
    params: Callable[[], Sequence[torch.Tensor | None]]
    source_version: int  # source changed in place since: fn(source) is no longer the tensor


_ORIGIN = "rowwise_origin"


def mark_rowwise_origin(tensor: torch.Tensor, source: torch.Tensor, fn: Callable[..., torch.Tensor],
                        params: Callable[[], Sequence[torch.Tensor | None]]) -> torch.Tensor:
    """Record that ``tensor`` ``= fn(source, *params())`` row by row (same shape); returns it.
    A :mod:`ring_sp.tensor_tags` tag: aliases (ZeRO-3's wrapped module outputs) carry it too."""
    if tensor.is_inference():  # nothing is kept for a backward: nothing to save
        return tensor
    return tag(tensor, _ORIGIN, RowwiseOrigin(source, fn, params, source._version))


def rowwise_origin(tensor: torch.Tensor) -> RowwiseOrigin | None:
    """The :class:`RowwiseOrigin` of ``tensor`` or an alias of it, if it still holds (neither the
    tensor nor its source changed in place since), else None; None for inference tensors (no
    version counters to tell, and nothing kept to save)."""
    if tensor.is_inference():
        return None
    origin = tagged(tensor, _ORIGIN)
    if origin is None or origin.source.shape != tensor.shape or origin.source._version != origin.source_version:
        return None
    return origin


def _accumulator(param: torch.Tensor) -> torch.Tensor:
    """Where a parameter's per-tile gradients are summed: fp32 for lower-precision parameters."""
    return torch.zeros_like(param, dtype=torch.promote_types(param.dtype, torch.float32))


def _leaves(params: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """Detached copies of the parameters (same storage) that record a tile's graph of their own."""
    return [None if p is None else p.detach().requires_grad_(p.requires_grad) for p in params]


_GRAD_SUM = "ring_sp_grad_sum"  # on a tiled_map backward's parameter leaves: the fp32 sum of their gradient


class _TileLinear(torch.autograd.Function):
    """``F.linear(x, weight, bias)``; inside a :func:`tiled_map` backward, the weight's gradient is
    added straight into that call's fp32 sum (no per-tile ``[out, in]`` product handed to autograd)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight, bias)
        ctx.weight_sum = getattr(weight, _GRAD_SUM, None)  # the leaf itself carries it, no alias does
        return F.linear(x, weight, bias)

    @staticmethod
    @once_differentiable
    def backward(ctx, g: torch.Tensor):
        x, weight, bias = ctx.saved_tensors
        with torch.autocast(g.device.type, enabled=False):  # the forward's dtypes, cast explicitly
            return linear_grads(g, x, weight, bias, *ctx.needs_input_grad, weight_sum=ctx.weight_sum)


def tile_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for the ``fn`` of :func:`tiled_map`: x ``[..., in]``, weight
    ``[out, in]`` -> ``[..., out]``. Its backward runs autograd's ops, except that inside
    tiled_map the weight's gradient is summed over the tiles by one GEMM per tile straight into
    an fp32 buffer (:func:`ring_sp.gemm.accumulate_matmul`). Elsewhere it is ``F.linear``."""
    return _TileLinear.apply(x, weight, bias)


class _TiledMap(torch.autograd.Function):
    """``y = fn(x, *params)`` row by row over tiles of ``x`` ``[T, H]``; each tile recomputed in the backward."""

    @staticmethod
    def forward(ctx, fn: Callable[..., torch.Tensor], tile_tokens: int, x: torch.Tensor,
                *params: torch.Tensor | None) -> torch.Tensor:
        ctx.fn, ctx.tile_tokens = fn, tile_tokens
        ctx.save_for_backward(x, *params)
        out = None
        with torch.no_grad():
            for start in range(0, x.shape[0], tile_tokens):
                y = fn(x[start:start + tile_tokens], *params)
                if out is None:  # its width and dtype are fn's: known after the first tile
                    out = y.new_empty((x.shape[0], *y.shape[1:]))
                out[start:start + y.shape[0]] = y
        if out is None:  # no tokens: fn on an empty tile gives the output's shape
            with torch.no_grad():
                out = fn(x, *params)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, *params = ctx.saved_tensors
        need_x = ctx.needs_input_grad[2]
        leaves = _leaves(params)
        trained = [i for i, p in enumerate(leaves) if p is not None and p.requires_grad]
        sums = {i: _accumulator(leaves[i]) for i in trained}
        for i in trained:  # fn's tile_linear adds its weight's gradient into the sum itself
            setattr(leaves[i], _GRAD_SUM, sums[i])
        grad_x = torch.empty_like(x) if need_x else None
        for start in range(0, x.shape[0], ctx.tile_tokens):
            tile = x[start:start + ctx.tile_tokens].detach().requires_grad_(need_x)
            with torch.enable_grad():
                y = ctx.fn(tile, *leaves)
            inputs = ([tile] if need_x else []) + [leaves[i] for i in trained]
            if not inputs:
                break
            grads = torch.autograd.grad(y, inputs, grad_out[start:start + ctx.tile_tokens], allow_unused=True)
            if need_x:
                grad_x[start:start + tile.shape[0]] = grads[0]
                grads = grads[1:]
            for i, g in zip(trained, grads):
                if g is not None:
                    sums[i] += g
        param_grads = [sums[i].to(params[i].dtype) if i in sums else None for i in range(len(params))]
        return (None, None, grad_x, *param_grads)


def tiled_map(fn: Callable[..., torch.Tensor], x: torch.Tensor, params: Sequence[torch.Tensor | None], *,
              tile_tokens: int | None, tile_width: int | None = None) -> torch.Tensor:
    """``fn(x, *params)`` computed over tiles of ``tile_tokens`` tokens, recomputed tile by tile in the backward.

    ``x`` ``[..., H]`` (every leading dimension is tokens: ``fn`` must act on each token
    alone, as an MLP does); ``fn(x_tile [t, H], *params) -> [t, O]`` must be a pure
    function of its arguments (it reads every weight it uses from ``params``, so their
    gradients flow through this call; it is called again in the backward); its linears
    written as :func:`tile_linear` sum their weights' gradients straight into fp32 (others
    hand autograd a product per tile, added into the fp32 sum). Returns
    ``[..., O]``. Only one tile's intermediates ever exist; the parameters' gradients are
    summed over the tiles and handed to autograd once. ``tile_tokens=None``: sized by the
    library (:func:`tile_tokens_for`) from ``tile_width``, the elements per token of ``fn``'s
    working set in the backward (a gated MLP: ``GATED_MLP_TILE_TENSORS * ffn``), which must
    then be given.
    """
    flat = x.reshape(-1, x.shape[-1])
    if check_tile_tokens(tile_tokens) is None and not (isinstance(tile_width, int) and tile_width > 0):
        raise ValueError(f"tiled_map(tile_tokens=None) sizes tiles from tile_width= (the elements per token "
                         f"of fn's working set, e.g. 6 x ffn for a gated MLP); got tile_width={tile_width!r}: pass it, or pass tile_tokens")
    tile_tokens = tile_tokens_for(tile_tokens, flat.shape[0], kept=flat, tile_width=tile_width or 1, tile_dtype=x.dtype)
    out = _TiledMap.apply(fn, tile_tokens, flat, *params)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _capped_logits(linear: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """fp32 logits from one tile's head output, in the order of a Hugging Face head: soft-cap in the model's dtype."""
    if softcap is not None:
        linear = torch.tanh(linear / softcap) * softcap
    return linear.float()


def _logits_grad(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """d(sum of the tile's token losses) / d logits = softmax - one_hot, on valid tokens only (fp32, in place)."""
    d_logits = torch.softmax(logits, dim=-1)
    rows = torch.arange(labels.shape[0], device=labels.device)
    d_logits[rows, labels.clamp(min=0)] -= 1.0
    d_logits *= (labels != ignore_index).to(d_logits.dtype).unsqueeze(-1)
    return d_logits


class _TiledLinearCrossEntropy(torch.autograd.Function):
    """Summed cross entropy of ``hidden @ weight.T (+ bias)`` over token tiles, gradients taken in the forward.

    The loss is the last op of the forward, so (as DeepSpeed ALST's and Liger's fused losses
    do) each tile's gradients are computed right after its loss, while its logits exist:
    the logits are computed once, not again in the backward (3 matmuls per tile, as untiled,
    instead of 4). The head's gradient is summed into ONE buffer by GEMMs on the model's dtype
    (:func:`ring_sp.gemm.accumulate_matmul`: no per-tile ``[vocab, hidden]`` product on CUDA,
    row blocks of it within the tile's freed fp32 logits elsewhere): the fp32 accumulator,
    which for an fp32 head is handed to autograd as the gradient itself, scaled in place. The
    backward only scales the kept gradients by the incoming one (the loss is linear in it).
    Under ``no_grad`` (evaluation) no gradient is taken.
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
                tile_tokens: int, ignore_index: int, softcap: float | None, with_grads: bool) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        need_h = with_grads and ctx.needs_input_grad[0]
        trains = [with_grads and p is not None and p.requires_grad for p in (weight, bias)]
        sums = [_accumulator(p) if t else None for p, t in zip((weight, bias), trains)]
        grad_h = torch.empty_like(hidden) if need_h else None
        taking = need_h or any(trains)  # no gradient wanted (no_grad, or nothing trains): the loss alone
        with torch.no_grad():
            for start in range(0, hidden.shape[0], tile_tokens):
                stop = start + tile_tokens
                tile, tile_labels = hidden[start:stop], labels[start:stop]
                linear = F.linear(tile, weight, bias).requires_grad_(taking and softcap is not None)
                with torch.set_grad_enabled(linear.requires_grad):  # the soft-cap's own backward
                    logits = _capped_logits(linear, softcap)
                total += F.cross_entropy(logits, tile_labels, ignore_index=ignore_index, reduction="sum")
                if not taking:
                    continue
                d_logits = _logits_grad(logits.detach(), tile_labels, ignore_index)
                if softcap is not None:
                    (d_linear,) = torch.autograd.grad(logits, linear, d_logits)
                else:  # the fp32 cast's backward: back to the model's dtype
                    d_linear = d_logits.to(linear.dtype)
                del logits, d_logits, linear
                if need_h:
                    torch.mm(d_linear, weight, out=grad_h[start:start + tile.shape[0]])
                if sums[0] is not None:  # on the model's dtype, summed in fp32
                    accumulate_matmul(sums[0], d_linear.t(), tile.to(d_linear.dtype))
                if sums[1] is not None:
                    sums[1] += d_linear.sum(0, dtype=sums[1].dtype)
                del d_linear
        ctx.grad_dtypes = [None if p is None else p.dtype for p in (weight, bias)]
        ctx.kept = [grad_h, *sums]
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad_h, grad_w, grad_b = ctx.kept
        ctx.kept = None  # handed over once; scaled in place, so no second [vocab, hidden] buffer
        out = []
        for g, dtype in zip((grad_h, grad_w, grad_b), (None, *ctx.grad_dtypes)):
            if g is not None:
                g = g.mul_(grad)
                g = g if dtype is None else g.to(dtype)
            out.append(g)
        return out[0], out[1], out[2], None, None, None, None, None


def tiled_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                               bias: torch.Tensor | None = None, tile_tokens: int | None = None,
                               ignore_index: int = IGNORE_INDEX, softcap: float | None = None) -> torch.Tensor:
    """The SUM of the next-token cross entropies of ``hidden @ weight.T (+ bias)``, over tiles of tokens.

    ``hidden`` ``[..., H]``, ``labels`` ``[...]`` (already shifted; ``ignore_index`` tokens
    count nothing), ``weight`` ``[V, H]`` (an LM head; a tied input embedding works alike),
    ``softcap``: a Gemma-style ``tanh(logits / c) * c`` before the loss. Logits are computed
    in the model's dtype and the loss in fp32, as transformers' causal-LM loss does. Returns
    a 0-d fp32 tensor (divide by the valid-token count, or hand it to
    :func:`ring_sp.sequence_parallel_loss`). Never more than one ``[tile_tokens, V]`` logits
    tile exists: with grad enabled, each tile's gradients are taken in the forward right after
    its loss and scaled by the incoming gradient in the backward (no logits recomputed).
    """
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and labels {tuple(labels.shape)} must agree on the token "
                         f"dimensions (hidden [..., H], labels [...])")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight {tuple(weight.shape)} must be [vocab, {hidden.shape[-1]}] for hidden {tuple(hidden.shape)}")
    flat = hidden.reshape(-1, hidden.shape[-1])
    tile_tokens = tile_tokens_for(tile_tokens, flat.shape[0], kept=flat, tile_width=LOSS_TILE_TENSORS * weight.shape[0],
                                  tile_dtype=torch.float32)  # the tile's fp32 logits and their gradient
    return _TiledLinearCrossEntropy.apply(flat, weight, bias, labels.reshape(-1), tile_tokens, ignore_index, softcap,
                                          torch.is_grad_enabled())


__all__ = ["DEFAULT_TILE_TOKENS", "RowwiseOrigin", "check_tile_tokens", "mark_rowwise_origin", "rowwise_origin",
           "tile_linear", "tile_tokens_for", "tiled_linear_cross_entropy", "tiled_map"]
