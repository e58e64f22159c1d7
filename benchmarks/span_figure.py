"""docs/span_blocks.png: the block classes of bidirectional spans over a zigzag shard.

``python -m benchmarks.span_figure [--out docs/span_blocks.png]`` draws, for 48 tokens on a
ring of 3 zigzag ranks with two documents and four spans (one of one token, three cut by
chunk edges), ring rank 1's three steps: each (query, key) pair coloured by the block that
computes it (the causal schedule's full and causal blocks, the spans' full and edge blocks),
each block outlined (one kernel call), white where the mask hides the pair. Pure schedule
(:func:`ring_sp.schedule.step_tasks`), no processes; matplotlib (the ``bench`` extra).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)
from matplotlib.colors import ListedColormap  # noqa: E402
from matplotlib.patches import Patch, Rectangle  # noqa: E402

import torch  # noqa: E402

from ring_sp.kernels.reference import causal_mask, window_mask  # noqa: E402
from ring_sp.layouts import ring_positions  # noqa: E402
from ring_sp.schedule import BlockTask, span_step_tasks, step_tasks  # noqa: E402

RING, LOCAL = 3, 16
LAYOUT = "zigzag"  # rank r holds chunks r and 2R-1-r of 8 tokens: rank 1 holds [8, 16) and [32, 40)
DOCUMENTS = (0, 30, 48)
SPANS = (4, 14, 17, 18, 20, 29, 34, 44)  # (start, stop) pairs; [17, 18) is one token, the others cross chunk edges
RANK = 1
CLASSES = ("hidden", "causal block", "full block", "span: full block", "span: edge block (key >= query)")
COLOURS = ("#ffffff", "#4c72b0", "#a6bddb", "#f5a05a", "#d62728")


def _block_pairs(task: BlockTask) -> torch.Tensor:
    """The pairs a block computes, as the reference kernel's masks state them."""
    nq, nk = task.q.stop - task.q.start, task.kv.stop - task.kv.start
    if task.window is not None:
        return window_mask(nq, task.causal, task.window)
    return causal_mask(nq, nk) if task.causal else torch.ones(nq, nk, dtype=torch.bool)


def step_classes(rank: int, source: int) -> tuple[torch.Tensor, list[tuple[BlockTask, int]]]:
    """[LOCAL, LOCAL] class index of every pair of one step, and its blocks with their class."""
    classes = torch.zeros(LOCAL, LOCAL, dtype=torch.long)
    causal = step_tasks(LAYOUT, True, rank, source, RING, LOCAL, DOCUMENTS)
    spans = span_step_tasks(LAYOUT, rank, source, RING, LOCAL, SPANS, DOCUMENTS)
    blocks = []
    for task, in_span in [(t, False) for t in causal] + [(t, True) for t in spans]:
        kind = (4 if task.window else 3) if in_span else (1 if task.causal else 2)
        classes[task.q, task.kv] = torch.where(_block_pairs(task), kind, classes[task.q, task.kv])
        blocks.append((task, kind))
    return classes, blocks


def draw(out: Path) -> Path:
    positions = ring_positions(LAYOUT, 1, RING, RING * LOCAL)
    fig, axes = plt.subplots(1, RING, figsize=(11, 4.1))
    for step, ax in enumerate(axes):
        source = (RANK - step) % RING
        classes, blocks = step_classes(RANK, source)
        ax.imshow(classes, cmap=ListedColormap(COLOURS), vmin=0, vmax=len(COLOURS) - 1, interpolation="nearest")
        for task, kind in blocks:
            ax.add_patch(Rectangle((task.kv.start - 0.5, task.q.start - 0.5), task.kv.stop - task.kv.start,
                                   task.q.stop - task.q.start, fill=False, lw=1.2, ec="k" if kind < 3 else "#7f0000"))
        ticks = list(range(0, LOCAL, 4))
        ax.set_xticks(ticks, labels=[str(int(positions[source][t])) for t in ticks], fontsize=7)
        ax.set_yticks(ticks, labels=[str(int(positions[RANK][t])) for t in ticks], fontsize=7)
        ax.set(title=f"step {step}: keys of rank {source}", xlabel="key (global position)")
        if step == 0:
            ax.set_ylabel(f"query of rank {RANK} (global position)")
    fig.legend(handles=[Patch(fc=c, ec="k", label=n) for c, n in zip(COLOURS[1:], CLASSES[1:])], loc="lower center",
               ncol=4, fontsize=8, frameon=False)
    fig.suptitle(f"{LAYOUT}, {RING} ring ranks x {LOCAL} tokens, documents {DOCUMENTS}, spans "
                 f"{[SPANS[i:i + 2] for i in range(0, len(SPANS), 2)]}", fontsize=9)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/span_blocks.png"))
    print(draw(parser.parse_args().out))


if __name__ == "__main__":
    main()
