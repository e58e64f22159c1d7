"""Issue 22 item 2, issue 31 items 1-2 (TESTING.md C24): a malformed shard gives the exact
result or a clear error on every rank before any collective, never a wrong number, with
DEFAULT settings (no ``RING_SP_VALIDATE``).

A VALID shard of ``shard_batch`` (packed and unpacked, U2 x R2 on 4 ranks, a small Llama
that never went through ``rsp_ds.initialize`` or the Trainer) is mutated one key at a time
(dropped, shifted by one, another rank's, another topology's, layout's or batch's), run with
``attn_implementation="ring_sp"`` and its loss taken with ``causal_lm_loss``. Each mutation
is applied on every rank, and again on rank 1 alone (one bad rank among good ones), and
classified on every rank as ``"exact"`` (the gathered logits equal the same model with sdpa
on one rank, fp32 2e-4 x max(1, max |logit|), and so does the loss) or ``"error: <message>"``
(within 10 s); a wrong number fails the test. The valid shard is the control (must be
exact). ``MUTATIONS`` is the list the issue note quotes; ``GPT_MUTATIONS`` do the same to the
DeepSpeed GPT example's ``cu_seqlens``.
"""

from __future__ import annotations

import importlib.util
import os
import re
import time
import types
from typing import Any

import pytest
import torch

import ring_sp

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")

# mutation -> what it must give: "exact" or a regex of the error (the same on every rank)
MUTATIONS: dict[str, str] = {
    "valid shard (control)": "exact",
    "shard of the same rank on another grid of the same size (U1xR4)": "exact",
    "fingerprint dropped (a hand-built shard with the global positions)": "exact",
    "cu_seq_lens_q/k dropped": "holds packed documents but cu_seq_lens_q/k were not passed",
    "cu_seq_lens_k dropped": "cu_seq_lens_q and cu_seq_lens_k must both be given",
    "cu_seq_lens_q/k and fingerprint dropped": "position_ids are not this rank's global positions",
    "a boundary of cu_seq_lens_q/k moved by one": "do not match the documents the shard was cut with",
    "cu_seq_lens_q/k of another packing": "do not match the documents the shard was cut with",
    "cu_seq_lens_q/k and fingerprint of another packing": "position_ids are not this rank's global positions",
    "cu_seq_lens_q/k added to an unpacked shard": "passed but the shard was cut without documents",
    "position_ids dropped": "the shard's LOCAL positions",
    "position_ids and fingerprint dropped": "the shard's LOCAL positions|not this rank's global positions",
    "position_ids shifted by one": "position_ids are not the shard's",
    "position_ids of another rank": "position_ids are not the shard's",
    "position_ids of another rank, no fingerprint": "argument check failed on rank",
    "whole shard of another rank": "argument check failed on rank",
    "shard truncated to half its tokens": "cut from a batch of",
    "shard of another topology (U1xR2)": "cut for 2 sequence-parallel ranks",
    "shard cut with another layout (contiguous)": "cut with layout='contiguous' but the attention runs",
    "fingerprint of another batch": "do not match the documents|are not the shard's|cut from a batch of",
    "fingerprint not a tensor": "must be the int64 \\[12\\] tensor",
    # issue 31: the inputs the checks above could not see
    "labels instead of shift_labels (a model that never went through initialize or the Trainer)":
        "was given labels=.* \\(and no shift_labels\\)",
    "input_ids of another rank": "input_ids are not the shard's",
    "shift_labels of another rank": "shift_labels given to the loss are not the shard's",
    "shift_labels of another rank, passed to the model too": "shift_labels given to the model are not the shard's",
    "unshifted labels to causal_lm_loss": "given to the loss equal the shard's input_ids: UNSHIFTED",
    "shard of another global batch of the same shapes (odd ranks)": "ranks disagree on the global batch",
    "loss with an engine of deepspeed.initialize (no ring_sp hookup)": "without ring_sp's hookup",
    "loss without engine= or topology=": "neither engine=",
}
# what differs when rank 1 alone is given the mutation (else as above)
ONE_BAD_RANK = {
    "fingerprint dropped (a hand-built shard with the global positions)": "ranks disagree on the global batch",
}


