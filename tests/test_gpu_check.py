"""``python -m benchmarks.gpu_check --dry``: every section's code path on the CPU (issue 32).

The dry run is the CI stand-in for the GPU run: the same sections, the same records, on
the CPU at tiny sizes through the seam's CPU stand-ins. One run (a subprocess, so its
process group and dispatch modes stay out of the session) feeds every check on its
records; the seam and the search for the longest N are also checked on their own.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.gpu_check import attention_rate as gpu_attention_rate
from benchmarks.gpu_check import efficiency as gpu_efficiency
from benchmarks.gpu_check import longest as gpu_longest
from benchmarks.gpu_check import memory as gpu_memory
from benchmarks.gpu_check import step as gpu_step
from benchmarks.gpu_check.__main__ import CAPS, summary
from benchmarks.gpu_check.__main__ import targets as summary_targets
from benchmarks.gpu_check.llama import llama_3_8b
from benchmarks.gpu_check.loopback import rank_specs, ring_grads, ring_outputs, ring_rank_backward
from ring_sp import shard_sequence, unshard_sequence
from ring_sp.kernels import get_kernel
from ring_sp.layouts import check_layout
from benchmarks.gpu_check.seam import Deadline, Seam, SimulatedOutOfMemory

ROOT = Path(__file__).resolve().parents[1]
# The GPU machine runs gpu_check from a checkout where ring_sp is not installed: without the
# editable install's finder, ring_sp comes from the checkout and ring_sp.integrations from nowhere
# (setup.py maps it at install) until gpu_check's preflight maps it.
UNINSTALLED = ("import runpy, sys; sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f)]; "
               "runpy.run_module('benchmarks.gpu_check', run_name='__main__', alter_sys=True)")


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    done = subprocess.run([sys.executable, "-c", UNINSTALLED, "--dry", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (out / "run.log").write_text(done.stdout)
    records = [json.loads(line) for line in (out / "gpu_check.jsonl").read_text().splitlines()]
    return out, records


def _section(records, name):
    return [r for r in records if r["section"] == name]


def test_dry_run_writes_every_section(dry_run):
    out, records = dry_run
    assert {r["section"] for r in records} >= {"card", "kernel_tests", "memory", "memory_longest", "memory_planner",
                                               "efficiency", "attention_rate", "step", "step_models", "step_profile",
                                               "section_time"}
    assert not [r for r in records if "error" in r], [r for r in records if "error" in r]
    assert "ring_sp is not installed: integrations/ imported as ring_sp.integrations" in (out / "run.log").read_text()
    (card,) = _section(records, "card")
    assert card["mode"] == "dry" and card["torch"] == torch.__version__ and card["kernel"] == "torch"
    times = {r["name"]: r for r in _section(records, "section_time")}
    assert list(times) == ["step", "efficiency", "kernel_tests", "memory"]  # by value; the memory section's probes last
    assert all(t["status"] == "done" and t["elapsed_s"] <= t["cap_s"] for t in times.values())
    assert all("--sections" in r["command"] for r in records if r["section"] in times)
    text = (out / "gpu_check.md").read_text()
    for heading in ("## CUDA kernel tests", "## Step memory", "## Attention rate and schedule efficiency",
                    "## Step time", "## Targets"):
        assert heading in text


def test_kernel_tests_ran_with_a_summary(dry_run):
    (record,) = _section(dry_run[1], "kernel_tests")
    assert record["returncode"] == 0 and record["counts"]["passed"] >= 1 and "passed" in record["summary"]
    assert not record["counts"].get("failed")


def test_memory_records_have_model_and_measured_figures(dry_run):
    """Both libraries' recipes on transformers' LlamaForCausalLM, on 2 layers and on the line's
    stack; on the CPU what 2 layers add over 1 is the model's one checkpoint (nothing is offloaded
    there, and ring_sp's offloading recipe keeps no recompute entries: with them it was two)."""
    rows = _section(dry_run[1], "memory")
    measured = [r for r in rows if "added_bytes" in r]
    assert {(r["library"], r["layers"]) for r in measured} == {("ring_sp", 2), ("ring_sp", 1), ("ALST", 2), ("ALST", 1)}
    for r in measured:
        assert r["model_added_bytes"] > 0 and r["added_bytes"] > 0 and r["peak_bytes"] > r["added_bytes"]
        assert 0.8 < r["measured_over_model"] < 1.25, r  # the tiny shape: wired up, the GPU shape is the target
    # where the model says a step does not fit, it is skipped with the reason, not run
    assert any("skipped" in r and "free" in r["skipped"] for r in rows)
    pieces = {r["library"]: r for r in _section(dry_run[1], "memory_pieces")}
    assert pieces["ring_sp"]["lean_layers"] == "True" and pieces["ring_sp"]["head_chunks"] == "auto"
    assert "TiledMLP" in pieces["ALST"]["mlp"] and "TiledFusedLogitsLoss" in pieces["ALST"]["loss"]
    assert "flash backend" in pieces["ALST"]["attention"] and "host memory" in pieces["ALST"]["checkpointing"]
    for r in _section(dry_run[1], "memory_layers"):  # up to a few KiB a layer that do not grow with N
        assert r["model_delta_bytes"] == r["checkpoint_bytes"], r
        assert r["measured_delta_bytes"] == pytest.approx(r["checkpoint_bytes"], abs=4096), r


