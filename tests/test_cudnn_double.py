"""Issue 38 item 2: the ``cudnn`` backend, FA4 and ``backend="auto"``'s order, on CPU.

1. tests/cudnn_double.py against the definition (float64 oracle): top-left causal masks, GQA,
   ``d_v != d``, the layouts, and each hazard it keeps (negative controls: a double that did not
   keep them would make the layers below prove nothing).
2. ring_sp's CudnnKernel through the double: cuDNN blocks (lengths multiples of 128), the tail
   blocks it hands to torch's kernel, the global-statistics backward with a strided lse, strided
   inputs and grad_out, the edge block, and rows whose lse is below -88.7.
3. The decisions: availability reasons, the op schema check, deterministic mode, auto's order,
   and FA4's activation (with fakes of torch's registry).
4. Ring, Ulysses and the grid with ``backend="cudnn"`` on gloo ranks through the double; the
   sweep is ``-m slow``.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import ring_sp.kernels as kernels
import torch_flash_double
from block_checks import check_two_key_blocks
from cudnn_double import CudnnOps, installed, run_installed
from dist_cases import AttnCase, check_attention_cases
from oracle import GRAD_TOL, LSE_ATOL, OUT_TOL, assert_close, assert_lse_close, oracle_results
from ring_sp.kernels import cudnn, fa4, get_kernel
from ring_sp.kernels.torch_cpu import TorchCPUKernel
from ring_sp.kernels.torch_cuda import TorchCUDAKernel

CPU = torch.device("cpu")
HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _inputs(b: int, sq: int, sk: int, h: int, h_kv: int, d: int, dtype: torch.dtype, seed: int,
            d_v: int | None = None) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    d_v = d if d_v is None else d_v
    shapes = dict(q=(b, sq, h, d), k=(b, sk, h_kv, d), v=(b, sk, h_kv, d_v), dout=(b, sq, h, d_v))
    return {n: torch.randn(s, generator=g, dtype=torch.float64).to(dtype) for n, s in shapes.items()}


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().transpose(1, 2)


def _top_left(sq: int, sk: int) -> torch.Tensor:
    return torch.arange(sk).unsqueeze(0) <= torch.arange(sq).unsqueeze(1)


def _check(want: dict[str, torch.Tensor], out, lse, grads, dtype: torch.dtype) -> None:
    assert_close("out", out, want["out"], OUT_TOL[dtype])
    assert_lse_close("lse", lse, want["lse"], LSE_ATOL[dtype])
    for got, name in zip(grads, ("dq", "dk", "dv")):
        assert_close(name, got, want[name], GRAD_TOL[dtype])


# ---- 1. the double against the definition ----------------------------------------------------

def _double_call(ops: CudnnOps, inputs: dict[str, torch.Tensor], causal: bool, scale: float):
    q, k, v, dout = (_bhsd(inputs[n]) for n in ("q", "k", "v", "dout"))
    out, lse = ops._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, scale=scale)[:2]
    empty = torch.empty((), dtype=torch.long)
    grads = ops._scaled_dot_product_cudnn_attention_backward(
        _bhsd(dout.transpose(1, 2)), q, k, v, out, lse, empty, empty, None, None, None, q.shape[2], k.shape[2], 0.0,
        causal, scale=scale)
    return out, lse, grads


@pytest.mark.parametrize("dtype", HALF.values(), ids=HALF)
def test_double_matches_the_definition(dtype: torch.dtype) -> None:
    """Top-left causal masks on every shape (the alignment differs from bottom-right when
    seq_q != seq_k), GQA, a value head size of its own; out laid out like q, lse [b, h, s, 1]."""
    for index, (sq, sk, h_kv, d_v, causal) in enumerate(
            [(9, 9, 2, 16, True), (5, 12, 4, 16, True), (12, 5, 1, 8, True), (7, 10, 2, 8, False)]):
        inputs = _inputs(2, sq, sk, 4, h_kv, 16, dtype, seed=index, d_v=d_v)
        want = oracle_results(inputs, causal=False, scale=0.3, mask=_top_left(sq, sk) if causal else None)
        out, lse, (dq, dk, dv) = _double_call(CudnnOps(), inputs, causal, 0.3)
        assert lse.shape == (2, 4, sq, 1) and lse.dtype == torch.float32 and lse.is_contiguous()
        assert out.shape == (2, 4, sq, d_v) and out.transpose(1, 2).is_contiguous() and out.dtype == dtype
        assert dk.shape == (2, h_kv, sk, 16) and dv.shape == (2, h_kv, sk, d_v)
        _check(want, out.transpose(1, 2), lse[..., 0], [g.transpose(1, 2) for g in (dq, dk, dv)], dtype)


def test_double_keeps_the_hazards_of_the_real_ops() -> None:
    """Each hazard ring_sp steers around, shown on the double (negative controls)."""
    inputs = _inputs(1, 130, 130, 2, 2, 16, torch.bfloat16, seed=1)
    ops = CudnnOps()
    out, lse, right = _double_call(ops, inputs, True, 0.25)
    q, k, v, dout = (_bhsd(inputs[n]) for n in ("q", "k", "v", "dout"))
    empty = torch.empty((), dtype=torch.long)

    def backward(dout_, out_, lse_, ops_=ops):
        return ops_._scaled_dot_product_cudnn_attention_backward(
            dout_, q, k, v, out_, lse_, empty, empty, None, None, None, 130, 130, 0.0, True, scale=0.25)

    with pytest.raises(RuntimeError, match="same_strides"):  # grad_out with other strides than out (issue 176915)
        backward(dout.contiguous(), out, lse)
    strided_lse = lse[..., 0].transpose(1, 2).contiguous().transpose(1, 2).unsqueeze(-1)  # [b, s, h] storage
    assert not torch.equal(backward(dout, out, strided_lse)[0], right[0])  # read as packed BHSD
    fresh = CudnnOps()  # the cached graph reads out and grad_out with the first call's strides
    backward(dout, out, lse, fresh)
    other = [x.contiguous() for x in (dout, out)]  # [b, h, s, d] storage this time
    assert not torch.equal(backward(*other, lse, fresh)[0], right[0])
    very_negative = lse - 200.0  # below -ln(FLT_MAX) with a tile tail (130 % 128): NaN
    assert all(torch.isnan(g).any() for g in backward(dout, out, very_negative))
    with pytest.raises(RuntimeError, match="sequence length 1"):
        ops._scaled_dot_product_cudnn_attention(q, k[:, :, :1], v[:, :, :1], None, True, 0.0, False)
    with pytest.raises(RuntimeError, match="unpacked QKV layout"):
        ops._scaled_dot_product_cudnn_attention(q.contiguous(), k, v, None, True, 0.0, False)
    with pytest.raises(RuntimeError, match="no mask tensor"):
        ops._scaled_dot_product_cudnn_attention(q, k, v, torch.zeros(130, 130), True, 0.0, False)


# ---- 2. ring_sp's CudnnKernel through the double ----------------------------------------------

def _kernel() -> cudnn.CudnnKernel:
    kernel = get_kernel("cudnn", CPU, torch.bfloat16, 16)
    assert isinstance(kernel, cudnn.CudnnKernel) and isinstance(kernel.tail, TorchCPUKernel)
    return kernel


@pytest.mark.parametrize("dtype", HALF.values(), ids=HALF)
def test_backend_blocks_match_the_oracle(dtype: torch.dtype) -> None:
    """128-row blocks run on cuDNN, others on the tail kernel; causal and not, GQA, d_v != d,
    a sequence slice of a batch of 2 (not contiguous), and grad_out laid out head-major."""
    with installed() as ops:
        kernel = _kernel()
        blocks = [(128, 2, 16, True, True), (128, 4, 8, False, True), (130, 2, 16, True, False),
                  (17, 1, 16, False, False)]
        for index, (s, h_kv, d_v, causal, on_cudnn) in enumerate(blocks):
            inputs = _inputs(2, s + 3, s + 3, 4, h_kv, 16, dtype, seed=index, d_v=d_v)
            q, k, v, dout = (inputs[n][:, 3:] for n in ("q", "k", "v", "dout"))  # views, not contiguous
            want = oracle_results(dict(q=q, k=k, v=v, dout=dout), causal=causal, scale=0.25)
            calls = dict(ops.calls)
            out, lse = kernel.forward(q, k, v, causal=causal, scale=0.25)
            head_major = dout.transpose(1, 2).contiguous().transpose(1, 2)
            grads = kernel.backward(head_major, q, k, v, out.to(dtype), lse, causal=causal, scale=0.25)
            _check(want, out, lse, grads, dtype)
            ran = tuple(ops.calls[step] > calls[step] for step in ("forward", "backward"))
            assert ran == (on_cudnn, on_cudnn)


def test_two_key_blocks_with_global_statistics_and_the_edge_block() -> None:
    """As on a ring: a past key block and the own causal one merged, each backward fed the merged
    GLOBAL out and a strided lse; then the edge block (key >= query), run reversed."""
    dtype = torch.bfloat16
    with installed() as ops:
        kernel = _kernel()
        check_two_key_blocks(kernel, _inputs(1, 128, 256, 4, 2, 16, dtype, seed=7), scale=0.25)

        inputs = _inputs(1, 128, 128, 4, 2, 16, dtype, seed=8)
        q, k, v, dout = inputs.values()
        want = oracle_results(inputs, causal=False, scale=0.25, mask=_top_left(128, 128).T)
        out, lse = kernel.forward(q, k, v, causal=False, scale=0.25, window=1)
        _check(want, out, lse, kernel.backward(dout, q, k, v, out, lse, causal=False, scale=0.25, window=1), dtype)
        assert ops.calls == {"forward": 3, "backward": 3}


def test_the_real_ops_take_the_arguments_on_the_meta_device() -> None:
    """This torch's own ops (their meta kernels) with the arguments ring_sp passes by name:
    GQA, d_v != d, a batch of 2; out, lse and grads in the contract's shapes."""
    kernel = cudnn.CudnnKernel(tail=TorchCPUKernel())
    q = torch.empty(2, 128, 8, 64, device="meta", dtype=torch.bfloat16)
    k = torch.empty(2, 256, 2, 64, device="meta", dtype=torch.bfloat16)
    v = torch.empty(2, 256, 2, 32, device="meta", dtype=torch.bfloat16)
    out, lse = kernel.forward(q, k, v, causal=False, scale=0.125)
    assert out.shape == (2, 128, 8, 32) and out.dtype == torch.bfloat16 and lse.shape == (2, 8, 128)
    assert lse.dtype == torch.float32
    dq, dk, dv = kernel.backward(out, q, k, v, out, lse, causal=False, scale=0.125)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)


