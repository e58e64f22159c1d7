"""Issue 40 item 3: what grew at >= 128K on the GPU, in the step-memory model (pure functions, ~0.1 s).

The first GPU run (one H200, bf16; ../shared/gpu/README.md) measured ring_sp's 2-layer
Llama-3-8B-sized stack at 1.21x the model from 128K on, where the model was within 10% below
(the points are copied below). Three things, found by reading the code paths that change with N:

* the step's peak moves from the loss to a layer's backward between 64K and 128K, and ring_sp's
  attention backward lacked flash-attention 2's own workspace (fp32 dq accumulator, dK/dV
  expanded to the q heads for GQA; gradients in bf16): :func:`kernel_workspace`;
* every checkpointed ring_sp attention kept its out + lse on the device until its backward
  (``ring_sp.recompute``), which offloading did not move: now counted, and turned off by
  ``enable_long_sequence(offload_checkpoints=True)``;
* the offload's prefetch needs a previous layer: a 1-layer stack holds one checkpoint.
"""

from __future__ import annotations

import dataclasses

import pytest

from ring_sp.plan import step_memory as sm
from ring_sp.plan.layer_memory import kernel_workspace, recompute_entry, ring_sp_attention

LLAMA_8B = sm.PRESETS["llama-3-8b"]
H200 = 150109880320  # total_memory of the first run's card
STACK = dataclasses.replace(LLAMA_8B, layers=2)  # its hand-built stack: HF norms, fused qkv, no chunks
# (N, measured MiB the step added above parameters and gradients), tiled+offload, 4096-token tiles
FIRST_RUN = [(16384, 8916.1), (32768, 9816.1), (65536, 12048.3), (131072, 24096.5), (262144, 48193.0),
             (524288, 92290.0)]


def _added(training: sm.Training, n: int) -> float:
    s = sm.step_memory(STACK, training, seq_len=n, memory_bytes=H200)
    return (s.checkpoints + s.kept + max(s.phases["loss"], s.phases["layer backward"])) / 2**20


def test_the_first_gpu_run_is_within_10_percent_at_every_length() -> None:
    hand_built = sm.Training(dtype="bf16", master_weights=False, checkpointing=True, offload_checkpoints=True,
                             tiled_mlp=True, tiled_loss=True, mlp_tile_tokens=4096, loss_tile_tokens=4096)
    for n, measured in FIRST_RUN:
        assert measured / _added(hand_built, n) == pytest.approx(1.0, abs=0.10), n
    # negative control: without the kernel's workspace (the CPU kernel's model) the long points are 1.2x off
    # (the run's 1.155 at 512K: its model was asked without the card's size, so it counted a prefetch the
    # runtime, at 4 GiB a checkpoint, did not do; 1.19 at 128K, where the tiled MLP's fp32 weight-gradient
    # sums make its backward the larger working set without the workspace)
    cpu = dataclasses.replace(hand_built, attention_kernel="cpu")
    assert [round(m / _added(cpu, n), 2) for n, m in FIRST_RUN[3:]] == [1.19, 1.21, 1.22]


def test_flash_attention_2_workspace_by_hand() -> None:
    """One backward call over n = 1000 tokens, 32 q / 8 kv heads of 128, bf16: dq accumulator
    4 x 1024 x 32 x 128 (rows rounded to 128), softmax_d 4 x 32 x 1024, dk / dv expanded 2 x 2 x
    1000 x 32 x 128, and dq, dk, dv in bf16 where the CPU model counts fp32: -2 x 1000 x 128 x 48."""
    training = sm.Training(dtype="bf16")
    expected = 4 * 1024 * 32 * 128 + 4 * 32 * 1024 + 2 * 2 * 1000 * 32 * 128 - 2 * 1000 * 128 * 48
    assert kernel_workspace(LLAMA_8B, training, n=1000, ulysses=1) == expected
    assert kernel_workspace(LLAMA_8B, dataclasses.replace(training, attention_kernel="cpu"), n=1000, ulysses=1) == 0
    cpu = dataclasses.replace(training, attention_kernel="cpu")
    unchunked = ring_sp_attention(LLAMA_8B, training, n=1000, ulysses=1, ring=8)
    assert unchunked[1] - ring_sp_attention(LLAMA_8B, cpu, n=1000, ulysses=1, ring=8)[1] == expected
    chunked = [ring_sp_attention(LLAMA_8B, dataclasses.replace(t, head_chunks=8), n=1000, ulysses=1, ring=8)[1]
               for t in (training, cpu)]
    assert chunked[0] - chunked[1] == expected / 8  # one chunk's kernel call at a time
    with pytest.raises(sm.PlanError, match="attention-kernel='triton' must be one of"):
        sm.Training(attention_kernel="triton").check()


