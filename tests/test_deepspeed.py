"""C17/F5: the DeepSpeed integration (config section, mpu, initialize, data helpers, example).

Distributed cases run the example's GPT (examples/deepspeed/pretrain_gpt.py) in fp32 on 4
gloo ranks with DeepSpeed's CPU accelerator, against the same model on the full sequence
in plain PyTorch: loss, DeepSpeed's reduced gradients and the next step's loss must agree.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import ring_sp
from example_scripts import load_script, run_launcher
from ring_sp.integrations.deepspeed import RingSPConfig, skip_cpu_inference_comm_build
from ring_sp.kernels import BACKENDS

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "deepspeed"
DS_ENV = {"DS_ACCELERATOR": "cpu"}  # read once, when deepspeed is first imported in a rank
HAVE_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
needs_deepspeed = pytest.mark.skipif(
    not HAVE_DEEPSPEED, reason="deepspeed is not installed (pip install --no-build-isolation deepspeed)"
)

SEQ, BATCH, VOCAB = 32, 2, 256
MODEL = dict(d_model=32, n_layer=2, n_head=4, n_kv_head=2)
CLIP = 0.05  # below the gradient norm, so clipping is active and checks DeepSpeed's norm


# ---------------------------------------------------------------- config (one process)

def test_section_absent_or_disabled_is_none() -> None:
    assert RingSPConfig.from_ds_config({"train_batch_size": 8}) is None
    assert RingSPConfig.from_ds_config({"ring_sp": {"ulysses_size": 2, "enabled": False}}) is None
    config = RingSPConfig.from_ds_config({"ring_sp": {"ulysses_size": 2, "ring_size": 4, "placement": "ring_inner"}})
    assert (config.sp_size, config.layout, config.backend, config.placement) == (8, "zigzag", "auto", "ring_inner")


@pytest.mark.parametrize("section,error,pattern", [
    ({"ulyses_size": 2}, ValueError, r"ring_sp\.ulyses_size is not a known key; did you mean 'ulysses_size'"),
    ({"ring_size": "4"}, TypeError, r"ring_sp\.ring_size must be an integer >= 1; got str '4'"),
    ({"ring_size": 2.0}, TypeError, r"ring_sp\.ring_size must be an integer"),
    ({"ulysses_size": True}, TypeError, r"ring_sp\.ulysses_size must be an integer"),
    ({"ulysses_size": 0}, ValueError, r"ring_sp\.ulysses_size=0 must be >= 1"),
    ({"layout": "zig"}, ValueError, r"ring_sp\.layout='zig' is not one of " + re.escape(str(list(ring_sp.LAYOUT_CHOICES)))),
    ({"placement": "outer"}, ValueError, r"ring_sp\.placement='outer' is not one of"),
    ({"backend": "flash"}, ValueError, r"ring_sp\.backend='flash' is not one of " + re.escape(str(list(BACKENDS)))),
    ({"enabled": "yes"}, TypeError, r"ring_sp\.enabled must be true or false"),
    ({"kv_exchange": "allgather"}, ValueError, r"ring_sp\.kv_exchange='allgather' is not one of \['ring', 'all_gather', 'auto', 'double_ring'\]"),
    ({"layout": "striped", "ulysses_size": 2, "ring_size": 2}, ValueError, r"ring_sp\.layout='striped' cannot .* use layout 'zigzag'"),
    ([2, 2], TypeError, r'the "ring_sp" section must be a JSON object'),
])
def test_bad_section_names_key_and_fix(section: Any, error: type, pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        RingSPConfig.from_ds_config({"ring_sp": section})


@pytest.mark.parametrize("ds_config,world,pattern", [
    ({}, 6, r"ulysses_size x ring_sp\.ring_size = 2 x 2 = 4 does not divide the world size 6; .* one of \[1, 2, 3, 6\]"),
    ({"sequence_parallel_size": 2}, 8, r"sequence_parallel_size=2 conflicts with ring_sp: .* = 4; remove .* or set it to 4"),
    ({"data_parallel_size": 4}, 8, r"data_parallel_size=4 conflicts with ring_sp: world size 8 / .* = 2"),
    ({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2}, 8,
     r"train_batch_size=8 must equal .* 1 x 2 x 2 = 4: .* set train_batch_size to 4"),
    ({"tensor_parallel": {"autotp_size": 2}}, 8, r"tensor_parallel\.autotp_size=2 cannot be combined with the ring_sp section"),
    ({"zero_optimization": {"stage": 3, "reduce_scatter": False}}, 8,
     r"zero_optimization\.reduce_scatter=false with stage 3 cannot be combined .* remove reduce_scatter"),
])
def test_bad_ds_config_against_world(ds_config: dict, world: int, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        RingSPConfig(ulysses_size=2, ring_size=2).apply(ds_config, world)


def test_apply_sets_sequence_parallel_size_and_keeps_input() -> None:
    user = {"sequence_parallel_size": "auto", "data_parallel_size": 2, "train_batch_size": 4,
            "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "ring_sp": {"ring_size": 4}}
    ready = RingSPConfig(ring_size=4).apply(user, 8)
    assert ready["sequence_parallel_size"] == 4 and "data_parallel_size" not in ready
    assert user["sequence_parallel_size"] == "auto" and user["data_parallel_size"] == 2  # a copy was changed


def test_import_needs_no_deepspeed() -> None:
    code = ("import sys, ring_sp.integrations.deepspeed as m; "
            "m.RingSPConfig.from_ds_config({'ring_sp': {'ring_size': 2}}); "
            "assert 'deepspeed' not in sys.modules, 'deepspeed was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ---------------------------------------------------------------- rank functions

_EXAMPLE_MODULE = "ring_sp_deepspeed_pretrain_gpt"  # not "pretrain_gpt": the Megatron example has that name


def _example():
    """The example script as a module (its model, loss and DeepSpeed set-up)."""
    return load_script(_EXAMPLE_MODULE, EXAMPLE / "pretrain_gpt.py")


def _prepare_rank() -> None:
    import torch.distributed as dist

    os.environ["LOCAL_RANK"] = str(dist.get_rank())  # DeepSpeed requires it; one host
    skip_cpu_inference_comm_build()


def _global_batch(step: int, samples: int) -> torch.Tensor:
    """The same ``[samples, SEQ]`` token batch on every rank for a step."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (samples, SEQ), generator=g)