def test_rows_with_very_negative_lse_never_meet_a_tile_tail(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every logit ~ -120 (lse < -88.7), as in Qwen2.5's massive-activation heads: a 192-row
    block (192 % 128 = 64, torch issue 196678's length) goes to the tail kernel and is exact; the
    same block on cuDNN (negative control: TILE lowered to 64) gives NaN."""
    dtype = torch.bfloat16
    inputs = _inputs(1, 192, 192, 2, 2, 16, dtype, seed=9)
    inputs["q"] = (inputs["q"].float() * 0.1).to(dtype)
    inputs["q"][..., 0], inputs["k"][..., 0] = 1.0, -120 * 4.0  # scale 1/4: every logit ~ -120
    q, k, v, dout = inputs.values()
    want = oracle_results(inputs, causal=True, scale=0.25)
    assert want["lse"].max() < -88.8
    with installed():
        kernel = _kernel()
        out, lse = kernel.forward(q, k, v, causal=True, scale=0.25)
        dq, dk, dv = kernel.backward(dout, q, k, v, out.to(dtype), lse, causal=True, scale=0.25)
        # dq's first component is a difference of terms ~480x larger than it (k's common -480
        # against D = rowsum(dout * out) from the bf16 out): ill-conditioned in any kernel, so
        # only finite there; everything else against the oracle
        assert torch.isfinite(dq).all()
        _check({**want, "dq": want["dq"][..., 1:]}, out, lse, (dq[..., 1:], dk, dv), dtype)
        monkeypatch.setattr(cudnn, "TILE", 64)
        grads = kernel.backward(dout, q, k, v, out.to(dtype), lse, causal=True, scale=0.25)
        assert torch.isnan(grads[0]).any()


# ---- 3. the decisions ---------------------------------------------------------------------------

def test_reasons_name_what_cannot_run() -> None:
    assert cudnn.unavailable_reason(torch.bfloat16, 64) is not None  # no GPU here: the real gate refuses
    with installed():
        assert kernels.unavailable_reason("cudnn", CPU, torch.bfloat16, 64) is None
        assert "float16 or bfloat16, not torch.float32" in kernels.unavailable_reason("cudnn", CPU, torch.float32, 64)
        assert "needs the value head size equal" in kernels.unavailable_reason("cudnn", CPU, torch.bfloat16, 64, 32)
        assert cudnn.unavailable_reason(torch.bfloat16, 64, 32) is None  # cuDNN itself takes MLA head sizes
    rule = cudnn.head_size_reason
    assert rule(128, 128, (8, 0), 90000) is None and rule(64, 32, (12, 1), 90000) is None
    assert "multiple of 8" in rule(60, 64, (9, 0), 91900)
    assert "<= 128" in rule(256, 256, (9, 0), 91900)  # cuDNN 9.19 (the GPU image): not yet
    assert rule(256, 256, (9, 0), 92300) is None and rule(192, 128, (10, 0), 92300) is None
    assert "<= 128" in rule(160, 160, (9, 0), 92300) and "<= 128" in rule(256, 256, (8, 0), 92300)


def test_switches_and_deterministic_mode_turn_cudnn_off(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch.use_deterministic_algorithms itself costs seconds here (it imports inductor): its two getters faked
    with installed():
        monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
        monkeypatch.setattr(torch, "is_deterministic_algorithms_warn_only_enabled", lambda: False)
        assert "non-deterministic" in cudnn.unavailable_reason(torch.bfloat16, 64)
        monkeypatch.setattr(torch, "is_deterministic_algorithms_warn_only_enabled", lambda: True)
        assert cudnn.unavailable_reason(torch.bfloat16, 64) is None  # torch's SDPA rule: warn_only keeps it
        monkeypatch.undo()
        monkeypatch.setattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda: False)
        assert "enable_cudnn_sdp(False)" in cudnn.unavailable_reason(torch.bfloat16, 64)
        monkeypatch.undo()
        with torch.backends.cudnn.flags(enabled=False):
            assert "cudnn.enabled is False" in cudnn.unavailable_reason(torch.bfloat16, 64)


def test_op_schemas_of_this_torch_and_a_torch_without_the_lse(monkeypatch: pytest.MonkeyPatch) -> None:
    assert cudnn.schema_reason() is None  # this torch's ops take what the ring passes
    real = cudnn._arguments

    def old(name: str) -> dict[str, bool]:  # a forward with no compute_log_sumexp
        return {n: d for n, d in real(name).items() if n not in ("compute_log_sumexp", "attn_bias")}

    def newer(name: str) -> dict[str, bool]:  # a required argument the ring does not know
        return {**real(name), "window_size": False}

    try:
        for fake, words in ((old, "lacks ['compute_log_sumexp']"), (newer, "does not know ['window_size']")):
            monkeypatch.setattr(cudnn, "_arguments", fake)
            cudnn.schema_reason.cache_clear()
            assert words in cudnn.schema_reason()
    finally:
        monkeypatch.undo()
        cudnn.schema_reason.cache_clear()


def test_auto_follows_the_order_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """auto takes AUTO_ORDER's first runnable backend for the GPU's generation (fakes of the GPU
    and of each backend's availability)."""
    runnable: set[str] = set()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kernels, "unavailable_reason", lambda name, *a: None if name in runnable else "no")
    cuda = torch.device("cuda")
    for capability, available, expected in [((9, 0), {"cudnn", "flash_attn", "torch"}, "cudnn"),
                                            ((10, 0), {"cudnn", "torch"}, "cudnn"),
                                            ((9, 0), {"flash_attn", "torch"}, "flash_attn"),  # e.g. deterministic mode
                                            ((8, 0), {"cudnn", "flash_attn", "torch"}, "flash_attn"),
                                            ((8, 6), {"cudnn", "torch"}, "torch"),
                                            ((9, 0), set(), "reference")]:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        runnable.clear()
        runnable.update(available)
        assert kernels._auto_backend(cuda, torch.bfloat16, 64, None) == expected, (capability, available)
    assert kernels.AUTO_ORDER[("cpu", None)] == ("torch",)


class _FakeRegistry:
    def __init__(self, listed: tuple[str, ...] = ("FA3", "FA4"), current: str | None = None,
                 fail: bool = False) -> None:
        self.names, self.active, self.fail, self.activations = list(listed), current, fail, 0

    def registry(self) -> fa4.Registry:
        return fa4.Registry(lambda: self.names, lambda: self.active, self.activate)

    def activate(self, name: str) -> None:
        self.activations += 1
        if self.fail:
            raise ImportError("No module named 'cutlass'")
        self.active = name


def test_fa4_decision() -> None:
    reason = fa4.unavailable_reason
    registry = _FakeRegistry().registry()
    assert reason(registry, "4.0.0b17", (9, 0), torch.bfloat16, 128, 128) is None
    assert reason(registry, "4.0.0b18", (10, 0), torch.float16, 256, 256) is None
    assert "no flash-implementation registry" in reason(None, "4.0.0b17", (9, 0), torch.bfloat16, 128, 128)
    assert "lists no FA4" in reason(_FakeRegistry(("FA3",)).registry(), "4.0.0b17", (9, 0), torch.bfloat16, 128, 128)
    assert "not installed" in reason(registry, None, (9, 0), torch.bfloat16, 128, 128)
    for version in ("4.0.0b19", "4.0.0b36", "4.0.0", "4.1.0b2", "weird"):
        assert "190212" in reason(registry, version, (9, 0), torch.bfloat16, 128, 128), version
    assert "9.x or 10.x" in reason(registry, "4.0.0b17", (8, 0), torch.bfloat16, 128, 128)
    assert "float16 or bfloat16" in reason(registry, "4.0.0b17", (9, 0), torch.float32, 128, 128)
    assert "one head size" in reason(registry, "4.0.0b17", (9, 0), torch.bfloat16, 192, 128)
    assert "<= 128 or 256" in reason(registry, "4.0.0b17", (10, 0), torch.bfloat16, 192, 192)
    assert "<= 256" in reason(registry, "4.0.0b17", (9, 0), torch.bfloat16, 60, 60)


def test_fa4_is_activated_once_where_the_kernel_is_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _FakeRegistry()
    monkeypatch.setattr(fa4.Registry, "of_torch", staticmethod(fake.registry))
    monkeypatch.setattr(fa4, "installed_version", lambda: "4.0.0b17")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(kernels, "unavailable_reason", lambda *a: None)  # no GPU here: the kernels' own gates pass
    cuda = torch.device("cuda")
    assert get_kernel("torch", cuda, torch.float32, 64).name == "torch" and fake.activations == 0  # fp32: FA4 cannot
    assert get_kernel("flash_attn", cuda, torch.bfloat16, 64).name == "flash_attn" and fake.activations == 0
    for backend in ("torch", "cudnn", "torch"):
        get_kernel(backend, cuda, torch.bfloat16, 64)
    assert fake.activations == 1 and fake.active == "FA4"

    user = _FakeRegistry(current="FA3")  # a user's choice stays
    monkeypatch.setattr(fa4.Registry, "of_torch", staticmethod(user.registry))
    assert fa4.activate_if_available(cuda, torch.bfloat16, 64, 64) == "FA3" and user.activations == 0
    off = _FakeRegistry()
    monkeypatch.setattr(fa4.Registry, "of_torch", staticmethod(off.registry))
    monkeypatch.setenv(fa4.ENV_FLAG, "0")
    assert fa4.activate_if_available(cuda, torch.bfloat16, 64, 64) is None and off.activations == 0
    monkeypatch.delenv(fa4.ENV_FLAG)
    broken = _FakeRegistry(fail=True)
    monkeypatch.setattr(fa4.Registry, "of_torch", staticmethod(broken.registry))
    with pytest.raises(RuntimeError, match=r"flash-attn-4 4.0.0b17 is installed but torch could not.*RING_SP_FA4=0"):
        get_kernel("torch", cuda, torch.bfloat16, 64)


def test_this_torch_has_the_fa4_registry_and_nothing_is_active() -> None:
    registry = fa4.Registry.of_torch()
    assert registry is not None and "FA4" in registry.listed() and registry.current() is None


# ---- 4. ring, Ulysses and the grid through the double -------------------------------------------

# The double and ring_sp scaled to 8-row tiles (cudnn_double.installed): n_local 16 gives zigzag
# halves of 8 (cuDNN blocks), while windows, documents and striped shards cut other lengths (tail
# blocks), so both kernels' partials meet in one merge.
DIST_TILE = 8


def _dist_cases(world_size: int, full: bool) -> list[AttnCase]:
    dt = itertools.cycle(("bf16", "fp16"))
    cases: list[AttnCase] = []

    def add(mode: str, layout: str, causal: bool, n: int, h: int, h_kv: int, **extra) -> None:
        cases.append(AttnCase(mode, layout, causal, 1, n, h, h_kv, 16, next(dt), seed=len(cases),
                              ring=1 if mode == "ulysses" else (2 if mode == "hybrid" else world_size),
                              ulysses=world_size if mode == "ulysses" else (2 if mode == "hybrid" else 1),
                              backend="cudnn", **extra))

    layouts = ("zigzag", "contiguous", "striped")
    heads = ((4, 2), (4, 1), (4, 4))
    for (layout, causal), (h, h_kv) in zip(itertools.product(layouts, (True, False)) if full else [("zigzag", True)],
                                           itertools.cycle(heads)):
        add("ring", layout, causal, 16, h, h_kv)
    for layout in layouts if full else ("striped",):
        add("ring", layout, True, 16, 4, 2, window=5)
    for layout in layouts + ("document_zigzag",) if full else ("zigzag",):
        add("ring", layout, True, 16, 4, 2, packed=True, window=None if full else 7)
    if full:
        add("ring", "zigzag", True, 16, 4, 2, sinks=True)
        add("ulysses", "zigzag", True, 8, 2 * world_size, world_size // 2 or 1)
    if world_size == 4:
        add("hybrid", "zigzag", True, 16, 4, 2, packed=True)
    return cases


def _run(pools, world_size: int, full: bool) -> None:
    results = pools.get(world_size).run(run_installed, DIST_TILE, check_attention_cases,
                                        _dist_cases(world_size, full), timeout=900)
    assert all(calls["forward"] and calls["backward"] for _, calls in results)  # cuDNN blocks ran on every rank


def test_distributed_through_the_double(pools) -> None:
    _run(pools, 4, full=False)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_distributed_through_the_double_sweep(pools, world_size: int) -> None:
    _run(pools, world_size, full=True)


def _with_flash_tail(tile: int, fn, *args, **kwargs):
    """``fn`` with the cuDNN double (``tile`` rows) and torch's flash op double as its tail (a pool case)."""
    with torch_flash_double.installed():
        return run_installed(tile, fn, *args, **kwargs)


def test_bands_and_varlen_calls_go_to_a_tail_that_takes_them(pools) -> None:
    """With torch's flash op as the tail (its double), the cudnn kernel takes what the tail takes:
    window bands whole and a step's documents as one varlen call, both run by the tail, while
    whole-tile blocks stay on cuDNN; exact against the oracle on 4 ring ranks."""
    with installed(), torch_flash_double.installed():
        kernel = get_kernel("cudnn", CPU, torch.bfloat16, 16)
        assert isinstance(kernel.tail, TorchCUDAKernel) and kernel.supports_window and kernel.supports_varlen
    cases = [AttnCase("ring", "zigzag", True, 1, 16, 4, 2, 16, "bf16", seed=0, ring=4, backend="cudnn", window=5),
             AttnCase("ring", "document_zigzag", True, 1, 16, 4, 2, 16, "fp16", seed=1, ring=4, backend="cudnn",
                      packed=True),
             AttnCase("ring", "zigzag", True, 1, 16, 4, 2, 16, "bf16", seed=2, ring=4, backend="cudnn")]
    results = pools.get(4).run(_with_flash_tail, DIST_TILE, check_attention_cases, cases, timeout=900)
    assert all(calls["forward"] and calls["backward"] for _, calls in results)  # cuDNN blocks ran on every rank