def test_recompute_entries_are_counted_unless_offloading_turns_them_off() -> None:
    """With checkpointing on the device every layer's out (bf16) + lse (fp32) stays until its
    backward: L - 1 of them at the first layer backward, all L during the loss."""
    n = 2**17
    on = sm.Training(dtype="bf16", checkpointing=True, tiled_mlp=True, tiled_loss=True)
    entry = recompute_entry(LLAMA_8B, on, n=n, ulysses=1, ring=1)
    assert entry == n * 4096 * 2 + n * 32 * 4 + 48
    off = dataclasses.replace(on, reuse_on_recompute=False)
    with_entries, without = (sm.step_memory(LLAMA_8B, t, seq_len=n) for t in (on, off))
    assert with_entries.checkpoints - without.checkpoints == 31 * entry
    assert with_entries.phases["loss"] - without.phases["loss"] == entry
    offloaded = dataclasses.replace(on, offload_checkpoints=True)  # enable_long_sequence's recipe: no entries
    assert recompute_entry(LLAMA_8B, offloaded, n=n, ulysses=1, ring=1) == 0
    assert recompute_entry(LLAMA_8B, dataclasses.replace(on, library="alst"), n=n, ulysses=1, ring=1) == 0


def test_one_layer_has_no_previous_layer_to_prefetch() -> None:
    training = sm.Training(dtype="bf16", checkpointing=True, offload_checkpoints=True, prefetch_checkpoints=True)
    one, two = (sm.step_memory(dataclasses.replace(LLAMA_8B, layers=k), training, seq_len=8192) for k in (1, 2))
    assert (one.checkpoints, two.checkpoints) == (8192 * 4096 * 2, 2 * 8192 * 4096 * 2)


@pytest.mark.parametrize("card_gib", [80, 141])
def test_at_the_longest_n_on_one_card_ring_sp_no_longer_prefetches(card_gib: int) -> None:
    """What lets gpu_check measure the line and probe on one layer: at the longest N of its 2-layer
    recipe a checkpoint is above 1/64 of the card, so the device holds one, however many layers."""
    training = sm.Training(dtype="bf16", master_weights=False, checkpointing=True, offload_checkpoints=True,
                           tiled_mlp=True, tiled_loss=True, lean_layers=True, head_chunks="auto",
                           reuse_on_recompute=False)
    card = card_gib * 2**30
    tokens, step = sm.max_seq_len(STACK, training, card)
    assert tokens * 4096 * 2 * 64 > card and step.checkpoints == tokens * 4096 * 2


def test_offloading_checkpoints_turns_the_attention_reuse_off() -> None:
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    import ring_sp.integrations.transformers as rsp_hf

    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8))
    model.gradient_checkpointing_enable()
    rsp_hf.enable_long_sequence(model, offload_checkpoints=True)
    assert [layer.self_attn.ring_sp_reuse_on_recompute for layer in model.model.layers] == [False, False]
    rsp_hf.enable_long_sequence(model)  # called again: the settings are replaced
    assert [layer.self_attn.ring_sp_reuse_on_recompute for layer in model.model.layers] == [None, None]
