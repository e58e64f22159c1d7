"""C20 (sinks and value head size): attention sinks and a value head size different from
the q/k head size (MLA), in every mode, against the float64 oracle.

The oracle adds one sink column per head to the score matrix and drops its probabilities
(gpt-oss's formulation); ring_sp folds the sinks into the merged log-sum-exp once. Each
rank's ``sinks.grad`` is its rows' share, so the SUM over the SP ranks is compared with
the oracle's gradient. Value head sizes 8 and 24 with q/k head size 16.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.distributed as dist

import ring_sp
from dist_cases import AttnCase, check_attention_cases
from ring_sp.kernels import get_kernel, unavailable_reason
from ring_sp.kernels.reference import ReferenceKernel
from ring_sp.plan import layer_bytes

LAYOUTS = ("contiguous", "zigzag", "striped")
DTYPES = ("fp64", "fp32", "bf16")


def _cases(mode: str, *, u: int = 1, r: int = 1, layouts=LAYOUTS, dtypes=DTYPES,
           packed: tuple[bool, ...] = (False,)) -> list[AttnCase]:
    """sinks on/off x d_v (16 = d, 8, 24) x layout x causal x dtype, shapes rotated."""
    heads = itertools.cycle([(4, 4), (8, 2), (4, 1)] if u == 1 else [(2 * u, u), (2 * u, 1), (4 * u, 2 * u)])
    cases = []
    for sinks, d_v, layout, causal, dtype, docs in itertools.product(
            (True, False), (None, 8, 24), layouts, (True, False), dtypes, packed):
        if not sinks and d_v is None:
            continue  # the plain case is the other test files' job
        h, h_kv = next(heads)
        cases.append(AttnCase(mode, layout, causal, 1 + len(cases) % 2, 4, h, h_kv, 16, dtype, seed=len(cases),
                              ulysses=u if mode != "ring" else 1, ring=r if mode != "ulysses" else 1,
                              packed=docs, sinks=sinks, d_v=d_v))
    return cases


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow), 4])  # 3: a sweep case
def test_ring_sinks_and_value_head_size(pools, world_size: int) -> None:
    cases = _cases("ring", r=world_size, dtypes=("fp64", "bf16") if world_size == 3 else DTYPES)
    pools.get(world_size).run(check_attention_cases, cases, timeout=600)


def test_ulysses_sinks_and_value_head_size(pools) -> None:
    cases = _cases("ulysses", u=4)
    pools.get(4).run(check_attention_cases, cases, timeout=600)


def test_grid_sinks_and_value_head_size(pools) -> None:
    cases = _cases("hybrid", u=2, r=2, layouts=("zigzag", "contiguous"))
    pools.get(4).run(check_attention_cases, cases, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_packed_documents_with_sinks_and_value_head_size(pools, world_size: int) -> None:
    cases = _cases("ring", r=world_size, layouts=("zigzag", "document_zigzag"), packed=(True,))
    pools.get(world_size).run(check_attention_cases, cases, timeout=600)


def test_packed_documents_sample(pools) -> None:
    """The unmarked sample of the sweep above: documents crossing shards, sinks and d_v."""
    cases = [AttnCase("ring", layout, True, 1, 8, 4, 2, 16, dtype, seed=s, ring=4, packed=True, sinks=True, d_v=d_v)
             for s, (layout, dtype, d_v) in enumerate(itertools.product(
                 ("zigzag", "document_zigzag"), ("fp64", "bf16"), (None, 24)))]
    cases += [AttnCase("hybrid", "document_zigzag", True, 1, 8, 4, 2, 16, "fp32", seed=9, ulysses=2, ring=2,
                       packed=True, sinks=True, d_v=8)]
    # Ulysses alone: one ring rank, one kernel call per document (the ring's local path)
    cases += [AttnCase("ulysses", "document_zigzag", causal, 1, 8, 4, 2, 16, dtype, seed=10 + i, ulysses=4,
                       packed=True, sinks=True, d_v=24)
              for i, (causal, dtype) in enumerate(itertools.product((True, False), ("fp64", "bf16")))]
    pools.get(4).run(check_attention_cases, cases, timeout=600)


EXTREME = ((1e4, -1e4, 30.0, float("-inf")), (-80.0, 80.0, 0.0, 1e-3))


@pytest.mark.parametrize("values", EXTREME, ids=["huge-tiny-inf", "pm80"])
def test_extreme_sink_values(pools, values: tuple[float, ...]) -> None:
    """A sink that swallows the row (out -> 0), one that vanishes, -inf (no sink): exact, finite."""
    cases = [AttnCase(mode, layout, causal, 1, 4, 4, 2, 16, dtype, seed=i, ring=2 if mode == "ring" else 1,
                      ulysses=2 if mode == "hybrid" else 1, sinks=values, d_v=8 if i % 2 else None)
             for i, (mode, layout, causal, dtype) in enumerate(itertools.product(
                 ("ring", "hybrid"), ("zigzag", "striped"), (True, False), ("fp64", "fp32", "bf16")))
             if not (mode == "hybrid" and layout == "striped")]
    pools.get(2).run(check_attention_cases, cases, timeout=600)


# ---------------------------------------------------------------------------- checks, kernels, bytes


@pytest.mark.parametrize("sinks,error,match", [
    ("1.0", TypeError, r"sinks must be a torch.Tensor \[heads\].*got str"),
    (torch.zeros(2), ValueError, r"sinks must be 1-D with one logit per query head, shape \(4,\).*got Tensor\(shape=\(2,\)"),
    (torch.zeros(4, 1), ValueError, r"sinks must be 1-D"),
    (torch.zeros(4, dtype=torch.int64), TypeError, r"sinks.dtype=torch.int64 is not supported"),
    (torch.zeros(4, device="meta"), ValueError, r"sinks must be on q's device cpu; got sinks on meta"),
])
def test_bad_sinks_are_refused_naming_the_argument(single_rank, sinks, error, match) -> None:
    q, k, v = torch.randn(1, 8, 4, 16), torch.randn(1, 8, 2, 16), torch.randn(1, 8, 2, 8)
    with pytest.raises(error, match=match):
        ring_sp.ring_attention(q, k, v, sinks=sinks)


def _disagreeing_sinks() -> str:
    q, k, v = torch.randn(1, 8, 4, 16), torch.randn(1, 8, 2, 16), torch.randn(1, 8, 2, 16)
    sinks = torch.zeros(4, dtype=torch.float32 if dist.get_rank() == 0 else torch.float64)
    try:
        ring_sp.ring_attention(q, k, v, causal=True, sinks=sinks)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_ranks_disagreeing_on_sinks_fail_together(pools) -> None:
    for message in pools.get(2).run(_disagreeing_sinks, timeout=60):
        assert "ranks disagree" in message and "sinks=Tensor(shape=(4,), dtype=torch.float64)" in message, message


def test_value_head_size_kernel_choice() -> None:
    """The CPU op refuses d_v != d (so its backend says why and auto picks reference);
    the reference kernel computes it."""
    cpu = torch.device("cpu")
    with pytest.raises(RuntimeError, match="same head size"):  # torch's own refusal, the reason's source
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            torch.randn(1, 2, 4, 16), torch.randn(1, 2, 4, 16), torch.randn(1, 2, 4, 8), 0.0, True)
    assert "value head size" in unavailable_reason("torch", cpu, torch.float32, 16, 8)
    assert unavailable_reason("torch", cpu, torch.float32, 16, 16) is None
    assert get_kernel("auto", cpu, torch.float32, 16, 8).name == "reference"
    assert get_kernel("auto", cpu, torch.float32, 16).name == "torch"
    with pytest.raises(RuntimeError, match=r"backend='torch' is unavailable: .*value head size"):
        get_kernel("torch", cpu, torch.float32, 16, 24)
    out, lse = ReferenceKernel().forward(torch.randn(1, 5, 4, 16), torch.randn(1, 5, 2, 16), torch.randn(1, 5, 2, 24),
                                         causal=True, scale=0.25)
    assert out.shape == (1, 5, 4, 24) and lse.shape == (1, 4, 5)


def test_layer_bytes_with_value_head_size_by_hand() -> None:
    """U2 x R2, b 1, 8 tokens per rank, 8 q / 2 kv heads, d 16, d_v 8, bf16 (2 bytes, fp32 acc 4)."""
    fwd, bwd = layer_bytes(ulysses=2, ring=2, batch=1, local_len=8, heads=8, kv_heads=2, head_dim=16, dtype="bf16",
                           value_head_dim=8)
    half = lambda elements, size: elements // 2 * size  # noqa: E731  (U-1)/U of an all-to-all's input
    kv_shard = 8 * 2 * 1 * (16 + 8)  # N/R = 16 tokens x 1 kv head per Ulysses rank x (d + d_v)
    assert fwd == {"ulysses_a2a_q": half(8 * 8 * 16, 2), "ulysses_a2a_out": half(8 * 8 * 8, 2),
                   "ulysses_a2a_kv": half(8 * 2 * (16 + 8), 2), "ring_kv": kv_shard * 2}
    assert bwd == {"ulysses_a2a_dout": half(8 * 8 * 8, 2), "ulysses_a2a_dq": half(8 * 8 * 16, 2),
                   "ulysses_a2a_dkv": half(8 * 2 * (16 + 8), 2), "ring_kv": kv_shard * 2,
                   "ring_dkv": kv_shard * 4 + kv_shard * 2}
    same = layer_bytes(ulysses=2, ring=2, batch=1, local_len=8, heads=8, kv_heads=2, head_dim=16, dtype="bf16")
    assert same == layer_bytes(ulysses=2, ring=2, batch=1, local_len=8, heads=8, kv_heads=2, head_dim=16,
                               dtype="bf16", value_head_dim=16)


@pytest.mark.parametrize("mode,world_size,u,r,layout", [
    ("ring", 2, 1, 1, "zigzag"), pytest.param("ring", 3, 1, 1, "striped", marks=pytest.mark.slow),
    pytest.param("ulysses", 4, 1, 1, "contiguous", marks=pytest.mark.slow),
    pytest.param("hybrid", 4, 2, 2, "zigzag", marks=pytest.mark.slow),  # 4 ranks: ~20 s; the ring case stays
])
def test_float64_gradcheck_with_sinks_and_value_head_size(pools, mode: str, world_size: int, u: int, r: int,
                                                         layout: str) -> None:
    """Every input's gradient, the sinks' included (summed over ranks), by finite differences."""
    from dist_cases import gradcheck_case

    pool = pools.get(world_size)
    for causal, d_v in ((True, 6), (False, None)):
        assert all(pool.run(gradcheck_case, mode, layout, causal, u, r, sinks=True, d_v=d_v, timeout=300))


# ---------------------------------------------------------------------------- Megatron


def megatron_core_attention_case(cp: int, ulysses: int, softmax_type: str, d_qk: int, d_v: int) -> dict[str, float]:
    """RingSPCoreAttention at CP = ``cp`` (U x R) on Megatron's zigzag shards of ``[s, b, h, d]``
    q/k (``d_qk``) and v (``d_v``, MLA's ``k_channels``/``v_channels``), against megatron-core's
    own sink softmax (``SoftmaxOne``, what DotProductAttention applies) on the full sequence in
    float64, with the same ``softmax_offset``. Returns max errors (grads reduced over CP)."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.fusions.fused_softmax import SoftmaxOne
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    import ring_sp
    import ring_sp.integrations.megatron as rsm

    heads, s, b = 4, 16 * cp, 2
    parallel_state.initialize_model_parallel(context_parallel_size=cp, create_gloo_process_groups=False)
    try:
        torch.manual_seed(0)
        config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=heads, softmax_type=softmax_type,
                                   params_dtype=torch.float64, use_cpu_initialization=True, context_parallel_size=cp,
                                   attention_dropout=0.0)
        attention = rsm.RingSPCoreAttention(config, 1, AttnMaskType.causal, "self", k_channels=d_qk, v_channels=d_v,
                                            softmax_scale=0.3, ring_sp_config=rsm.RingSPConfig(ulysses_size=ulysses))
        if softmax_type == "learnable":
            assert isinstance(attention.softmax_offset, torch.nn.Parameter) and attention.softmax_offset.shape == (heads,)
            assert set(attention.state_dict()) == {"softmax_offset"}
        g = torch.Generator().manual_seed(1)
        full = {name: torch.randn(s, b, heads, d, generator=g, dtype=torch.float64)
                for name, d in (("q", d_qk), ("k", d_qk), ("v", d_v), ("dout", d_v))}
        cp_group = parallel_state.get_context_parallel_group()
        shard = lambda x: ring_sp.shard_sequence(x, rank=cp_group.rank(), world_size=cp, layout="zigzag", dim=0)  # noqa: E731
        q, k, v = (shard(full[n]).requires_grad_() for n in ("q", "k", "v"))
        out = attention(q, k, v, None)
        out.backward(shard(full["dout"]).reshape(out.shape))

        # megatron-core's math on the full sequence: scaled scores, causal mask, SoftmaxOne
        offset = attention.softmax_offset.detach().clone().requires_grad_() if softmax_type == "learnable" else \
            (torch.zeros(heads, dtype=torch.float64) if softmax_type == "off-by-one" else None)
        rq, rk, rv = (full[n].clone().requires_grad_() for n in ("q", "k", "v"))
        scores = torch.einsum("sbhd,tbhd->bhst", rq, rk) * 0.3
        scores = scores.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
        probs = torch.softmax(scores, -1) if offset is None else SoftmaxOne(-1, offset)(scores)
        ref = torch.einsum("bhst,tbhd->sbhd", probs, rv)
        ref.backward(full["dout"])
        errors = {"out": (out.detach() - shard(ref.detach()).reshape(out.shape)).abs().max().item()}
        for name, mine, theirs in (("dq", q, rq), ("dk", k, rk), ("dv", v, rv)):
            errors[name] = (mine.grad - shard(theirs.grad)).abs().max().item()
        if softmax_type == "learnable":
            reduced = attention.softmax_offset.grad.clone()
            dist.all_reduce(reduced, group=cp_group)  # what Megatron's DDP does over dp x cp
            errors["dsinks"] = (reduced - offset.grad).abs().max().item()
            errors["dsinks_scale"] = offset.grad.abs().max().item()
        return errors
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("softmax_type,d_v", [("learnable", 8), ("off-by-one", 16), ("vanilla", 24)])
def test_megatron_core_attention_sinks_and_mla_equal_megatrons_softmax(pools, softmax_type: str, d_v: int) -> None:
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    for result in pools.get(4).run(megatron_core_attention_case, 4, 2, softmax_type, 16, d_v, timeout=240):
        assert max(v for k, v in result.items() if k != "dsinks_scale") <= 1e-10, result
        assert softmax_type != "learnable" or result["dsinks_scale"] > 1e-3, result