def test_the_longest_n_is_extrapolated_and_confirmed_for_ring_sp_and_alst(dry_run):
    found = {r["library"]: r for r in _section(dry_run[1], "memory_longest")}
    assert set(found) == {"ring_sp", "ALST"}
    for r in found.values():
        assert r["slope_bytes_per_token"] > 0 and r["extrapolated_longest"] > 0 and r["stopped"] is None, r
        assert r["confirmed"] and r["longest_fits"] == r["extrapolated_longest"] and r["longer_fails"], r
        assert r["probes"][1]["seq_len"] >= r["longest_fits"] + r["unit"]
    # README's 8-GPU row, from the planner whose constants the memory rows check
    (planner,) = _section(dry_run[1], "memory_planner")
    assert planner["ring_sp_grid"] == "1 x 8" and planner["ALST_grid"] == "8 x 1"
    assert planner["ring_sp_longest"] == 6_693_696 and planner["ALST_longest"] == 4_512_768
    row = next(row for row in summary_targets(dry_run[1]) if row[0].startswith("the planner's 8-GPU"))
    assert "6,693,696 (1 x 8) / 4,512,768 = 1.48" in row[1] and row[2] == "met"


def test_efficiency_records_are_finite_and_exact(dry_run):
    """Forward and backward of every schedule and P, for the one fused backend of the CPU; the
    first size of each checked: the output and every rank's dq, dk, dv against the baseline."""
    rows = _section(dry_run[1], "efficiency")
    assert {(r["schedule"], r["world_size"], r["backend"]) for r in rows} == {
        (s, p, "torch") for s in ("zigzag", "window", "packed", "packed_real") for p in (4, 8)}
    for r in rows:
        assert "skipped" not in r, r
        assert r["pairs"] <= r["causal_pairs"]
        for d in ("forward", "backward"):
            for key in ("efficiency", "efficiency_work", "sum_s", "baseline_s", "tflops"):
                assert math.isfinite(r[d][key]) and r[d][key] > 0, (d, key, r)
            assert len(r[d]["rank_s"]) == r["world_size"]
    zigzag = [r for r in rows if r["schedule"] == "zigzag"]
    assert all(r["pairs"] == r["causal_pairs"] for r in zigzag)  # the schedule covers every causal pair once
    checked = [r for r in rows if r.get("max_abs_diff") is not None]
    assert {(r["schedule"], r["world_size"]) for r in checked} == {
        (s, p) for s in ("zigzag", "window", "packed", "packed_real") for p in (4, 8)}
    assert all(r["max_abs_diff"] < 1e-4 and r["grad_max_rel_diff"] < 1e-4 for r in checked), checked