def _swap(value: Any, peer: int) -> Any:
    """``value`` of SP-group rank ``peer`` (every rank sends its own)."""
    import torch.distributed as dist

    import dist_cases

    values: list[Any] = [None] * 4
    dist.all_gather_object(values, value, group=dist_cases.topology(2, 2).sp_group)
    return values[peer]


def _mutated(name: str, shard: dict[str, Any], batch: dict[str, torch.Tensor], packed: bool) -> dict[str, Any] | None:
    """The mutated shard (None: the mutation does not apply to this kind of batch)."""
    import dist_cases
    import ring_sp.integrations.transformers as rsp_hf

    topo = dist_cases.topology(2, 2)
    peer = topo.sp_rank ^ 1
    s = dict(shard)
    cu = "cu_seq_lens_q" in s
    if name in ("loss without engine= or topology=", "position_ids shifted by one", "whole shard of another rank",
                "shard truncated to half its tokens", "fingerprint not a tensor", "position_ids dropped",
                "fingerprint dropped (a hand-built shard with the global positions)", "position_ids of another rank",
                "position_ids and fingerprint dropped", "position_ids of another rank, no fingerprint",
                "labels instead of shift_labels (a model that never went through initialize or the Trainer)"):
        if name == "position_ids shifted by one":
            s["position_ids"] = s["position_ids"] + 1
        elif name == "whole shard of another rank":
            s = _swap(s, peer)
        elif name == "shard truncated to half its tokens":
            half = s["input_ids"].shape[1] // 2
            s.update({k: s[k][:, :half] for k in ("input_ids", "position_ids", "shift_labels")})
        elif name == "fingerprint not a tensor":
            s["ring_sp_shard"] = s["ring_sp_shard"].tolist()
        elif name in ("position_ids dropped", "position_ids and fingerprint dropped"):
            del s["position_ids"]
        elif name == "position_ids of another rank":
            s["position_ids"] = _swap(s["position_ids"], peer)
        elif name == "position_ids of another rank, no fingerprint":
            s["position_ids"] = _swap(s["position_ids"], peer)
            del s["ring_sp_shard"]
        elif name.startswith("labels instead of shift_labels"):
            s["labels"] = topo.shard_sequence(batch["labels"], layout="zigzag") if not packed else s.pop("shift_labels")
            s.pop("shift_labels", None)
        if "fingerprint dropped" in name or name == "position_ids and fingerprint dropped":
            del s["ring_sp_shard"]
        return s
    if name in ("input_ids of another rank", "shift_labels of another rank",
                "shift_labels of another rank, passed to the model too"):
        key = "input_ids" if name.startswith("input_ids") else "shift_labels"
        s[key] = _swap(s[key], peer)
        return s
    if name == "unshifted labels to causal_lm_loss":
        s["shift_labels"] = s["input_ids"].clone()  # HF's labels = input_ids, not shifted
        return s
    if name == "shard of another global batch of the same shapes (odd ranks)":
        other = rsp_hf.shard_batch({**batch, "input_ids": batch["input_ids"].flip(-1)}, topo)  # every rank cuts it
        return other if topo.sp_rank % 2 else s
    if name.startswith("loss with") or name == "valid shard (control)":
        return s
    if name == "shard of the same rank on another grid of the same size (U1xR4)":
        return rsp_hf.shard_batch(batch, dist_cases.topology(1, 4))
    if name == "shard of another topology (U1xR2)":
        return rsp_hf.shard_batch(batch, dist_cases.topology(1, 2))
    if name == "shard cut with another layout (contiguous)":
        rsp_hf.register(topo, layout="contiguous")
        other = rsp_hf.shard_batch(batch, topo, layout="contiguous")
        rsp_hf.register(topo, layout="zigzag")
        return other
    if name == "fingerprint of another batch":
        other = {**batch, "input_ids": batch["input_ids"][..., : batch["input_ids"].shape[-1] // 2]}
        other = {k: v[..., : other["input_ids"].shape[-1]] for k, v in other.items()}
        s["ring_sp_shard"] = rsp_hf.shard_batch(other, topo)["ring_sp_shard"]
        return s
    if name == "cu_seq_lens_q/k added to an unpacked shard":
        if cu:
            return None
        n = s["input_ids"].shape[1] * topo.sp_size
        s["cu_seq_lens_q"] = s["cu_seq_lens_k"] = torch.tensor([0, n // 2, n], dtype=torch.int32)
        return s
    if not cu:
        return None  # the rest mutate documents
    if name == "cu_seq_lens_q/k dropped":
        del s["cu_seq_lens_q"], s["cu_seq_lens_k"]
    elif name == "cu_seq_lens_k dropped":
        del s["cu_seq_lens_k"]
    elif name == "cu_seq_lens_q/k and fingerprint dropped":
        del s["cu_seq_lens_q"], s["cu_seq_lens_k"], s["ring_sp_shard"]
    elif name == "a boundary of cu_seq_lens_q/k moved by one":
        moved = s["cu_seq_lens_q"].clone()
        moved[2] += 1
        s["cu_seq_lens_q"] = s["cu_seq_lens_k"] = moved
    elif name in ("cu_seq_lens_q/k of another packing", "cu_seq_lens_q/k and fingerprint of another packing"):
        n = int(s["cu_seq_lens_q"][-1])
        s["cu_seq_lens_q"] = s["cu_seq_lens_k"] = torch.tensor([0, 10, 20, n], dtype=torch.int32)
        if "fingerprint" in name:
            del s["ring_sp_shard"]
    return s


def _loss(name: str, logits: torch.Tensor, labels: torch.Tensor, model: Any, topo: Any) -> torch.Tensor:
    import ring_sp.integrations.transformers as rsp_hf

    if name == "loss with an engine of deepspeed.initialize (no ring_sp hookup)":
        return rsp_hf.causal_lm_loss(logits, labels, engine=types.SimpleNamespace(module=model))
    if name == "loss without engine= or topology=":
        return rsp_hf.causal_lm_loss(logits, labels)
    return rsp_hf.causal_lm_loss(logits, labels, topology=topo, gradients_averaged_over_sp=False)


def mutation_case(packed: bool) -> dict[str, dict[str, str]]:
    """Every mutation on this rank, applied on every rank ("all") and on rank 1 alone ("one"):
    "exact", "skip", or "error (<seconds> s): <message>" (see the module docstring)."""
    import torch.distributed as dist

    import dist_cases
    import ring_sp.integrations.transformers as rsp_hf
    from ring_sp.integrations.transformers.features import layout_for
    from test_transformers import _global_batch, _models, _reference_run

    topo = dist_cases.topology(2, 2)
    rsp_hf.register(topo, layout="zigzag")
    batch = _global_batch(packed)
    reference, model = _models("llama", torch.float32, "from_config")
    ref_logits, ref_loss, _ = _reference_run(reference, batch)
    model.eval()  # and no forbid_labels: a model that never went through rsp_ds.initialize or the Trainer
    shard = rsp_hf.shard_batch(batch, topo)
    cu = shard.get("cu_seq_lens_q")
    real = batch["input_ids"].numel() if cu is not None else None
    layout = layout_for("zigzag", packed=cu is not None)
    scale = max(1.0, ref_logits.abs().max().item())
    saved = os.environ.pop("RING_SP_VALIDATE", None)  # DEFAULT settings
    out: dict[str, dict[str, str]] = {"all": {}, "one": {}}
    try:
        for mode in ("all", "one"):
            for name in MUTATIONS:
                inputs = _mutated(name, shard, batch, packed)  # every rank builds it (some swap with a peer)
                if inputs is None:
                    out[mode][name] = "skip"
                    continue
                applied = name if mode == "all" or topo.sp_rank == 1 else "valid shard (control)"
                if applied != name:
                    inputs = dict(shard)
                to_model = {k: v for k, v in inputs.items() if k != "shift_labels" or applied.endswith("to the model too")}
                start = time.perf_counter()
                try:
                    with torch.no_grad():
                        logits = model(**to_model).logits
                        loss = _loss(applied, logits, inputs["shift_labels"], model, topo) if "shift_labels" in inputs else None
                except (ValueError, TypeError) as exc:
                    out[mode][name] = f"error ({time.perf_counter() - start:.1f} s): {exc}"
                    continue
                gathered = topo.gather_sequence(logits, layout=layout, cu_seqlens=cu, seq_len=real)
                error = (gathered.reshape(ref_logits.shape) - ref_logits).abs().max().item() / scale
                if loss is not None:
                    error = max(error, abs(loss.item() - ref_loss) / max(1.0, abs(ref_loss)))
                out[mode][name] = "exact" if error <= 2e-4 else f"WRONG: logits or loss error {error:.3g}"
                dist.barrier()
        if packed:  # negative control: without the checks the same mutation IS a wrong number
            import ring_sp.integrations.transformers.attention as attention

            check, attention.check_shard = attention.check_shard, lambda *args, **kwargs: None
            try:
                inputs = _mutated("cu_seq_lens_q/k dropped", shard, batch, packed)
                with torch.no_grad():
                    logits = model(**{k: v for k, v in inputs.items() if k != "shift_labels"}).logits
                gathered = topo.gather_sequence(logits, layout=layout, cu_seqlens=cu, seq_len=real)
                out["control"] = (gathered.reshape(ref_logits.shape) - ref_logits).abs().max().item() / scale
            finally:
                attention.check_shard = check
    finally:
        if saved is not None:
            os.environ["RING_SP_VALIDATE"] = saved
    return out


def _assert_outcomes(results: list[dict[str, str]], mutations: dict[str, str], one_bad_rank: dict[str, str]) -> None:
    for name, want in mutations.items():
        want = one_bad_rank.get(name, want)
        got = [res[name] for res in results]
        if got[0] == "skip":
            assert all(g == "skip" for g in got), (name, got)
            continue
        assert not any(g.startswith("WRONG") for g in got), f"{name}: a wrong number: {got}"
        if want == "exact":
            assert all(g == "exact" for g in got), f"{name}: {got}"
            continue
        for rank, g in enumerate(got):
            found = re.fullmatch(r"error \((\S+) s\): (.*)", g, re.S)
            assert found and re.search(want, found[2]), f"{name}, rank {rank}: {g}"
            assert float(found[1]) < 10, f"{name}, rank {rank}: the error took {found[1]} s"


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
def test_every_mutation_is_exact_or_a_clear_error_on_every_rank(pools, packed: bool) -> None:
    results = pools.get(4).run(mutation_case, packed, timeout=300)
    if packed:
        assert all(res["control"] > 1e-2 for res in results), "with the checks off, dropping cu_seq_lens must be wrong"
    _assert_outcomes([res["all"] for res in results], MUTATIONS, {})
    _assert_outcomes([res["one"] for res in results], MUTATIONS, ONE_BAD_RANK)


# ---- the DeepSpeed GPT example's own cu_seqlens ------------------------------------------

GPT_MUTATIONS: dict[str, str] = {
    "valid packed batch (control)": "exact",
    "valid unpacked batch (control)": "exact",
    "cu_seqlens dropped": "position_ids are not the global positions",
    "a boundary of cu_seqlens moved by one": "position_ids are not the global positions",
    "cu_seqlens of another packing": "position_ids are not the global positions",
    "cu_seqlens added to an unpacked batch": "position_ids are not the global positions",
    "a boundary moved by one on rank 1 alone": "argument check failed on rank\\(s\\) \\[1\\]|disagree",
}
_GPT_DOCS = (0, 5, 16, 19, 32)  # 4 documents of 5, 11, 3 and 13 tokens


def _gpt_batch(name: str, topo: Any) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(global row, this rank's shard with the mutation) for the GPT example's collators."""
    import ring_sp.integrations.deepspeed as rsp_ds

    g = torch.Generator().manual_seed(3)
    if "unpacked" in name:
        ids = torch.randint(0, 64, (2, 32), generator=g)
        shard = rsp_ds.ShardingCollator(topo, layout="zigzag")(list(ids))
        full = {"input_ids": ids, "position_ids": torch.arange(32).expand(2, 32), "cu_seqlens": None}
        if name == "cu_seqlens added to an unpacked batch":
            shard["cu_seqlens"] = torch.tensor([0, 16, 32], dtype=torch.int32)
        return full, shard
    ids = torch.randint(0, 64, (32,), generator=g)
    cu = torch.tensor(_GPT_DOCS)
    shard = rsp_ds.PackingCollator(topo, layout="zigzag")([{"input_ids": ids, "cu_seqlens": cu}])
    positions = torch.cat([torch.arange(b - a) for a, b in zip(_GPT_DOCS, _GPT_DOCS[1:])])
    full = {"input_ids": ids[None], "position_ids": positions[None], "cu_seqlens": cu}
    moved = torch.tensor([0, 5, 17, 19, 32], dtype=torch.int32)
    if name == "cu_seqlens dropped":
        del shard["cu_seqlens"]
    elif name == "a boundary of cu_seqlens moved by one" or (name.endswith("rank 1 alone") and topo.sp_rank == 1):
        shard["cu_seqlens"] = moved
    elif name == "cu_seqlens of another packing":
        shard["cu_seqlens"] = torch.tensor([0, 8, 24, 32], dtype=torch.int32)
    return full, shard


def gpt_cu_seqlens_case(check: bool = True) -> dict[str, str]:
    """Every GPT_MUTATIONS case on this rank ("exact", "error (<s> s): ..." or "WRONG ..."); with
    ``check=False`` the example's check is switched off (the negative control)."""
    import sys
    from pathlib import Path

    import dist_cases

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, for examples/
    import examples.deepspeed.pretrain_gpt as example

    topo = dist_cases.topology(2, 2)
    cfg = example.GPTConfig(vocab_size=64, d_model=32, n_layer=2, n_head=4, n_kv_head=2)
    torch.manual_seed(0)
    plain = example.GPT(cfg).eval()
    model = example.GPT(cfg, topo, layout="zigzag").eval()
    model.load_state_dict(plain.state_dict())
    saved = os.environ.pop("RING_SP_VALIDATE", None)  # DEFAULT settings
    original = example.shard_positions_error
    if not check:
        example.shard_positions_error = lambda *args, **kwargs: None
    out = {}
    try:
        for name in GPT_MUTATIONS if check else ["cu_seqlens dropped"]:
            full, shard = _gpt_batch(name, topo)
            with torch.no_grad():
                want = plain(full["input_ids"], full["position_ids"], full["cu_seqlens"])
                start = time.perf_counter()
                try:
                    logits = model(shard["input_ids"], shard["position_ids"], shard.get("cu_seqlens"))
                except (ValueError, TypeError) as exc:
                    out[name] = f"error ({time.perf_counter() - start:.1f} s): {exc}"
                    continue
            cu = None if full["cu_seqlens"] is None else tuple(_GPT_DOCS)
            got = topo.gather_sequence(logits, layout="zigzag", cu_seqlens=cu).reshape(want.shape)
            error = (got - want).abs().max().item() / max(1.0, want.abs().max().item())
            out[name] = "exact" if error <= 2e-5 else f"WRONG: logits error {error:.3g}"
    finally:
        example.shard_positions_error = original
        if saved is not None:
            os.environ["RING_SP_VALIDATE"] = saved
    return out


def test_gpt_example_cu_seqlens_are_checked_on_every_rank(pools) -> None:
    pool = pools.get(4)
    _assert_outcomes(pool.run(gpt_cu_seqlens_case, timeout=120), GPT_MUTATIONS, {})
    control = pool.run(gpt_cu_seqlens_case, False, timeout=120)
    assert all(res["cu_seqlens dropped"].startswith("WRONG") for res in control), control


# ---- shard_batch's own errors on ONE rank (issue 39) -----------------------------------------

# what rank 1 alone passes to shard_batch -> the error every rank must raise (the agreement names rank 1)
SHARD_BATCH_ON_ONE_RANK: dict[str, str] = {
    "layout= not register()'s": "layout='contiguous' but register\\(\\) was given layout='zigzag'",
    "topology= not a topology": "topology must be a ring_sp.SequenceParallelTopology",
    "topology= of another size (U1xR2)": "cut for 2 sequence-parallel ranks",  # the attention finds it
    "batch without input_ids": "must be a mapping with 'input_ids'",
    "batch with a 1-D input_ids": "must be an integer tensor \\[batch, seq\\]",
}


def shard_batch_one_rank_case(packed: bool) -> dict[str, str]:
    """Every rank: ``shard_batch`` (rank 1 with one of :data:`SHARD_BATCH_ON_ONE_RANK`), then the model and the
    loss as a training loop runs them; "exact" or "error (<seconds> s): <message>" per mutation, with DEFAULT
    settings. The valid shard (control) must be exact."""
    import dist_cases
    import ring_sp.integrations.transformers as rsp_hf
    from test_transformers import _global_batch, _models, _reference_run

    topo, other = dist_cases.topology(2, 2), dist_cases.topology(1, 2)  # made by every rank (collective)
    rsp_hf.register(topo, layout="zigzag")
    batch = _global_batch(packed)
    reference, model = _models("llama", torch.float32, "from_config")
    ref_logits, _, _ = _reference_run(reference, batch)
    model.eval()
    saved = os.environ.pop("RING_SP_VALIDATE", None)  # DEFAULT settings
    out = {}
    try:
        for name in ["valid shard (control)", *SHARD_BATCH_ON_ONE_RANK]:
            given, layout, topology = dict(batch), "zigzag", topo
            if topo.sp_rank == 1:
                if name.startswith("layout="):
                    layout = "contiguous"
                elif name == "topology= not a topology":
                    topology = "U2xR2"
                elif name.startswith("topology= of another size"):
                    topology = other
                elif name == "batch without input_ids":
                    given["tokens"] = given.pop("input_ids")
                elif name == "batch with a 1-D input_ids":
                    given["input_ids"] = given["input_ids"].flatten()
            start = time.perf_counter()
            try:
                shard = rsp_hf.shard_batch(given, topology, layout=layout)
                with torch.no_grad():
                    logits = model(**{k: v for k, v in shard.items() if k != "shift_labels"}).logits
                    rsp_hf.causal_lm_loss(logits, shard["shift_labels"], topology=topo,
                                          gradients_averaged_over_sp=False)
            except (ValueError, TypeError) as exc:
                out[name] = f"error ({time.perf_counter() - start:.1f} s): {exc}"
                continue
            cu = shard.get("cu_seq_lens_q")
            gathered = topo.gather_sequence(logits, layout="document_zigzag" if cu is not None else "zigzag",
                                            cu_seqlens=cu, seq_len=None if cu is None else batch["input_ids"].numel())
            error = (gathered.reshape(ref_logits.shape) - ref_logits).abs().max().item()
            out[name] = "exact" if error <= 2e-4 * max(1.0, ref_logits.abs().max().item()) else f"WRONG: {error:.3g}"
    finally:
        if saved is not None:
            os.environ["RING_SP_VALIDATE"] = saved
    return out


def test_shard_batch_error_on_one_rank_fails_every_rank(pools) -> None:
    """A wrong layout, a wrong topology, a batch without input_ids (or with 1-D ones) given to shard_batch on rank 1
    alone: every rank raises rank 1's error within 10 s (shard_batch's agreement, or the attention's for a topology
    of another size), never a peer waiting in the model's first collective."""
    results = pools.get(4).run(shard_batch_one_rank_case, True, timeout=120)
    assert all(res["valid shard (control)"] == "exact" for res in results), results
    _assert_outcomes(results, {name: f"argument check failed on rank\\(s\\) \\[1\\][\\s\\S]*{want}"
                               for name, want in SHARD_BATCH_ON_ONE_RANK.items()}, {})


TOPOLOGY_SHARD_BATCH_ON_ONE_RANK: dict[str, str] = {
    "layout= another rank's (contiguous)": "ranks disagree on the call's arguments: rank\\(s\\) \\[1\\]",
    "cu_seqlens past the batch": "argument check failed on rank\\(s\\) \\[1\\][\\s\\S]*cu_seqlens",
    "spans crossing a document": "argument check failed on rank\\(s\\) \\[1\\][\\s\\S]*span",
    "batch without input_ids": "argument check failed on rank\\(s\\) \\[1\\][\\s\\S]*must contain 'input_ids'",
    "batch with a 1-D input_ids": "argument check failed on rank\\(s\\) \\[1\\][\\s\\S]*must be \\[batch, seq\\]",
}


def topology_shard_batch_one_rank_case() -> dict[str, str]:
    """Every rank: the topology's ``shard_batch`` of one packed global batch (rank 1 with one of
    :data:`TOPOLOGY_SHARD_BATCH_ON_ONE_RANK`), then the grid's attention on the shard, as a
    training loop runs them, with DEFAULT settings: "exact" (the control, against one rank's
    attention) or "error (<seconds> s): <message>"."""
    import dist_cases

    topo = dist_cases.topology(2, 2)
    n, cu, spans = 64, [0, 24, 64], [[4, 12], [30, 40]]
    ids = torch.randint(0, 100, (1, n), generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, n, 4, 8, generator=g, dtype=torch.float64) for _ in range(3))
    mask = torch.zeros(n, n, dtype=torch.bool)
    for a, b in zip(cu, cu[1:]):
        mask[a:b, a:b] = torch.ones(b - a, b - a, dtype=torch.bool).tril()
    for a, b in spans:
        mask[a:b, a:b] = True
    want = torch.softmax((q.transpose(1, 2) @ k.transpose(1, 2).transpose(-1, -2) * 8 ** -0.5)
                         .masked_fill(~mask, float("-inf")), -1) @ v.transpose(1, 2)
    saved = os.environ.pop("RING_SP_VALIDATE", None)  # DEFAULT settings
    out = {}
    try:
        for name in ["valid shard (control)", *TOPOLOGY_SHARD_BATCH_ON_ONE_RANK]:
            batch, layout, given_cu, given_spans = {"input_ids": ids}, "document_zigzag", cu, spans
            if topo.sp_rank == 1:
                if name.startswith("layout="):
                    layout = "contiguous"
                elif name == "cu_seqlens past the batch":
                    given_cu = [0, 24, 65]
                elif name == "spans crossing a document":
                    given_spans = [[4, 12], [20, 30]]
                elif name == "batch without input_ids":
                    batch = {"tokens": ids}
                elif name == "batch with a 1-D input_ids":
                    batch = {"input_ids": ids.flatten()}
            start = time.perf_counter()
            try:
                shard = topo.shard_batch(batch, layout=layout, cu_seqlens=given_cu, spans=given_spans)
                local = [topo.shard_sequence(x, layout=layout, cu_seqlens=shard["cu_seqlens"]) for x in (q, k, v)]
                got = ring_sp.hybrid_attention(*local, topology=topo, causal=True, layout=layout,
                                               cu_seqlens=shard["cu_seqlens"], spans=shard["spans"])
            except (ValueError, TypeError) as exc:
                out[name] = f"error ({time.perf_counter() - start:.1f} s): {exc}"
                continue
            full = topo.gather_sequence(got, layout=layout, cu_seqlens=shard["cu_seqlens"])
            error = (full - want.transpose(1, 2)).abs().max().item()
            out[name] = "exact" if error <= 1e-10 else f"WRONG: {error:.3g}"
    finally:
        if saved is not None:
            os.environ["RING_SP_VALIDATE"] = saved
    return out


def test_topology_shard_batch_error_on_one_rank_fails_every_rank(pools) -> None:
    """The core API (``topology.shard_batch``, the DeepSpeed and Megatron examples' path) as the Hugging Face
    one above: an error on rank 1 alone (or rank 1 alone on another layout) raises on every rank within 10 s
    with rank 1's message, never a peer waiting in the attention's collectives; the valid batch is exact."""
    results = pools.get(4).run(topology_shard_batch_one_rank_case, timeout=120)
    assert all(res["valid shard (control)"] == "exact" for res in results), results
    _assert_outcomes(results, dict(TOPOLOGY_SHARD_BATCH_ON_ONE_RANK), {})