def _ds_config(stage: int, u: int, r: int, micro: int, clip: float, layout: str = "zigzag") -> dict:
    return {
        "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1, "gradient_clipping": clip,
        "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9, "ring_sp": {"ulysses_size": u, "ring_size": r, "layout": layout},
    }


def _engine(stage: int, u: int, r: int, micro: int, *, seed: int = 0, adam: bool = False, clip: float = CLIP,
            layout: str = "zigzag"):
    """A DeepSpeed engine over the example GPT with the ring_sp section (U x R)."""
    import ring_sp.integrations.deepspeed as rsp_ds

    ex = _example()
    config = _ds_config(stage, u, r, micro, clip, layout)
    topology = rsp_ds.build_topology(config)
    torch.manual_seed(seed)
    model = ex.GPT(ex.GPTConfig(**MODEL), topology, layout=layout)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2) if adam else torch.optim.SGD(model.parameters(), lr=0.5)
    engine, *_ = rsp_ds.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def _sp_step(engine, step: int, *, grads: bool = False) -> dict[str, Any]:
    """One optimizer step on the global batch of ``step``; loss (and DeepSpeed's reduced grads)."""
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_grad

    ex, topo = _example(), engine.ring_sp_topology
    micro = engine.train_micro_batch_size_per_gpu()
    mine = _global_batch(step, micro * topo.dp_size)[topo.dp_rank * micro:(topo.dp_rank + 1) * micro]
    shard = topo.shard_batch({"input_ids": mine})
    loss = ex.loss_fn(engine(shard["input_ids"], shard["position_ids"]), shard["labels"], engine)
    engine.backward(loss)
    out: dict[str, Any] = {"loss": loss.item()}
    if grads:
        out["grads"] = {n: safe_get_full_grad(p).detach().clone() for n, p in engine.module.named_parameters()}
    engine.step()
    across_dp = loss.detach().clone()
    dist.all_reduce(across_dp, group=topo.dp_group)  # equal token counts: the mean of means is the mean
    out["loss_dp"] = across_dp.item() / topo.dp_size
    return out