def test_attention_rate_rates_every_backend_against_the_reference(dry_run):
    rows = _section(dry_run[1], "attention_rate")
    by_name = {r["backend"]: r for r in rows}
    reference = next(r for r in rows if r.get("reference"))
    assert "error" not in reference and reference["gqa"].startswith("native")
    assert {"torch", "reference", "auto"} <= set(by_name) and "skipped" in by_name["flash_attn"]
    for name in ("torch", "reference"):
        r = by_name[name]
        for d in ("forward", "backward"):
            assert r[f"{d}_ratio"] == pytest.approx(reference[f"{d}_s"] / r[f"{d}_s"])
            assert r[f"{d}_tflops"] > 0
        assert r["max_abs_diff"] < 1e-5  # the same attention as the reference's
    auto = by_name["auto"]
    assert auto["auto_backend"] == "torch" and by_name["torch"]["auto"] and not by_name["reference"]["auto"]
    assert sorted(auto["measured_order"]) == ["reference", "torch"] and auto["fastest"] == auto["measured_order"][0]
    assert auto["auto_is_fastest"] == (auto["fastest"] == "torch")
    text = (dry_run[0] / "gpu_check.md").read_text()
    assert "`auto` picks `torch`" in text and "attention rate of `auto` (`torch`)" in text


def test_available_backends_skip_what_cannot_run_and_names_ring_sp_lacks():
    ok, why = gpu_attention_rate.available_backends(torch.device("cpu"), torch.float32, 16,
                                                    names=("auto", "torch", "reference", "flash_attn", "no_such"))
    assert ok == ["torch"] and set(why) == {"flash_attn", "no_such"}
    assert "no_such" in why["no_such"] and "flash-attn" in why["flash_attn"]


def test_a_refusing_reference_and_a_spent_time_cap_are_recorded(monkeypatch):
    """The reference refusing both ways (native GQA, KV heads repeated) leaves its error and no
    ratios; with no time left every schedule point is a skipped row naming the cap."""
    seam = Seam.open(dry=True)
    # the memory-efficient SDPA has no CPU kernel: it refuses every call here, as cuDNN's may on a GPU
    monkeypatch.setattr(seam, "sdpa_reference", lambda: (torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION, "x"))
    cfg = gpu_efficiency.DRY
    records = list(gpu_efficiency.efficiency(seam, cfg, Deadline(-1.0), lambda message: None))
    reference = next(r for r in records if r.get("reference"))
    assert "enable_gqa" in reference["error"] and "KV heads repeated" in reference["error"]
    rated = [r for r in records if r["section"] == "attention_rate" and "forward_s" in r]
    assert rated and not any("forward_ratio" in r for r in rated)
    assert [row[2] for row in gpu_attention_rate.targets(records)][:2] == ["unmeasured", "unmeasured"]
    points = [r for r in records if r["section"] == "efficiency"]
    assert len(points) == len(cfg.tokens_per_rank) * len(cfg.world_sizes) * len(gpu_efficiency.SCHEDULES)
    assert all(r["skipped"].startswith("time cap") for r in points)