def test_megatron_accepts_multi_latent_attention_spec_and_args() -> None:
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    import argparse

    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    import ring_sp.integrations.megatron as rsm

    spec = rsm.get_gpt_layer_ring_sp_spec(rsm.RingSPConfig(), normalization="RMSNorm", multi_latent_attention=True)
    attention = spec.submodules.self_attention
    assert attention.module is MLASelfAttention
    assert attention.submodules.core_attention.module is rsm.RingSPCoreAttention
    args = argparse.Namespace(num_attention_heads=4, multi_latent_attention=True, context_parallel_size=2,
                              position_embedding_type="rope")
    assert rsm.ring_sp_config_from_args(args) == rsm.RingSPConfig()


class SinkCoreAttention:
    """The CP = 1 reference for a GPT with ``softmax_type='learnable'``: causal attention through
    megatron-core's own ``SoftmaxOne`` with a ``softmax_offset`` parameter (what its
    DotProductAttention computes; that module itself cannot run on CPU)."""

    def __new__(cls, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                softmax_scale=None, cp_comm_type=None, pg_collection=None):
        from megatron.core.fusions.fused_softmax import SoftmaxOne
        from megatron.core.transformer.module import MegatronModule

        class _Core(MegatronModule):
            def __init__(self) -> None:
                super().__init__(config=config)
                self.softmax_offset = torch.nn.Parameter(torch.empty(config.num_attention_heads))
                config.init_method(self.softmax_offset)

            def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                        packed_seq_params=None):
                q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, h, s, d]
                k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
                scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
                scores = scores.masked_fill(~torch.ones(scores.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
                out = SoftmaxOne(-1, self.softmax_offset)(scores) @ v
                return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)

        return _Core()


@pytest.mark.parametrize("cp,ulysses", [pytest.param(4, 2, id="cp4-u2xr2"),
                                        pytest.param(4, 1, id="cp4-u1xr4", marks=pytest.mark.slow)])
def test_megatron_gpt_with_learnable_sinks_equals_cp1(pools, cp: int, ulysses: int) -> None:
    """A GPTModel with ``softmax_type='learnable'``: loss and DDP-reduced gradients (the
    ``softmax_offset`` ones included) at CP = 4 equal those at CP = 1."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    from test_megatron import gpt_case

    for r in pools.get(4).run(gpt_case, 1, cp, ulysses, False, SinkCoreAttention, softmax_type="learnable", timeout=240):
        assert math.isclose(r["loss"], r["ref_loss"], rel_tol=1e-6), r
        assert r["ref_grad_max"] > 1e-3 and r["grad_err"] <= 1e-6 and r["per_token_grad_err"] <= 1e-6, r