def _reference(steps: int, samples: int, *, clip: float) -> list[dict[str, Any]]:
    """The same model in plain PyTorch on the full sequences: per step loss and gradients."""
    ex = _example()
    torch.manual_seed(0)
    model = ex.GPT(ex.GPTConfig(**MODEL), None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    out = []
    for step in range(steps):
        batch = ex.rsp_ds.ShardingCollator(None)(list(_global_batch(step, samples)))
        loss = ex.loss_fn(model(batch["input_ids"], batch["position_ids"]), batch["labels"], None)
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item()
        optimizer.step()
        optimizer.zero_grad()
        out.append({"loss": loss.item(), "grads": grads, "norm": norm})
    return out


def _max_rel_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert got.keys() == want.keys()
    return max(((got[n].reshape(want[n].shape) - want[n]).norm() / want[n].norm()).item() for n in want)


def equivalence_case(stage: int, u: int, r: int, micro: int) -> dict[str, Any]:
    """Two steps under DeepSpeed with SP = U x R vs plain PyTorch on the full sequences."""
    import torch.distributed as dist

    _prepare_rank()
    engine = _engine(stage, u, r, micro)
    mpu, topo = engine.mpu, engine.ring_sp_topology
    steps = [_sp_step(engine, 0, grads=True), _sp_step(engine, 1)]
    ref = _reference(2, micro * topo.dp_size, clip=CLIP)
    return {
        "losses": [s["loss_dp"] for s in steps], "ref_losses": [s["loss"] for s in ref],
        "grad_rel_error": _max_rel_error(steps[0]["grads"], ref[0]["grads"]), "ref_norm": ref[0]["norm"],
        "zero_stage": engine.zero_optimization_stage(), "sequence_parallel_size": engine.sequence_parallel_size,
        "dp_world_size": engine.dp_world_size, "train_batch_size": engine.train_batch_size(),
        "sp_ranks": dist.get_process_group_ranks(mpu.get_sequence_parallel_group()),
        "dp_ranks": dist.get_process_group_ranks(mpu.get_data_parallel_group()),
        "zero_ranks": dist.get_process_group_ranks(engine.seq_data_parallel_group),
        "mp_ranks": dist.get_process_group_ranks(mpu.get_model_parallel_group()),
    }


def _packed_samples(count: int) -> list[dict[str, torch.Tensor]]:
    """``count`` rows of SEQ tokens of packed documents: length-1 documents, documents
    crossing every shard and row boundary (the same on every rank)."""
    g = torch.Generator().manual_seed(7)
    lengths = [1, 1, 3, 29, 17, 1, 40, 5, 2, 9]  # rows of 32 tokens cut documents 4 and 7: 8 pieces in 2 rows
    documents = [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]
    packed = _example().PackedDocuments(documents, SEQ)
    return [packed[i] for i in range(count)]


def packed_case(layout: str, u: int, r: int) -> dict[str, Any]:
    """One step on two packed rows (one micro-batch = one packed row of 64 tokens) under
    U x R vs the plain model attending inside each document of the full row."""
    import ring_sp.integrations.deepspeed as rsp_ds
    from deepspeed.utils import safe_get_full_grad

    _prepare_rank()
    engine = _engine(1, u, r, 2, layout=layout)
    ex, topo = _example(), engine.ring_sp_topology
    samples = _packed_samples(2)
    shard = rsp_ds.PackingCollator(topo, layout=layout)(samples)
    loss = ex.loss_fn(engine(shard["input_ids"], shard["position_ids"], shard["cu_seqlens"]), shard["labels"], engine)
    engine.backward(loss)
    grads = {n: safe_get_full_grad(p).detach().clone() for n, p in engine.module.named_parameters()}

    torch.manual_seed(0)
    model = ex.GPT(ex.GPTConfig(**MODEL), None)
    full = rsp_ds.PackingCollator(None, layout=layout)(samples)  # the same padding, unsharded
    ref = ex.loss_fn(model(full["input_ids"], full["position_ids"], full["cu_seqlens"]), full["labels"], None)
    ref.backward()
    return {"loss": (loss.item(), ref.item()), "documents": len(full["cu_seqlens"]) - 1,
            "grad_rel_error": _max_rel_error(grads, {n: p.grad for n, p in model.named_parameters()})}


def checkpoint_case(directory: str) -> dict[str, Any]:
    """Save under U2 x R2 after one step; resume under U1 x R4 and U4 x R1 (ZeRO-2, AdamW)."""
    _prepare_rank()
    engine = _engine(2, 2, 2, 2, adam=True)
    _sp_step(engine, 0)
    engine.save_checkpoint(directory, tag="step1")
    saved = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    out: dict[str, Any] = {"continuous": [_sp_step(engine, step)["loss_dp"] for step in (1, 2)]}
    for u, r in ((1, 4), (4, 1)):
        engine = _engine(2, u, r, 2, adam=True, seed=1)  # another init: only the checkpoint can match
        engine.load_checkpoint(directory, tag="step1")
        out[f"{u}x{r}"] = {
            "bitwise": all(torch.equal(p, saved[n]) for n, p in engine.module.named_parameters()),
            "losses": [_sp_step(engine, step)["loss_dp"] for step in (1, 2)],
        }
    return out


def other_world_case(directory: str) -> str:
    """Load the 4-rank checkpoint on 2 ranks: DeepSpeed must refuse the ZeRO optimizer state."""
    from deepspeed.runtime.zero.utils import ZeRORuntimeException

    _prepare_rank()
    engine = _engine(2, 1, 2, 2, adam=True)
    try:
        engine.load_checkpoint(directory, tag="step1")
    except ZeRORuntimeException as exc:
        return str(exc)
    return "loaded"


def sampler_case() -> dict[str, Any]:
    """U=2 x R=1 on 4 ranks (DP=2): which samples each rank's loader yields, and their shards."""
    import ring_sp.integrations.deepspeed as rsp_ds

    topology = rsp_ds.build_topology({"ring_sp": {"ulysses_size": 2}})
    dataset = [torch.arange(i * SEQ, (i + 1) * SEQ) for i in range(11)]  # sample i: tokens i*SEQ + position
    loader = rsp_ds.sequence_parallel_dataloader(dataset, topology, batch_size=2, seed=3)
    loader.sampler.set_epoch(1)
    samples, shards_ok = [], True
    for batch in loader:
        ids, pos, labels = batch["input_ids"], batch["position_ids"], batch["labels"]
        row = ids[:, :1] // SEQ
        samples.append(row.flatten().tolist())
        target = torch.where(pos == SEQ - 1, torch.full_like(ids, -100), ids + 1)  # shifted on the full row
        shards_ok &= ids.shape == (2, SEQ // 2) and bool((ids // SEQ == row).all() and (ids % SEQ == pos).all()
                                                          and torch.equal(labels, target))
    return {"dp_rank": topology.dp_rank, "sp_rank": topology.sp_rank, "samples": samples, "shards_ok": shards_ok}


def deepspeed_loader_case() -> dict[str, Any]:
    """DeepSpeed's own loader (``engine.deepspeed_io``) reads the mpu's DP rank: one sample per SP group."""
    import ring_sp.integrations.deepspeed as rsp_ds

    _prepare_rank()
    config = _ds_config(1, 1, 2, 2, CLIP)  # ring of 2 -> DP = 2
    topology = rsp_ds.build_topology(config)
    ex = _example()
    model = ex.GPT(ex.GPTConfig(**MODEL), topology)
    engine, *_ = rsp_ds.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=config)
    dataset = [torch.arange(i * SEQ, (i + 1) * SEQ) for i in range(8)]
    # what training_data= builds, minus the worker processes a daemonic pool rank cannot start
    loader = engine.deepspeed_io(dataset, collate_fn=rsp_ds.ShardingCollator(topology), num_local_io_workers=0)
    return {"dp_rank": topology.dp_rank, "samples": [(b["input_ids"][:, 0] // SEQ).tolist() for b in loader],
            "same_topology": engine.ring_sp_topology is topology}


def passthrough_and_errors_case(config_path: str) -> dict[str, Any]:
    """No section: plain deepspeed.initialize. Bad sections: every rank raises before any collective."""
    from deepspeed.utils import groups

    import ring_sp.integrations.deepspeed as rsp_ds

    _prepare_rank()
    groups.mpu = None  # DeepSpeed keeps the last engine's mpu process-wide; a fresh process has none
    ex = _example()
    model = ex.GPT(ex.GPTConfig(**MODEL), None)
    engine, *_ = rsp_ds.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                   config=config_path)
    out: dict[str, Any] = {"plain": (hasattr(engine, "ring_sp_topology"), engine.sequence_parallel_size,
                                     engine.dp_world_size, engine.train_batch_size())}
    errors = {}
    topology = rsp_ds.build_topology({"ring_sp": {"ulysses_size": 2, "ring_size": 2}})
    cases = {
        "world": (ex.GPT(ex.GPTConfig(**MODEL), None), {"ring_sp": {"ring_size": 3}}),
        "grid": (ex.GPT(ex.GPTConfig(**MODEL), topology), {"ring_sp": {"ring_size": 4}}),
        "layout": (ex.GPT(ex.GPTConfig(**MODEL), topology), {"ring_sp": {"ulysses_size": 2, "ring_size": 2, "layout": "contiguous"}}),
        "mpu": (ex.GPT(ex.GPTConfig(**MODEL), topology), {"ring_sp": {"ulysses_size": 2, "ring_size": 2}}),
        "no_section": (ex.GPT(ex.GPTConfig(**MODEL), topology), {}),  # a ring_sp model, DeepSpeed left to think it DP
    }
    for name, (net, section) in cases.items():
        config = {"train_micro_batch_size_per_gpu": 1, **section}
        try:
            rsp_ds.initialize(model=net, config=config, mpu=object() if name == "mpu" else None)
        except ValueError as exc:
            errors[name] = str(exc)
    out["errors"] = errors
    return out


# ---------------------------------------------------------------- distributed tests

@needs_deepspeed
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_sp_2x2_equals_full_sequence(pools, stage: int) -> None:
    """U=2 x R=2 on 4 ranks: same loss, same reduced gradients, same next-step loss as SP=1."""
    results = pools.get(4, env=DS_ENV).run(equivalence_case, stage, 2, 2, 2, timeout=240)
    for rank, res in enumerate(results):
        assert res["zero_stage"] == stage and res["sequence_parallel_size"] == 4
        assert (res["dp_world_size"], res["train_batch_size"]) == (1, 2)
        assert res["sp_ranks"] == res["zero_ranks"] == [0, 1, 2, 3]
        assert res["dp_ranks"] == res["mp_ranks"] == [rank]
        assert res["ref_norm"] > CLIP  # so gradient clipping ran and used DeepSpeed's norm
        assert res["grad_rel_error"] < 1e-5, res["grad_rel_error"]
        for loss, ref in zip(res["losses"], res["ref_losses"]):
            assert abs(loss - ref) <= 1e-5 * abs(ref), (res["losses"], res["ref_losses"])


@needs_deepspeed
@pytest.mark.parametrize("stage,u,r", [(2, 1, 2), (3, 2, 1)])
def test_dp2_x_sp2_equals_full_sequence(pools, stage: int, u: int, r: int) -> None:
    """DP=2 x (U x R = 2): every replica its own sample, gradients averaged over DP."""
    results = pools.get(4, env=DS_ENV).run(equivalence_case, stage, u, r, 1, timeout=240)
    for rank, res in enumerate(results):
        assert (res["dp_world_size"], res["train_batch_size"], res["sequence_parallel_size"]) == (2, 2, 2)
        assert res["sp_ranks"] == ([0, 1] if rank < 2 else [2, 3]) and res["dp_ranks"] == [rank % 2, rank % 2 + 2]
        assert res["zero_ranks"] == [0, 1, 2, 3]
        assert res["grad_rel_error"] < 1e-5, res["grad_rel_error"]
        for loss, ref in zip(res["losses"], res["ref_losses"]):
            assert abs(loss - ref) <= 1e-5 * abs(ref), (res["losses"], res["ref_losses"])


@needs_deepspeed
@pytest.mark.parametrize("layout,u,r", [("document_zigzag", 2, 2), ("zigzag", 1, 4), ("striped", 4, 1),
                                        ("document_balanced", 2, 2), ("auto", 1, 4)])
def test_packed_documents_equal_per_document_attention(pools, layout: str, u: int, r: int) -> None:
    """Issue 8: the packed data pipeline (cu_seqlens, in-document labels and positions)
    trains exactly like one rank attending inside each document of the full row."""
    _example()  # the rank functions import it by module name
    for res in pools.get(4, env=DS_ENV).run(packed_case, layout, u, r, timeout=240):
        loss, ref = res["loss"]
        assert res["documents"] == 8 and abs(loss - ref) <= 1e-5 * abs(ref), res
        assert res["grad_rel_error"] < 1e-5, res


@needs_deepspeed
def test_checkpoint_resumes_under_other_grids(pools, tmp_path: Path) -> None:
    """F5: saved at U2 x R2, loaded at U1 x R4 and U4 x R1: same parameters, same next losses."""
    results = pools.get(4, env=DS_ENV).run(checkpoint_case, str(tmp_path), timeout=240)
    for res in results:
        for grid in ("1x4", "4x1"):
            assert res[grid]["bitwise"], grid
            for loss, want in zip(res[grid]["losses"], res["continuous"]):
                assert abs(loss - want) <= 1e-6 * abs(want), (grid, res[grid]["losses"], res["continuous"])
    # another world size re-partitions ZeRO: refused with both sizes named (use a universal checkpoint)
    for message in pools.get(2, env=DS_ENV).run(other_world_case, str(tmp_path), timeout=120):
        assert "used a DP world size of 4 but the current world size is 2" in message


@needs_deepspeed
def test_sampler_same_sample_per_sp_group_different_across_dp(pools) -> None:
    results = pools.get(4, env=DS_ENV).run(sampler_case, timeout=120)
    assert all(res["shards_ok"] for res in results)
    by_dp = {}
    for res in results:
        by_dp.setdefault(res["dp_rank"], []).append(res["samples"])
    assert sorted(by_dp) == [0, 1]
    for group in by_dp.values():
        assert len(group) == 2 and group[0] == group[1]  # both SP ranks read the same samples
    seen = [s for batch in by_dp[0][0] + by_dp[1][0] for s in batch]
    assert len(seen) == 8 and len(set(seen)) == 8  # 11 samples, 2 replicas x 2 batches of 2, no repeats


@needs_deepspeed
def test_deepspeed_training_data_loader_follows_mpu(pools) -> None:
    results = pools.get(4, env=DS_ENV).run(deepspeed_loader_case, timeout=120)
    assert all(res["same_topology"] for res in results)
    assert results[0]["samples"] == results[1]["samples"] and results[2]["samples"] == results[3]["samples"]
    first, second = ({s for batch in res["samples"] for s in batch} for res in (results[0], results[2]))
    assert len(first) == len(second) == 4 and not first & second


@needs_deepspeed
def test_without_section_is_plain_deepspeed_and_bad_sections_raise_everywhere(pools, tmp_path: Path) -> None:
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**9}))
    results = pools.get(4, env=DS_ENV).run(passthrough_and_errors_case, str(config), timeout=180)
    for res in results:
        assert res["plain"] == (False, 1, 4, 4)
        errors = res["errors"]
        assert "ring_sp.ulysses_size x ring_sp.ring_size = 1 x 3 = 3 does not divide the world size 4" in errors["world"]
        assert "ring_sp.ulysses_size=1 but the model's attention topology has ulysses_size=2" in errors["grid"]
        assert "ring_sp.layout='contiguous' but module 'blocks.0.attn.core' was built with layout='zigzag'" in errors["layout"]
        assert "mpu= cannot be combined with the 'ring_sp' config section" in errors["mpu"]
        assert ("module 'blocks.0.attn.core' is a ring_sp.SequenceParallelAttention, but the DeepSpeed config passed to "
                'initialize is not sequence parallel (it has no "ring_sp" section)') in errors["no_section"], errors