def test_the_step_section_times_every_mode_on_one_set_of_weights(dry_run):
    records = dry_run[1]
    (models,) = _section(records, "step_models")
    assert models["modes"] == ["ring_sp", "untiled", "ALST", "ring_sp+ckpt"] and models["parameters_shared"]
    pieces = models["pieces"]  # the memory section's builders, with issue 38's ALST: sdpa's own kernel, no offload
    assert "own choice" in pieces["ALST"]["attention"] and pieces["ALST"]["checkpointing"].endswith("on the device")
    assert (pieces["ring_sp"]["checkpointing"], pieces["ring_sp+ckpt"]["checkpointing"]) == ("off", "on the device")
    assert pieces["untiled"]["mlp"] == "transformers" and pieces["ring_sp"]["head_chunks"] == "auto"
    rows = {(r["mode"], r["seq_len"]): r for r in _section(records, "step")}
    short, long = gpu_step.DRY.seq_lens
    for mode in models["modes"]:
        r = rows[mode, short]
        assert r["step_s"] > 0 and len(r["times_s"]) == gpu_step.DRY.repeats and r["added_bytes"] > 0
    # the full logits do not fit the stand-in's memory at the longer length: untiled runs out, the others fit
    assert "out_of_memory" in rows["untiled", long] and all("step_s" in rows[m, long] for m in models["modes"]
                                                            if m != "untiled")
    for n in (short, long):  # one set of weights, the same tokens: every mode's loss is the same (fp32)
        losses = [r["loss"] for (m, k), r in rows.items() if k == n and "loss" in r]
        assert len(losses) >= 3 and max(losses) - min(losses) <= 1e-4 * abs(losses[0])
    profiles = {r["mode"]: r for r in _section(records, "step_profile")}
    assert set(profiles) == set(models["modes"])
    for p in profiles.values():
        assert p["seq_len"] == gpu_step.DRY.profile_len and 0 < len(p["top"]) <= gpu_step.DRY.profile_top
        assert sum(k["share"] for k in p["top"]) <= 1 + 1e-9 and p["top"][0]["self_ms"] >= p["top"][-1]["self_ms"]
    assert "aten::mm" in [k["name"] for k in profiles["untiled"]["top"]]  # the ops of the step, by their own time
    targets = {row[0]: row for row in gpu_step.targets(records)}
    untiled = next(row for name, row in targets.items() if "untiled" in name)
    assert f"{short:,}:" in untiled[1] and f"{long:,}:" not in untiled[1]  # where untiled fits
    assert next(row for name, row in targets.items() if "losses agree" in name)[2] == "met"


def test_an_unsupported_transformers_skips_the_memory_and_step_sections(monkeypatch):
    """The GPU image's transformers 5.17 without the carried wheel: both sections that train
    transformers' Llama are named before anything runs and skipped with the reason, not raised."""
    from benchmarks.gpu_check import preflight

    monkeypatch.setattr(preflight, "installed_version", lambda name: "5.17.0" if name == "transformers" else None)
    monkeypatch.setattr(preflight, "_import_error", lambda module: None)
    reason = preflight.transformers_unsupported()
    assert reason.startswith("transformers 5.17.0") and "transformers>=5.18" in reason
    skips = preflight.missing(["memory", "step"])
    assert (skips["memory"], skips["step"]) == (reason, reason)
    assert not any("ALST's modules" in r for r in skips.values())  # DeepSpeed imports (faked here)
    for module in (gpu_memory, gpu_step):
        monkeypatch.setattr(module, "transformers_unsupported", preflight.transformers_unsupported)
    seam = Seam.open(dry=True)
    records = [*gpu_memory.memory(seam, gpu_memory.DRY, Deadline(60), print),
               *gpu_step.step(seam, gpu_step.DRY, Deadline(60), print)]
    assert {r["section"] for r in records} == {"memory_longest", "step"}
    assert all(r["skipped"] == reason for r in records)


