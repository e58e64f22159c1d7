"""What an allocator sees: the peak RSS growth per rank of one training step, ring_sp against ALST.

The ``length`` section (:mod:`.length`) counts live tensor bytes; this one measures the
process, as a user's ``nvidia-smi`` or ``top`` would: the peak resident set size during the
step minus the resident set size before it, per rank, with glibc returning freed buffers of
64 KiB and more to the system at once (``mallopt(M_MMAP_THRESHOLD, 65536)``, the same as
``MALLOC_MMAP_THRESHOLD_=65536``), so that the figure is the step's own and not the heap's
history. The kernel's peak counter is reset just before the step (``/proc/self/clear_refs``
``5``, Linux 4.0+) and read after it (``VmHWM``).

Setup (issue 30): 4 gloo ranks; the small HF Llama of :func:`.length.small_llama_config`
(hidden 256, ffn 1024, 2 layers, 8/4 heads, vocab 32K, fp32); one step (forward, the exact
loss, backward; gradients start unset); fresh processes per point. Modes:

* ``ring_sp defaults``: ``enable_long_sequence(model, tiled_mlp=True, tiled_loss=True)``,
  every other argument its default, at U2xR2, the loss from ``model_loss``;
* ``ring_sp 256-token tiles``: the same with ``tile_tokens=256``;
* ``ALST``: DeepSpeed's ``UlyssesSPAttentionHF`` at SP=4, ``TiledMLP`` with ``ceil(n / hidden)``
  shards and ``TiledFusedLogitsLoss`` with 16 shards of the rank's ``n`` tokens ("sized for the
  scale": its own 1 GiB default would not tile here).

Run: ``python -m benchmarks.length_rss [--seq-lens 8192 16384 32768] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .launch import Launcher, PoolLauncher, TorchrunLauncher, sp_group
from .length import ALST, TILED_2X2, LengthMode, _alst_step, _ring_sp_step, global_batch, length, small_llama_config
from .length import markdown as live_bytes_markdown
from .tables import table

MMAP_THRESHOLD = 65536
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number
ALST_LOSS_SHARDS = 16


@dataclass(frozen=True)
class RssMode:
    """A ring_sp mode (``tile_tokens``; None: the library's sizes) or ALST."""

    name: str
    kind: str  # "ring_sp" or "alst"
    tile_tokens: int | None = None


DEFAULTS = RssMode("ring_sp defaults", "ring_sp")
TILES_256 = RssMode("ring_sp, 256-token tiles", "ring_sp", 256)
ALST_RSS = RssMode("ALST", "alst")
RSS_MODES = (DEFAULTS, TILES_256, ALST_RSS)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1))


def return_freed_buffers() -> None:
    """glibc: every allocation of 64 KiB or more is its own mapping, unmapped when freed."""
    libc = ctypes.CDLL("libc.so.6")
    if libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) != 1:
        raise RuntimeError("mallopt(M_MMAP_THRESHOLD) failed: this benchmark needs glibc")


class PeakRssGrowth:
    """``with PeakRssGrowth() as rss: ...``; then ``rss.bytes``: the block's peak RSS minus the RSS before it."""

    def __enter__(self) -> PeakRssGrowth:
        gc.collect()
        with open("/proc/self/clear_refs", "w") as f:  # resets VmHWM to the current RSS
            f.write("5")
        self.before_kib = _status_kib("VmRSS")
        return self

    def __exit__(self, *exc: object) -> None:
        self.bytes = (_status_kib("VmHWM") - self.before_kib) * 1024