def _run_example(*args: str) -> list[dict[str, Any]]:
    return run_launcher(EXAMPLE / "pretrain_gpt.sh", *args, timeout=240)


_EXAMPLE_TINY = ["--seq-len", "64", "--d-model", "32", "--layers", "2", "--micro-batch", "4", "--lr", "1e-2",
                 "--warmup", "2", "--corpus-bytes", "200000", "--log-json"]


def _example_trains(save: Path) -> list[dict[str, Any]]:
    first = _run_example(*_EXAMPLE_TINY, "--steps", "6", "--save", str(save))
    assert [r["step"] for r in first] == [1, 2, 3, 4, 5, 6]
    assert all(r["tokens_per_s"] > 0 for r in first) and first[-1]["loss"] < first[0]["loss"] - 0.3, first
    return first


@pytest.mark.slow  # the same launch is the default suite's tests/test_multinode.py::one_node_gpt (two nodes' reference)
@needs_deepspeed
def test_example_trains_and_saves(tmp_path: Path) -> None:
    """pretrain_gpt.sh --cpu (what ``make demo`` runs): 4 ranks at U2 x R2, the loss falls, a checkpoint is saved."""
    _example_trains(tmp_path)
    assert any(tmp_path.iterdir())


@pytest.mark.slow  # a second 4-rank launch; resuming across grids is also tested in-pool (test_checkpoint_resumes_under_other_grids)
@needs_deepspeed
def test_example_trains_saves_and_resumes(tmp_path: Path) -> None:
    """pretrain_gpt.sh --cpu: 4 ranks at U2 x R2, loss falls; resumed at U1 x R4 it continues the steps."""
    first = _example_trains(tmp_path)
    resumed = _run_example(*_EXAMPLE_TINY, "--steps", "8", "--load", str(tmp_path), "--ulysses-size", "1", "--ring-size", "4")
    assert [r["step"] for r in resumed] == [7, 8]
    assert max(r["loss"] for r in resumed) < first[0]["loss"] - 0.3, (first, resumed)