def test_loopback_ring_gives_exact_gradients_and_needs_its_collection():
    """:func:`ring_grads` (each rank's dK/dV partials collected) equals the kernel on the whole
    sequence, for the relayed (zigzag) and the direct (window) routes; the same backward without
    the collection (what is timed) leaves dk wrong: the collection is what makes the check exact."""
    torch.manual_seed(0)
    p, n, scale = 4, 8, 0.25
    q, dout = torch.randn(1, p * n, 4, 16, dtype=torch.float64), torch.randn(1, p * n, 4, 16, dtype=torch.float64)
    k, v = torch.randn(1, p * n, 2, 16, dtype=torch.float64), torch.randn(1, p * n, 2, 16, dtype=torch.float64)
    kernel = get_kernel("reference", q.device, q.dtype, 16)
    for layout, window in (("zigzag", None), ("contiguous", 5)):
        qs, ks, vs, douts = ([shard_sequence(x, rank=r, world_size=p, layout=layout) for r in range(p)]
                             for x in (q, k, v, dout))
        specs = rank_specs(kernel, scale, layout, n, None, window, ks, vs)
        outputs = ring_outputs(specs, qs, ks, vs)
        out, lse = kernel.forward(q, k, v, causal=True, scale=scale, window=window)
        want = kernel.backward(dout, q, k, v, out, lse, causal=True, scale=scale, window=window)
        got = [unshard_sequence(torch.stack(g), layout=layout) for g in zip(*ring_grads(specs, douts, qs, ks, vs,
                                                                                      outputs))]
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w.double(), rtol=1e-10, atol=1e-10)
        plain = [ring_rank_backward(specs[r], douts[r], qs[r], ks[r], vs[r], *outputs[r]) for r in range(p)]
        dk = unshard_sequence(torch.stack([x[1] for x in plain]), layout=layout)
        assert (dk - want[1]).abs().max() > 1e-3  # negative control


def test_the_summary_names_what_was_skipped_or_failed(dry_run):
    """Rows a GPU run may produce that the dry run does not: each renders with its reason."""
    records = [
        {"section": "memory_longest", "library": "ALST", "skipped": "DeepSpeed's ALST modules are not importable (x)"},
        *dry_run[1],
        {"section": "kernel_tests", "selection": "full", "skipped": "pytest is not installed"},
        {"section": "efficiency", "schedule": "zigzag", "world_size": 8, "tokens_per_rank": 65536, "backend": "cudnn",
         "seq_len": 524288, "skipped": "time cap: predicted 30.0 s, 3 s left"},
        {"section": "efficiency", "error": "RuntimeError: boom"},
        {"section": "attention_rate", "backend": "cuDNN SDPA", "reference": True, "error": "enable_gqa: no kernel (y)"},
        {"section": "step", "mode": "ALST", "skipped": "cannot build it: ImportError: no deepspeed (z)"},
        {"section": "step", "mode": "untiled", "seq_len": 131072, "skipped": "predicted 300.0 GiB added (w)"},
    ]
    text = summary(records, {})
    for reason in ("not importable (x)", "pytest is not installed", "time cap: predicted 30.0 s", "RuntimeError: boom",
                   "no kernel (y)", "no deepspeed (z)", "GiB added (w)"):
        assert reason in text


def test_the_gpu_configurations_fit_their_time_and_shapes():
    """What only a GPU run would find out, checked here: the caps leave start-up room in 8 (full)
    and 3 (quick) minutes, and every point of the GPU sizes is a valid problem."""
    assert sum(CAPS["full"].values()) <= 8 * 60 - 30 and sum(CAPS["quick"].values()) <= 3 * 60 - 25
    for cfg in (gpu_efficiency.FULL, gpu_efficiency.QUICK):
        assert (cfg.heads, cfg.kv_heads, cfg.head_dim) == (32, 8, 128)  # Llama-3-8B's attention
        for n in cfg.tokens_per_rank:
            for p in cfg.world_sizes:
                for schedule in gpu_efficiency.SCHEDULES:
                    layout, cu, window = gpu_efficiency.problem(schedule, p, n * p, cfg)
                    check_layout(layout, p, n * p, cu_seqlens=cu)
                    assert window is None or window < n
    for cfg in (gpu_step.FULL, gpu_step.QUICK):
        assert cfg.shape == llama_3_8b(2) and cfg.profile_len in cfg.seq_lens
        assert cfg.modes[:3] == ("ring_sp", "untiled", "ALST")
        assert min(cfg.seq_lens) == 16384 and all(n % 8192 == 0 for n in cfg.seq_lens)  # the 16K-128K
    assert max(gpu_step.FULL.seq_lens) == 131072 and gpu_efficiency.FULL.rate_tokens == 32768
    for cfg in (gpu_memory.FULL, gpu_memory.QUICK):
        assert cfg.shape == llama_3_8b(2) and len(cfg.line_lens) == 3 and cfg.line_layers == 1
        assert set(cfg.seq_lens) & set(cfg.line_lens)  # the layer check's common length
        assert all(n % cfg.unit == 0 for n in cfg.seq_lens + cfg.line_lens)
    assert gpu_memory.FULL.line_lens == (131072, 262144, 524288) and min(gpu_memory.FULL.seq_lens) == 16384


