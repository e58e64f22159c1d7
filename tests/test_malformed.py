"""Issue 22 item 2 (TESTING.md C24): a malformed shard gives the exact result or a clear error
on every rank before any collective, never a wrong number.

A VALID shard of ``shard_batch`` (packed and unpacked, U2 x R2 on 4 ranks, a small Llama)
is mutated one key at a time (dropped, shifted by one, another rank's, another topology's
or layout's) and run with ``attn_implementation="ring_sp"``. Each mutation is classified on
every rank as ``"exact"`` (the gathered logits equal the same model with sdpa on one rank,
fp32 2e-4 x max(1, max |logit|)) or ``"error: <message>"``; a wrong number fails the test.
``RING_SP_VALIDATE=1`` makes an error found on some ranks only (another rank's shard) fail
on all of them; the valid shard is the control (must be exact). ``MUTATIONS`` is the list
the issue note quotes.
"""

from __future__ import annotations

import importlib.util
import os
import re
from typing import Any

import pytest
import torch

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
    "fingerprint not a tensor": "must be the int64 \\[7\\] tensor",
    "labels instead of shift_labels": "was given labels=.* \\(and no shift_labels\\)",
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
    if name in ("valid shard (control)", "position_ids shifted by one", "whole shard of another rank",
                "shard truncated to half its tokens", "fingerprint not a tensor", "position_ids dropped",
                "fingerprint dropped (a hand-built shard with the global positions)", "position_ids of another rank",
                "position_ids and fingerprint dropped", "position_ids of another rank, no fingerprint",
                "labels instead of shift_labels"):
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
        elif name == "labels instead of shift_labels":
            s["labels"] = topo.shard_sequence(batch["labels"], layout="zigzag") if not packed else s.pop("shift_labels")
            s.pop("shift_labels", None)
        if "fingerprint dropped" in name or name == "position_ids and fingerprint dropped":
            del s["ring_sp_shard"]
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


def mutation_case(packed: bool) -> dict[str, str]:
    """Every mutation on this rank: "exact", "skip", or "error: <message>" (see the module docstring)."""
    import torch.distributed as dist

    import dist_cases
    import ring_sp.integrations.transformers as rsp_hf
    from ring_sp.integrations.transformers.features import forbid_labels, layout_for
    from test_transformers import _global_batch, _models, _reference_run

    topo = dist_cases.topology(2, 2)
    rsp_hf.register(topo, layout="zigzag")
    batch = _global_batch(packed)
    reference, model = _models("llama", torch.float32, "from_config")
    ref_logits = _reference_run(reference, batch)[0]
    model.eval()
    forbid_labels(model, topo.sp_size)  # what rsp_ds.initialize and SequenceParallelTrainer install
    shard = rsp_hf.shard_batch(batch, topo)
    cu = shard.get("cu_seq_lens_q")
    real = batch["input_ids"].numel() if cu is not None else None
    layout = layout_for("zigzag", packed=cu is not None)
    scale = max(1.0, ref_logits.abs().max().item())
    saved = os.environ.get("RING_SP_VALIDATE")
    os.environ["RING_SP_VALIDATE"] = "1"
    out: dict[str, str] = {}
    try:
        for name in MUTATIONS:
            inputs = _mutated(name, shard, batch, packed)
            if inputs is None:
                out[name] = "skip"
                continue
            try:
                with torch.no_grad():
                    logits = model(**{k: v for k, v in inputs.items() if k != "shift_labels"}).logits
            except (ValueError, TypeError) as exc:
                out[name] = f"error: {exc}"
                continue
            gathered = topo.gather_sequence(logits, layout=layout, cu_seqlens=cu, seq_len=real)
            error = (gathered.reshape(ref_logits.shape) - ref_logits).abs().max().item() / scale
            out[name] = "exact" if error <= 2e-4 else f"WRONG: logits error {error:.3g}"
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
        if saved is None:
            del os.environ["RING_SP_VALIDATE"]
        else:
            os.environ["RING_SP_VALIDATE"] = saved
    return out


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
def test_every_mutation_is_exact_or_a_clear_error_on_every_rank(pools, packed: bool) -> None:
    results = pools.get(4).run(mutation_case, packed, timeout=300)
    if packed:
        assert all(res["control"] > 1e-2 for res in results), "with the checks off, dropping cu_seq_lens must be wrong"
    for name, want in MUTATIONS.items():
        got = [res[name] for res in results]
        if got[0] == "skip":
            assert all(g == "skip" for g in got), (name, got)
            continue
        assert not any(g.startswith("WRONG") for g in got), f"{name}: a wrong number: {got}"
        if want == "exact":
            assert all(g == "exact" for g in got), f"{name}: {got}"
        else:
            for rank, g in enumerate(got):
                assert g.startswith("error: ") and re.search(want, g), f"{name}, rank {rank}: {g}"
