"""The planner (``ring_sp.plan``) and its CLI (``ring-sp plan``) on hand-computed cases.

Figures are passed explicitly (F = 494.5 TFLOP/s achieved, NVLink 450 GB/s, IB 50 GB/s
per GPU) so that changing the defaults cannot change these numbers; F/B over IB = 9890.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ring_sp.plan import Cluster, ModelShape, PlanError, Workload, layer_bytes, main, plan
from test_comm import measure

F, NVLINK, IB = 494.5e12, 450e9, 50e9
FOUR_NODES = Cluster(world_size=32, gpus_per_node=8, flops=F, intra_bw=NVLINK, inter_bw=IB)
LLAMA_8B_LIKE = ModelShape(heads=32, kv_heads=8, head_dim=128, hidden=4096, layers=32)
FIGURES = ["--tflops", "989", "--efficiency", "0.5", "--intra-gbps", "450", "--inter-gbps", "50"]


def _find(result, u: int, placement: str = "ulysses_inner"):
    return next(c for c in result.candidates if c.ulysses == u and c.placement == placement)


def test_gqa_32q_8kv_on_4_nodes_of_8() -> None:
    """128K tokens, bf16: n = 4096 tokens per rank."""
    result = plan(FOUR_NODES, LLAMA_8B_LIKE, Workload(seq_len=131072))
    # U must divide 32 heads and divide or be a multiple of 8 KV heads: 1, 2, 4, 8, 16, 32
    assert sorted({c.ulysses for c in result.candidates}) == [1, 2, 4, 8, 16, 32]
    u8 = _find(result, 8)
    # q and out all-to-alls: 4096 * 32 * 128 elements * 2 bytes * 7/8; KV: 4096 * 8 ranks * 2 * 1 head * 128
    assert u8.bytes_fwd == {"ulysses_a2a_q": 29_360_128, "ulysses_a2a_out": 29_360_128,
                            "ulysses_a2a_kv": 14_680_064, "ring_kv": 50_331_648}  # 3 x 2 * 32768 * 128 * 2
    assert u8.bytes_bwd == {"ulysses_a2a_dout": 29_360_128, "ulysses_a2a_dq": 29_360_128,
                            "ulysses_a2a_dkv": 14_680_064, "ring_kv": 50_331_648,
                            "ring_dkv": 117_440_512}  # 3 x 2 * 32768 * 128 * 4 (fp32) + the last hop in bf16 (x 2)
    assert (u8.ulysses_link, u8.ring_link) == ("intra", "inter")
    # a causal half step: 2 * 32768^2 * 128 * 4 heads = 1.0995e12 FLOP = 2.2235 ms; 4 steps, each hides its 0.34 ms send
    assert u8.ring_fwd_s == pytest.approx(4 * 2.2235e-3, rel=1e-4)
    # hiding needs c >= (F/B) (H_kv/H) bytes = 9890 / 4 * 2 forward, (F/B) (H_kv/H) (2 + 4) / 2.5 backward
    assert (u8.min_chunk_fwd, u8.min_chunk_bwd) == (4945, 5934)
    ring_only = _find(result, 1)
    assert ring_only.ring_chunk == 4096 and not ring_only.hides_fwd and not ring_only.hides_bwd
    assert all(c.hides_fwd and c.hides_bwd for c in result.candidates if c.ulysses > 1)
    # U = 2, 4, 8 all hide and keep the all-to-all on NVLink: within 1% of each other, the fewest bytes win
    best = result.recommended
    assert (best.ulysses, best.ring, best.placement, best.layout) == (8, 4, "ulysses_inner", "zigzag")
    assert result.candidates[-1] is ring_only  # communication-bound: the slowest
    assert result.warnings == ()


def test_mha_16_heads_on_2_nodes() -> None:
    cluster = Cluster(world_size=16, gpus_per_node=8, flops=F, intra_bw=NVLINK, inter_bw=IB)
    model = ModelShape(heads=16, kv_heads=16, head_dim=128, hidden=2048, layers=24)
    result = plan(cluster, model, Workload(seq_len=65536))
    u16 = _find(result, 16)
    # n = 4096: q 4096 * 16 * 128 * 2 bytes * 15/16; KV packed k and v of 16 heads
    assert u16.bytes_fwd == {"ulysses_a2a_q": 15_728_640, "ulysses_a2a_out": 15_728_640, "ulysses_a2a_kv": 31_457_280}
    assert u16.ring == 1 and u16.ulysses_link == "inter" and u16.ring_link == "-"
    # bf16 MHA: a full step hides from c = F/B = 9890 tokens (DESIGN section 8), a causal half step from
    # twice that; backward moves 2 + 4 bytes per element against 2.5x the FLOPs: 9890 * 6 / 2.5
    ring_only = _find(result, 1)
    assert (ring_only.min_chunk_fwd, ring_only.min_chunk_bwd) == (19780, 23736)
    # activations: 34 bytes * 4096 tokens * 2048 hidden + lse 4096 * 16 heads * 4 bytes, per layer
    assert ring_only.activation_bytes == 24 * (34 * 4096 * 2048 + 4096 * 16 * 4)
    # causal attention over 65536 tokens: 2 * N^2 * d * H / 16 ranks = 1.0995e12 FLOP = 2.2235 ms forward, 2.5x
    # backward; the Ulysses all-to-alls send 1/15 of q, out (15.7 MB) and k/v (31.5 MB) to each of 8 remote
    # peers over IB: 8/15 * 62.9 MB / 50 GB/s = 0.671 ms each way. Nothing else moves, so pure Ulysses wins
    best = result.recommended
    assert (best.ulysses, best.ring) == (16, 1)
    assert best.layer_s == pytest.approx(3.5 * 2.2235e-3 + 2 * 0.67109e-3, rel=1e-4)
    # U=8 x R=2 hides both ring steps but the fp32 [dk; dv] of 32768 tokens returns home last, exposed:
    # 2 * 32768 * 2 heads * 128 * 4 bytes / 50 GB/s = 1.342 ms
    u8 = _find(result, 8)
    assert u8.hides_fwd and u8.hides_bwd
    assert u8.ring_bwd_s == pytest.approx(2.5 * 2.2235e-3 + 1.3422e-3, rel=1e-4)


def test_gqa_with_more_ulysses_ranks_than_kv_heads_replicates_kv() -> None:
    cluster = Cluster(world_size=8, gpus_per_node=8, flops=F, intra_bw=NVLINK, inter_bw=IB)
    model = ModelShape(heads=32, kv_heads=4, head_dim=128, hidden=4096, layers=1)
    u8 = _find(plan(cluster, model, Workload(seq_len=16384)), 8)
    # each of the 8 ranks gets one KV head (4 heads, each sent to 2 ranks): n = 2048 tokens
    kv_elements = 2048 * 8 * 2 * 1 * 128
    assert u8.bytes_fwd["ulysses_a2a_kv"] == kv_elements * 2 * 7 // 8
    assert u8.bytes_bwd["ulysses_a2a_dkv"] == kv_elements * 4 * 7 // 8  # replica gradients return in fp32
    assert "KV heads replicated 2x" in u8.notes


def test_only_the_ring_fits_the_heads_and_is_communication_bound() -> None:
    cluster = Cluster(world_size=8, gpus_per_node=8, flops=F, intra_bw=NVLINK, inter_bw=IB)
    model = ModelShape(heads=7, kv_heads=7, head_dim=128, hidden=896, layers=2)
    result = plan(cluster, model, Workload(seq_len=4096))
    assert [(c.ulysses, c.ring) for c in result.candidates] == [(1, 8)]
    assert any("only the pure ring" in w for w in result.warnings)


@pytest.mark.parametrize("cluster,work,kwargs,match", [
    (Cluster(32, 8, F, NVLINK, IB), Workload(131072, sp_size=24), {}, "sp-size=24 does not divide world-size=32"),
    (Cluster(12, 8, F, NVLINK, IB), Workload(131072), {}, "not a whole number of nodes"),
    (FOUR_NODES, Workload(131072 + 32), {"layout": "zigzag"}, r"seq-len=131104 must be a positive multiple of 64"),
    (FOUR_NODES, Workload(131072 + 1), {}, "pad the sequence to a multiple of 64"),
    (FOUR_NODES, Workload(131072), {"ulysses": 3}, "must divide the SP degree"),
    (FOUR_NODES, Workload(131072), {"ulysses": 16, "placement": "ulysses_inner"}, "would cross nodes"),
    (FOUR_NODES, Workload(131072, dtype="int8"), {}, "dtype='int8'"),
])
def test_impossible_requests_say_why(cluster, work, kwargs, match) -> None:
    with pytest.raises(PlanError, match=match):
        plan(cluster, LLAMA_8B_LIKE, work, **kwargs)


def test_a_length_zigzag_cannot_split_falls_back_with_a_warning() -> None:
    result = plan(FOUR_NODES, LLAMA_8B_LIKE, Workload(131072 + 32))  # a multiple of 32, not of 64
    layouts = {(c.ulysses, c.ring): c.layout for c in result.candidates}
    assert layouts[(1, 32)] == layouts[(32, 1)] == "striped" and layouts[(8, 4)] == "contiguous"
    assert any("zigzag is impossible" in w for w in result.warnings)


def test_heads_that_ulysses_cannot_split_are_refused_when_pinned() -> None:
    with pytest.raises(PlanError, match=r"q heads \(6\) must be divisible by ulysses_size \(4\)"):
        plan(FOUR_NODES, ModelShape(6, 6, 64, 384, 1), Workload(4096), ulysses=4)


ARGS = ["--world-size", "32", "--gpus-per-node", "8", "--heads", "32", "--kv-heads", "8", "--hidden", "4096",
        "--layers", "32", "--seq-len", "131072", *FIGURES]


def test_cli_prints_the_plan(capsys) -> None:
    assert main(["plan", *ARGS]) == 0
    out = capsys.readouterr().out
    assert "recommended: U=8 x R=4, placement ulysses_inner, layout zigzag" in out
    assert "| 1 x 32 | ulysses_inner | zigzag | ring | - | inter | 4096 | NO/NO (>= 4945/5934)" in out
    assert main([*ARGS, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["recommended"]["ulysses"] == 8 and data["recommended"]["kv_exchange"] == "ring"
    # every grid with a ring is also modelled gathering its KV (--kv-exchange auto)
    assert [len([c for c in data["candidates"] if c["kv_exchange"] == x]) for x in ("ring", "all_gather")] == [10, 9]


def test_cli_refuses_an_impossible_request(capsys) -> None:
    assert main([*ARGS, "--sp-size", "24"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "error: sp-size=24 does not divide world-size=32" in captured.err


def test_python_dash_m_runs() -> None:
    done = subprocess.run([sys.executable, "-m", "ring_sp.plan", *ARGS], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "recommended: U=8 x R=4" in done.stdout
    done = subprocess.run([sys.executable, "-m", "ring_sp.plan", *ARGS, "--ulysses", "5"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and "ulysses=5 must divide the SP degree 32" in done.stderr


MAX_LEN = ["--model", "llama-3-8b", "--world-size", "8", "--max-seq-len", "--alst"]


def _rows(text: str) -> dict[str, list[str]]:
    return {cells[1].strip(): [c.strip() for c in cells[2:-1]] for cells in
            (line.split("|") for line in text.splitlines() if line.startswith(("| ALST ", "| ring_sp ")))}


def test_max_seq_len_json_matches_the_table(capsys) -> None:
    """--json works with --max-seq-len: the same rows as the text table, each with its binding limit,
    host bytes per node, head chunks and int32 check; the text keeps `| library U x R | longest sequence |`."""
    assert main(MAX_LEN) == 0
    text = _rows(capsys.readouterr().out)
    assert main([*MAX_LEN, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [f"{r['library']} {r['ulysses']} x {r['ring']}" for r in data["rows"]] == list(text)
    for row in data["rows"]:
        cells = text[f"{row['library']} {row['ulysses']} x {row['ring']}"]
        assert cells[0] == f"{row['longest_sequence']:,}" and cells[1] == f"{row['tokens_per_gpu']:,}"
        assert cells[4] == f"{row['host_bytes_per_node'] / 2**30:.2f}" and cells[5] == row["bound_by"]
        assert cells[6] == str(row["head_chunks"]) and row["bound_by"] in ("GPU memory", "host memory")
        assert row["host_bytes_per_node"] <= data["host_memory_bytes_per_node"]
    alst = data["rows"][0]
    assert alst["library"] == "ALST" and alst["int32"]["elements"] >= 2**31 and "2^31" in text["ALST 8 x 1"][7]
    assert data["host_memory_bytes_per_node"] == 1900 * 2**30


def test_max_seq_len_says_when_host_memory_binds(capsys) -> None:
    """600 GiB of RAM per node of 8 cannot back ALST's offloaded checkpoints at its GPU limit: the row says
    "host memory" and is shorter, and a note names it."""
    assert main(MAX_LEN) == 0
    roomy = _rows(capsys.readouterr().out)["ALST 8 x 1"]
    assert main([*MAX_LEN, "--host-memory-gib", "600"]) == 0
    out = capsys.readouterr().out
    tight = _rows(out)["ALST 8 x 1"]
    assert roomy[5] == "GPU memory" and tight[5] == "host memory"
    assert int(tight[0].replace(",", "")) < int(roomy[0].replace(",", "")) and float(tight[4]) <= 600
    assert "note: host memory binds for ALST 8 x 1" in out
    assert main([*MAX_LEN, "--host-memory-gib", "0"]) == 2
    assert "host-memory-gib=0 must be positive" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*MAX_LEN, "--head-chunks", "0"])
    assert "head-chunks='0' must be a positive integer or 'auto'" in capsys.readouterr().err


def test_the_double_ring_hides_from_an_eighth_of_the_flat_rings_tokens() -> None:
    """Issue 45's model: 8 nodes x 8 H100, IB 400, Llama-3-8B's attention, U1 x R64 at 256K tokens
    (4,096 per ring rank). The flat ring needs 4,945 tokens per ring rank to hide (it does not here);
    the double ring 8 x 8 hides each inter-node message behind a whole inner pass (8 steps): from 619,
    and each inner message over NVLink from 4945 / 9 = 550. The planner picks it, exactly where faster."""
    eight_nodes = Cluster(world_size=64, gpus_per_node=8, flops=F, intra_bw=NVLINK, inter_bw=IB)
    work = Workload(seq_len=262144)
    both = plan(eight_nodes, LLAMA_8B_LIKE, work, ulysses=1, ring="auto")
    flat = next(c for c in both.candidates if c.kv_exchange == "ring")
    double = next(c for c in both.candidates if c.kv_exchange == "double_ring")
    assert (flat.min_chunk_fwd, flat.min_chunk_bwd) == (4945, 5934) and not flat.hides_fwd
    assert (double.min_chunk_fwd, double.min_chunk_bwd) == (619, 742) and double.hides_fwd and double.hides_bwd
    assert double.min_chunk_fwd <= flat.min_chunk_fwd / 4
    assert both.recommended.kv_exchange == "double_ring" and double.layer_s < 0.8 * flat.layer_s
    # bytes (the most loaded rank): a shard to each of the 7 other nodes once, 8 passes x 7 inner messages on
    # NVLink (4096 tokens x 8 KV heads x (128 + 128) x 2 bytes), the partials back in fp32; the flat ring sends
    # 63 shards, 56 of them to other nodes
    shard = 4096 * 8 * 256 * 2
    assert double.bytes_fwd == {"ring_kv": 56 * shard, "ring_kv_inter": 7 * shard}
    assert double.bytes_bwd == {"ring_kv": 56 * shard, "ring_kv_inter": 7 * shard, "ring_dkv": 112 * shard,
                                "ring_dkv_inter": 14 * shard}
    assert flat.bytes_fwd == {"ring_kv": 63 * shard}
    # pinned: only that ring; a ring inside one node has no double ring to offer
    assert {c.kv_exchange for c in plan(eight_nodes, LLAMA_8B_LIKE, work, ulysses=1, ring="double").candidates} \
        == {"double_ring"}
    assert {c.kv_exchange for c in plan(eight_nodes, LLAMA_8B_LIKE, work, ulysses=1).candidates} == {"ring"}
    one_node = plan(Cluster(world_size=8, gpus_per_node=8, flops=F, intra_bw=NVLINK, inter_bw=IB), LLAMA_8B_LIKE,
                    Workload(seq_len=65536), ring="auto")
    assert "double_ring" not in {c.kv_exchange for c in one_node.candidates}
    # where both hide (U8 x R8 at 256K: 32,768 tokens per ring rank) the double ring is no faster: plain is kept
    grid = plan(eight_nodes, LLAMA_8B_LIKE, work, ulysses=4, ring="auto")
    assert grid.recommended.kv_exchange == "ring"
    with pytest.raises(PlanError, match="ring='triple' is not one of"):
        plan(eight_nodes, LLAMA_8B_LIKE, work, ring="triple")