def test_the_seam_on_the_cpu():
    seam = Seam.open(dry=True, dry_capacity_bytes=2**20)
    assert seam.device.type == "cpu" and seam.dtype == torch.float32 and seam.capacity() == 2**20
    with seam.memory() as m:
        x = torch.ones(1000)  # 4000 bytes
        del x
        y = torch.ones(10)
    assert m.added == 4000 and m.reserved is None and y.sum() == 10
    with pytest.raises(SimulatedOutOfMemory) as caught, seam.memory(limit_bytes=1000):
        torch.ones(1000)
    assert seam.is_out_of_memory(caught.value) and not seam.is_out_of_memory(RuntimeError("other"))
    assert seam.out_of_memory_record(caught.value).startswith("SimulatedOutOfMemory: CPU stand-in")
    with pytest.raises(RuntimeError, match="other"):  # not an out-of-memory: raised again, never recorded
        seam.out_of_memory_record(RuntimeError("other"))
    with seam.budget(512):
        assert seam.capacity() == 512
    assert seam.capacity() == 2**20
    assert seam.time(lambda: sum(range(1000))) > 0
    median, times = seam.median_time(lambda: None, repeats=3, warmup=1)
    assert len(times) == 3 and median >= 0
    assert seam.sdpa_reference()[0] == torch.nn.attention.SDPBackend.FLASH_ATTENTION  # the CPU's stand-in


def test_predict_time_and_the_line():
    steps = [(1000, 1000 * 1e-3 + 1e-6 * 1000**2), (2000, 2000 * 1e-3 + 1e-6 * 2000**2)]
    assert gpu_longest.predict_time(steps, 4000) == pytest.approx(4000 * 1e-3 + 1e-6 * 4000**2)
    assert gpu_longest.predict_time(steps[:1], 2000) == pytest.approx(4 * steps[0][1])
    assert gpu_longest.predict_time([], 10**9) == 0.0
    assert gpu_longest.fit_line([(100, 1100.0), (200, 2100.0), (300, 3100.0)]) == pytest.approx((10.0, 100.0))
    assert gpu_longest.fit_line([(100, 1100.0)]) is None and gpu_longest.fit_line([(1, 5.0), (2, 4.0)]) is None


def test_sections_share_what_is_left_of_the_budget():
    """The default run ends within its budget (issue 44: 9 minutes on the lent GPU): a section gets
    its cap while the remaining caps fit, else its cap's share of the time left."""
    from benchmarks.gpu_check.__main__ import BUDGETS, CAPS, SECTIONS, section_cap

    caps = CAPS["full"]
    assert sum(caps.values()) < BUDGETS["full"] <= 540 and list(caps) == list(SECTIONS)
    assert section_cap(caps, list(SECTIONS), None) == caps["step"]
    assert section_cap(caps, list(SECTIONS), 1000.0) == caps["step"]
    assert section_cap(caps, ["kernel_tests", "memory"], 110.0) == 110.0 * 50 / 220
    assert section_cap(caps, ["memory"], 0.0) == 1.0  # past the budget: a second, to record what was skipped