def rss_case(mode: RssMode, seq_len: int) -> dict[str, Any]:
    """One step of ``mode`` at ``seq_len`` global tokens on this rank: its peak RSS growth and the global loss."""
    return_freed_buffers()
    torch.set_num_threads(1)
    p = torch.distributed.get_world_size(sp_group())
    if mode.kind == "alst":
        alst = LengthMode(ALST.name, "alst", p, tiled=True)
        _, loss_fn = _alst_step(alst, small_llama_config(), global_batch(seq_len),
                                loss_tile_tokens=math.ceil(seq_len // p / ALST_LOSS_SHARDS))
    else:  # U2xR2, enable_long_sequence(tiled_mlp=True, tiled_loss=True, tile_tokens=mode.tile_tokens)
        _, loss_fn = _ring_sp_step(TILED_2X2, small_llama_config(), global_batch(seq_len), mode.tile_tokens)
    with PeakRssGrowth() as rss:
        loss = loss_fn()
        loss.backward()
    value = loss.detach().clone()
    if mode.kind == "alst":  # each rank's loss is its shard's share of the global mean
        torch.distributed.all_reduce(value, group=sp_group())
    return {"rss_growth_bytes": rss.bytes, "loss": value.item()}


def rss_point(mode: RssMode, seq_len: int, ranks: int = 4) -> dict[str, Any]:
    """One point in a fresh set of ``ranks`` processes."""
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)  # also for the ranks' own start-up
    launcher = PoolLauncher()
    try:
        results = launcher.run(rss_case, ranks, mode, seq_len)
    finally:
        launcher.close()
    return {"mode": mode.name, "seq_len": seq_len, "rss_growth_bytes": max(r["rss_growth_bytes"] for r in results),
            "rss_growth_per_rank": [r["rss_growth_bytes"] for r in results], "loss": results[0]["loss"]}


def length_section(run: Launcher, cfg: Any, log: Callable[[str], None]) -> list[dict[str, Any]]:
    """The benchmark suite's ``length`` section: the live-bytes sweep and step times of
    :func:`.length.length`, then this module's peak RSS growth against ALST (CPU ranks only:
    under torchrun the GPUs' allocator is measured by the live-bytes sweep)."""
    records = length(run, cfg, log)
    if isinstance(run, TorchrunLauncher):
        log("length: peak RSS growth is measured on CPU ranks only; skipped under torchrun")
        return records
    for n in (4096, 8192) if cfg.seq_lens[0] < 1024 else (8192, 16384, 32768):
        for mode in RSS_MODES:
            log(f"length: peak RSS growth N={n}: {mode.name}")
            records.append({"section": "length_rss", **rss_point(mode, n)})
    return records


def section_markdown(records: list[dict[str, Any]]) -> str:
    """length.md: the live-bytes tables, then the peak RSS table."""
    rss = [r for r in records if r["section"] == "length_rss"]
    out = live_bytes_markdown(records)
    if rss:
        out += ("\nPeak RSS growth per rank of one step (forward, loss, backward), MiB, largest rank; 4 gloo ranks, "
                "freed buffers of 64 KiB and more returned at once (`benchmarks/length_rss.py`); in brackets the "
                "ratio to ALST sized for the scale:\n\n" + markdown(rss) + "\n")
    return out


def markdown(records: list[dict[str, Any]]) -> str:
    """Rows per N: each mode's MiB (largest rank), ratios to ALST, the losses."""
    names = [m.name for m in RSS_MODES]
    rows = []
    for n in sorted({r["seq_len"] for r in records}):
        at = {r["mode"]: r for r in records if r["seq_len"] == n}
        alst = at.get(ALST_RSS.name, {}).get("rss_growth_bytes")
        cells = [f"{n:,}"]
        for name in names:
            got = at.get(name, {}).get("rss_growth_bytes")
            ratio = f" ({got / alst:.2f}x)" if got is not None and alst and name != ALST_RSS.name else ""
            cells.append("-" if got is None else f"{got / 2**20:.0f}{ratio}")
        cells.append(" / ".join(f"{at[name]['loss']:.6f}" for name in names if name in at))
        rows.append(cells)
    return "\n".join(table(["N", *[f"{name} MiB" for name in names], "losses"], rows))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 16384, 32768])
    parser.add_argument("--modes", nargs="+", choices=[m.name for m in RSS_MODES], default=[m.name for m in RSS_MODES])
    parser.add_argument("--json", help="also write the records here")
    args = parser.parse_args(argv)
    records = []
    for n in args.seq_lens:
        for mode in RSS_MODES:
            if mode.name in args.modes:
                records.append(rss_point(mode, n))
                print(f"N={n} {mode.name}: {records[-1]['rss_growth_bytes'] / 2**20:.0f} MiB", flush=True)
    print(markdown(records))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
