"""Issue 20: the whole-step memory model (ring_sp/plan/step_memory.py) and ``ring-sp plan --max-seq-len``.

* Calibration on CPU: the predicted peak per rank of one steady-state training step of the
  issue's small HF Llama (hidden 256, 2 layers, ffn 1024, 8 q / 4 kv heads, vocab 32K, fp32)
  equals the measured peak (live tensor bytes, benchmarks/memory.py, plus the parameters,
  gradients and AdamW state that exist before the step) within 10%, for ring_sp untiled and
  tiled and one rank; the growth during the step (activations and transients, what the
  model has to get right) within 10% too. One length by default, three in the slow sweep.
* ALST configured (Ulysses only, its tiling and offload, ZeRO-3, bf16): Llama-3-8B's longest
  sequence on 8 and 32 H100-80GB within 25% of the published 3.7M and 15M tokens; at 64 and
  128 GPUs Ulysses is capped by the 32 heads while ring_sp's grid keeps scaling.
* Issue 30 (pure functions, hand-computed bytes, ~0.1 s in all): lean layers and head chunks
  shrink the layer's kept and transient bytes by the expected amounts; ALST's Liger fused loss
  and one-layer offload; the host bytes (power-of-two pinned blocks, the offloaded optimizer),
  the host bound binding and named; the int32-index flag at its threshold.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json

import pytest

from benchmarks.length import SMALL_LLAMA
from ring_sp.plan import cli as plan_cli
from ring_sp.plan import step_memory as sm
from ring_sp.plan import PlanError

needs_hf = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")

H100 = 80 * 2**30
ALST_PUBLISHED = {8: 3_700_000, 32: 15_000_000}  # arXiv 2506.13996: Llama-8B on 1 and 4 nodes of 8 x H100-80GB


def _calibrate(pools, mode, seq_len: int) -> None:
    """``benchmarks.length.predict`` (the benchmark's tiles: 1024 tokens) against one measured step."""
    from benchmarks.length import LengthConfig, length_case, predict

    cfg = LengthConfig()
    ranks = mode.world_size(cfg.sp)
    args = (length_case, mode, seq_len, cfg.tile_tokens, cfg.loss_tile_tokens)
    if mode.kind == "alst":  # DeepSpeed registers its SP group once per process and replaces "sdpa" for good:
        from harness import RankPool  # ranks of its own, not the shared pool's

        pool = RankPool(ranks, env={"DS_ACCELERATOR": "cpu"})
        try:
            results = pool.run(*args, timeout=600)
        finally:
            pool.close()
    else:
        results = pools.get(ranks).run(*args, timeout=600)
    step = predict(mode, seq_len, cfg)
    resident = step.params + step.grads + step.optimizer
    for r in results:
        assert r["resident_bytes"] == pytest.approx(resident, rel=1e-3)  # parameters, gradients, AdamW moments
        measured_total = r["resident_bytes"] + r["peak_bytes"]
        assert step.total == pytest.approx(measured_total, rel=0.10), (mode.name, seq_len, step.phases)
        assert step.total - resident == pytest.approx(r["peak_bytes"], rel=0.10), (mode.name, seq_len, step.phases)


@needs_hf
# tiled: a sweep case (-m slow): the tiled step's model stays checked by the head-chunks case (tiled, U1 x R4)
@pytest.mark.parametrize("tiled", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_predicted_step_peak_matches_measured_u2xr2(pools, tiled: bool) -> None:
    from benchmarks.length import TILED_2X2, UNTILED

    _calibrate(pools, TILED_2X2 if tiled else UNTILED, 2048)


@needs_hf
def test_predicted_step_peak_matches_measured_with_head_chunks(pools) -> None:
    from benchmarks.length import CHUNKED_1X4

    _calibrate(pools, CHUNKED_1X4, 4096)


@needs_hf
@pytest.mark.slow
@pytest.mark.parametrize("seq_len", [2048, 4096, 8192])
@pytest.mark.parametrize("mode_name", ["ring_sp untiled U2xR2", "ring_sp tiled U2xR2", "ring_sp tiled U1xR4",
                                       "ring_sp tiled U1xR4, 4 head chunks", "ALST Ulysses SP4 + TiledMLP + tiled loss",
                                       "one rank untiled"])
def test_predicted_step_peak_matches_measured_sweep(pools, mode_name: str, seq_len: int) -> None:
    from benchmarks.length import LENGTH_MODES

    mode = next(m for m in LENGTH_MODES if m.name == mode_name)
    if mode.kind == "alst":
        pytest.importorskip("deepspeed")
    _calibrate(pools, mode, seq_len if mode.world_size(4) > 1 else seq_len // 2)


def test_the_model_counts_what_the_options_change() -> None:
    """Negative controls: each option moves the prediction the way it must (the calibration
    above could not tell a model that ignores an option)."""
    base = sm.Training(dtype="bf16")
    at = lambda t, **kw: sm.step_memory(sm.PRESETS["llama-3-8b"], t, seq_len=65536, ulysses=4, ring=2, **kw)  # noqa: E731
    plain = at(base)
    tiled = at(sm.Training(dtype="bf16", tiled_mlp=True, tiled_loss=True))
    ckpt = at(sm.Training(dtype="bf16", checkpointing=True))
    offload = at(sm.Training(dtype="bf16", checkpointing=True, offload_checkpoints=True))
    assert tiled.total < plain.total and ckpt.total < plain.total and offload.checkpoints < ckpt.checkpoints
    stages = [at(sm.Training(dtype="bf16", zero_stage=z)) for z in range(4)]
    assert [s.optimizer for s in stages[:2]] == [stages[0].optimizer, stages[0].optimizer / 8]
    assert stages[2].grads == stages[1].grads / 8 and stages[3].params == stages[2].params / 8
    fp32 = at(sm.Training(dtype="fp32"))
    assert plain.optimizer == sm.PRESETS["llama-3-8b"].params * 12  # Adam moments + fp32 master weights
    assert fp32.optimizer == sm.PRESETS["llama-3-8b"].params * 8


@pytest.mark.parametrize("gpus", sorted(ALST_PUBLISHED))
def test_alst_configuration_predicts_its_published_lengths(gpus: int) -> None:
    tokens, step = sm.max_seq_len(sm.PRESETS["llama-3-8b"], sm.alst(), H100 - 2**30, ulysses=gpus)
    assert tokens == pytest.approx(ALST_PUBLISHED[gpus], rel=0.25), step.breakdown()
    assert step.total <= H100 - 2**30 < sm.step_memory(sm.PRESETS["llama-3-8b"], sm.alst(), seq_len=tokens + 2 * gpus,
                                                       ulysses=gpus).total


def test_the_grid_goes_past_ulysses_head_cap(capsys) -> None:
    """64 and 128 GPUs: ALST (Ulysses <= 32 heads) cannot use them; ring_sp's grid with the
    same recipe trains longer sequences than ALST's 32-GPU maximum, and more with 128."""
    longest = {}
    for gpus in (64, 128):
        assert plan_cli.main(["--model", "llama-3-8b", "--world-size", str(gpus), "--max-seq-len", "--alst"]) == 0
        out = capsys.readouterr().out
        assert f"| ALST {gpus} x 1 | cannot run" in out
        rows = [line.split("|") for line in out.splitlines() if line.startswith("| ring_sp ")]
        longest[gpus] = max(int(r[2].replace(",", "")) for r in rows if r[2].strip()[0].isdigit())
    alst32, _ = sm.max_seq_len(sm.PRESETS["llama-3-8b"], sm.alst(), H100 - 2**30, ulysses=32)
    assert alst32 < longest[64] < longest[128]


def test_hf_config_and_presets(tmp_path) -> None:
    config = {"hidden_size": 256, "intermediate_size": 1024, "num_attention_heads": 8, "num_key_value_heads": 4,
              "head_dim": 32, "num_hidden_layers": 2, "vocab_size": 32768, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert sm.model_from(str(tmp_path)) == sm.Transformer(256, 1024, 8, 4, 32, 2, 32768, name=tmp_path.name)
    assert sm.model_from("Llama-3-8B").params == pytest.approx(8.03e9, rel=0.01)
    assert sm.model_from("llama-3-70b").params == pytest.approx(70.6e9, rel=0.01)
    assert sm.model_from("qwen3-32b").params == pytest.approx(32.8e9, rel=0.02)  # (q/k norms not counted)
    with pytest.raises(PlanError, match="neither a preset"):
        sm.model_from(str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(PlanError, match="lacks intermediate_size"):
        sm.model_from(str(tmp_path / "bad.json"))


@pytest.mark.parametrize("training, pattern", [
    (sm.Training(offload_checkpoints=True), "offload-checkpoints needs activation checkpointing"),
    (sm.Training(zero_stage=4), "zero-stage=4"),
    (sm.Training(mlp_tile_tokens=0), "mlp-tile-tokens=0"),
    (sm.Training(dtype="int8"), "dtype='int8'"),
])
def test_bad_training_options_name_the_option(training, pattern: str) -> None:
    with pytest.raises(PlanError, match=pattern):
        sm.step_memory(SMALL_LLAMA, training, seq_len=1024)


def test_cli_errors_and_whole_step(capsys) -> None:
    assert plan_cli.main(["--world-size", "8", "--heads", "32", "--hidden", "4096", "--layers", "32",
                          "--max-seq-len"]) == 2
    assert "--max-seq-len needs --model" in capsys.readouterr().err
    assert plan_cli.main(["--world-size", "8", "--max-seq-len"]) == 2
    assert "--heads, --hidden, --layers required" in capsys.readouterr().err
    # checkpoints on the device, and every layer's recompute entry (out + lse, ring_sp.recompute) beside them:
    # 32 + 31 GiB; offloaded, both are gone from the device (enable_long_sequence turns the reuse off)
    args = ["--model", "llama-3-8b", "--world-size", "8", "--seq-len", "1048576", "--zero-stage", "3", "--tiled",
            "--checkpointing"]
    assert plan_cli.main(args) == 0
    out = capsys.readouterr().out
    assert "whole step at 1048576 tokens (131072 per GPU)" in out and "does NOT fit in 80 GiB" in out
    assert "checkpointed activations 63.48" in out
    assert plan_cli.main(args + ["--offload-checkpoints"]) == 0
    out = capsys.readouterr().out
    assert "whole step at 1048576 tokens (131072 per GPU)" in out and ", fits in 80 GiB" in out


# --- issue 30: lean layers, head chunks, ALST's own pieces, the host bound, the int32 flag ---------------------------

LLAMA_8B = sm.PRESETS["llama-3-8b"]


def test_lean_layers_shrink_what_a_layer_keeps_by_the_norms_and_mlp() -> None:
    """Per token and layer in bf16: two HF RMSNorms keep 8 bytes per hidden unit each, lean ones 2 plus one fp32
    rstd (2 x (32768 - 8196) = 49144 bytes less); an untiled HF gated MLP keeps gate, up, act and product, a
    lean one gate and up (2 x 2 x 14336 = 57344 bytes less); tiled, the norms differ and the tiled MLP keeps
    its lean norm's input, not its output (8196 bytes less: the norm runs again per tile)."""
    from ring_sp.plan.layer_memory import layer_kept

    n = 4096
    for tiled, saved in ((False, 49144 + 57344), (True, 49144 + 8196)):
        hf = sm.Training(dtype="bf16", tiled_mlp=tiled)
        lean = sm.Training(dtype="bf16", tiled_mlp=tiled, lean_layers=True)
        for u, r in ((1, 8), (8, 1)):
            assert layer_kept(LLAMA_8B, hf, n=n, ulysses=u, ring=r) - layer_kept(
                LLAMA_8B, lean, n=n, ulysses=u, ring=r) == n * saved
    # Liger's modules (kernels="fused") stay when lean layers are asked for too: never both
    fused = sm.Training(dtype="bf16", kernels="fused")
    assert layer_kept(LLAMA_8B, fused, n=n, ulysses=8, ring=1) == layer_kept(
        LLAMA_8B, sm.Training(dtype="bf16", kernels="fused", lean_layers=True), n=n, ulysses=8, ring=1)


def test_head_chunks_shrink_the_attention_backward_by_the_chunk_share() -> None:
    """U=1 x R=8 (8 KV heads on every rank), per token in bf16: unchunked the backward holds 71680 bytes (fp32 dq
    accumulator 16384, own KV + two inbox slots 12288, the staged first chunk a later rank reads 2048, fp32
    [dK; dV] double buffer 16384, one block's fp32 gradients 24576); in k chunks the whole sequence-layout dq,
    dk, dv (12288) plus 1/k of that and of the chunk's contiguous q, out, dout (24576). Kept tensors do not
    change: q, k, v and out once, and lse."""
    from ring_sp.plan.layer_memory import ring_sp_attention

    n = 1000
    at = lambda chunks: ring_sp_attention(LLAMA_8B, sm.Training(head_chunks=chunks, attention_kernel="cpu"),  # noqa: E731
                                          n=n, ulysses=1, ring=8)  # the flash kernel's workspace: test_gpu_memory_model
    assert at(None) == (n * 20608, n * 71680)
    for chunks in (2, 4, 8):
        assert at(chunks) == (n * 20608, n * (12288 + 96256 // chunks))
    assert at("auto") == at(None)  # "auto" is the runtime's choice: a 1000-token shard stays unchunked
    long = lambda chunks: ring_sp_attention(LLAMA_8B, sm.Training(head_chunks=chunks), n=2**19, ulysses=1, ring=8)  # noqa: E731
    assert long("auto") == long(8) != long(None)  # at long context the finest split
    # U=8: one KV head per rank, so one chunk at most ("auto" = 1 = unchunked); more is refused, naming it
    assert ring_sp_attention(LLAMA_8B, sm.Training(head_chunks="auto"), n=n, ulysses=8, ring=1) == \
        ring_sp_attention(LLAMA_8B, sm.Training(), n=n, ulysses=8, ring=1)
    with pytest.raises(PlanError, match=r"head-chunks=2 exceeds the 1 KV head\(s\) a rank holds at U=8"):
        sm.step_memory(LLAMA_8B, sm.Training(head_chunks=2), seq_len=8 * 1024, ulysses=8)
    # and the whole step's transient falls with them
    base = dict(dtype="bf16", zero_stage=3, checkpointing=True, tiled_mlp=True, tiled_loss=True)
    steps = [sm.step_memory(LLAMA_8B, sm.Training(**base, head_chunks=k), seq_len=2**20, ring=8) for k in (1, 8)]
    assert steps[1].transient < steps[0].transient and steps[1].head_chunks == 8


def test_alst_uses_ligers_fused_loss_and_brings_one_checkpoint_back() -> None:
    """ALST with Liger (its published recipe): Liger's fused linear cross entropy, chunks of
    next_power_of_2(ceil(n / ceil(vocab / hidden))) tokens of bf16 logits; its offload copies one layer's
    checkpoint back at a time where ring_sp's prefetches the next (two on the device)."""
    from ring_sp.plan.layer_memory import liger_chunk, loss_phase

    assert [liger_chunk(LLAMA_8B, n) for n in (100, 16384, 564096)] == [4, 512, 32768]
    n = 16384
    e, h, v = 2, 4096, 128256
    assert loss_phase(LLAMA_8B, sm.alst(), n) == n * e * h + (512 * v * e + n * e * h + v * h * e + n * 4) + v * h * e
    tiled_alst = sm.Training(dtype="bf16", zero_stage=3, tiled_loss=True, library="alst")  # Liger off: ALST's tiled loss
    assert loss_phase(LLAMA_8B, tiled_alst, n) == n * 8 * h + 2092 * v * 12 + n * e * h + v * h * e
    alst_step = sm.step_memory(LLAMA_8B, sm.alst(), seq_len=8 * n, ulysses=8)
    ours = sm.step_memory(LLAMA_8B, sm.long_sequence(), seq_len=8 * n, ulysses=8)
    assert (alst_step.checkpoints, ours.checkpoints) == (n * e * h, 2 * n * e * h)


def test_host_memory_counts_checkpoints_and_the_offloaded_optimizer() -> None:
    """Per rank: 32 layers of [n, 4096] bf16 checkpoints (256 KiB per token), in power-of-two pinned pieces
    for ring_sp's CudaMover (within 2 MiB of the size; one rounded block per checkpoint with
    pinned_rounding=True), exact for ALST's pageable copies; 16 bytes per parameter of the rank's ZeRO shard."""
    from ring_sp.plan.host_memory import pinned_block

    assert [pinned_block(b) for b in (1, 4096, 4097, 3 * 2**30)] == [1, 4096, 8192, 4 * 2**30]
    n = 300_000
    alst_host = sm.step_memory(LLAMA_8B, sm.alst(), seq_len=8 * n, ulysses=8).host
    ours = sm.step_memory(LLAMA_8B, sm.long_sequence(), seq_len=8 * n, ulysses=8).host
    rounded = sm.step_memory(LLAMA_8B, sm.long_sequence(pinned_rounding=True), seq_len=8 * n, ulysses=8).host
    assert alst_host.checkpoints == 32 * n * 8192 == n * 256 * 1024
    assert alst_host.checkpoints <= ours.checkpoints < alst_host.checkpoints + 32 * 2 * 2**20  # pieces: <= 2 MiB more
    assert rounded.checkpoints == 32 * 4 * 2**30  # 300,000 x 8192 bytes = 2.3 GiB -> a 4 GiB block per layer
    assert alst_host.optimizer == ours.optimizer == LLAMA_8B.params * 16 / 8
    assert ours.params == 0 and sm.step_memory(
        LLAMA_8B, sm.Training(zero_stage=3, offload_params=True), seq_len=8 * n, ulysses=8).host.params == \
        LLAMA_8B.params * 2 / 8


def test_the_host_bound_binds_and_is_named() -> None:
    """A small host (300 GiB per node of 8) stops ALST before its GPUs do; the search stops exactly where one
    more step of the sequence would not fit the host, and names the limit."""
    gpu, host = H100 - 2**30, 300 * 2**30
    free = sm.longest_sequence(LLAMA_8B, sm.alst(), gpu, ulysses=8)
    bound = sm.longest_sequence(LLAMA_8B, sm.alst(), gpu, ulysses=8, host_bytes=host, ranks_per_node=8)
    assert free.bound_by == "GPU memory" and bound.bound_by == "host memory" and bound.tokens < free.tokens
    assert bound.host_per_node <= host
    beyond = sm.step_memory(LLAMA_8B, sm.alst(), seq_len=bound.tokens + 16, ulysses=8)
    assert beyond.host.total * 8 > host and beyond.total <= gpu


def test_int32_index_flag_at_the_threshold() -> None:
    """n x hidden >= 2^31 (n = 524,288 at hidden 4096) flags flash-attn 2 and Liger's Triton norm / RoPE for
    ALST; ring_sp's attention kernel sees one head chunk's q, so with 8 chunks only from 8x that n."""
    from ring_sp.plan.index_limits import int32_risk

    at = lambda t, n, u: int32_risk(LLAMA_8B, t, n=n, ulysses=u)  # noqa: E731
    assert not at(sm.alst(), 2**19 - 1, 8).flagged
    flagged = at(sm.alst(), 2**19, 8)
    assert flagged.elements == 2**31 and flagged.kernels == ("flash-attn 2 (ALST's attention)",
                                                             "Liger RMSNorm/RoPE before Liger-Kernel#804")
    assert at(sm.long_sequence(), 2**19, 8).kernels == ("flash-attn 2 (ring_sp's flash_attn backend)",)
    assert not at(sm.long_sequence(), 8 * 2**19 - 1, 1).flagged and at(sm.long_sequence(), 8 * 2**19, 1).flagged


def test_ulysses_output_is_kept_twice_until_o_projs_backward() -> None:
    """With Ulysses the ring keeps the head-layout output and o_proj the sequence-layout copy the
    all-to-all made (the measured U2xR2 step grows 2 KiB per local token more than U1xR4 on the
    length benchmark's 2-layer fp32 model: one [n, 256] fp32 output per layer); without Ulysses
    they are one tensor. o_proj's backward frees its copy before the attention's backward."""
    from ring_sp.plan.layer_memory import layer_kept, o_proj_input_bytes

    n = 4096
    lean = sm.Training(dtype="bf16", tiled_mlp=True, lean_layers=True)
    assert o_proj_input_bytes(LLAMA_8B, lean, n=n, ulysses=1) == 0
    assert o_proj_input_bytes(LLAMA_8B, lean, n=n, ulysses=8) == 2 * n * 4096
    ring, ulysses = (layer_kept(LLAMA_8B, lean, n=n, ulysses=u, ring=8 // u) for u in (1, 8))
    assert ulysses - ring == 2 * n * 4096  # 8 KV heads over U = 8: k / v the same bytes in either layout


def test_tiled_mlp_backward_counts_its_fp32_weight_gradient_sums(monkeypatch) -> None:
    """Issue 38.1: ring_sp's tiled MLP sums its three [ffn, hidden] weights' gradients in fp32 through its
    backward (3 x 14336 x 4096 x 4 bytes at 8B, bf16 or fp32 alike); untiled, and ALST's TiledMLP (which
    adds each tile into .grad), hold none. The GEMMs into them add nothing the tile's working set does not
    hold already (ring_sp.gemm), so the layer's backward grows by exactly the sums."""
    from ring_sp.plan import layer_memory

    sums = 3 * 14336 * 4096 * 4
    for dtype in ("bf16", "fp32"):
        assert layer_memory.mlp_gradient_sums(LLAMA_8B, sm.Training(dtype=dtype, tiled_mlp=True)) == sums
        assert layer_memory.mlp_gradient_sums(LLAMA_8B, sm.Training(dtype=dtype)) == 0
    assert layer_memory.mlp_gradient_sums(LLAMA_8B, sm.Training(dtype="bf16", tiled_mlp=True, library="alst")) == 0
    # the defaults' 1 x 8 row; the CPU kernel's backward has no workspace of its own, so with 8 head chunks the
    # MLP is the layer's larger working set with or without the sums
    cpu = sm.Training(dtype="bf16", tiled_mlp=True, lean_layers=True, head_chunks=8, attention_kernel="cpu")
    # flash-attention 2's workspace puts the attention's backward between the MLP's without the sums and with them
    flash = dataclasses.replace(cpu, attention_kernel="flash")
    counted = [layer_memory.layer_backward_phase(LLAMA_8B, t, n=2**17, ulysses=1, ring=8, recompute=0.0)
               for t in (cpu, flash)]
    monkeypatch.setattr(layer_memory, "mlp_gradient_sums", lambda model, training: 0)
    without = [layer_memory.layer_backward_phase(LLAMA_8B, t, n=2**17, ulysses=1, ring=8, recompute=0.0)
               for t in (cpu, flash)]
    assert counted[0] - without[0] == sums
    assert 0 < counted[1] - without[1] < sums
