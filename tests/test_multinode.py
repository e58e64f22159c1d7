"""Issue 45 (items 2-4): the examples on two nodes, emulated on this machine, and a lost node.

Two launches of an example's ``.sh`` with ``--nnodes 2 --node-rank 0/1 --master-addr 127.0.0.1
--master-port P`` (``examples/common/nodes.sh``), 2 CPU ranks each: the launchers rendezvous on
localhost as two nodes would (each exports its ranks per node; ring_sp's topology reads it), and
at U2 x R2 the Ulysses groups stay inside a "node" while the ring spans both. The default suite
runs the DeepSpeed GPT example once on one node (U2 x R2) and once on two (DeepSpeed's launcher,
one per node without ssh) at U1 x R4 with ``--kv-exchange double_ring`` (a double ring of 2 x 2):
the per-step losses must be equal (1e-6). Under ``-m slow``: the flat ring across the nodes,
torchrun, the HF Trainer example (flat and double ring), and a lost node (every process of node 1
killed with SIGKILL after a checkpoint: node 0's ranks stop with an error naming ranks 2 and 3,
and both nodes started again resume to a checkpoint bitwise equal to the uninterrupted run's),
and torchrun's elastic restart (a killed rank; a lost node that rejoins), bitwise as well.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

from example_scripts import _free_port
from test_resume import (GPT, GPT_TINY, HAVE_DEEPSPEED, TRAINER, TRAINER_TINY, assert_bitwise_equal, assert_ok, launch,
                         needs_deepspeed, needs_hf, trainer_states)

LOST_NODE_EXIT_S = 120.0  # the bound for the survivors (measured: docs/multinode.md)


@dataclass
class Node:
    """One emulated node: its launcher process (a session of its own) and where its output goes."""

    proc: subprocess.Popen
    stdout: Path
    stderr: Path

    def wait(self, timeout: float) -> tuple[int, list[dict[str, Any]], str]:
        returncode = self.proc.wait(timeout=timeout)
        lines = [json.loads(line) for line in self.stdout.read_text().splitlines() if line.startswith("{")]
        return returncode, lines, self.stderr.read_text()

    def kill(self) -> None:
        """SIGKILL the launcher and every process below it (its ranks live in sessions of their own)."""
        launcher = psutil.Process(self.proc.pid)
        for process in [*launcher.children(recursive=True), launcher]:
            try:
                process.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass
        self.proc.wait(timeout=30)


def start_node(script: Path, *args: str, node: int, port: str, folder: Path, nnodes: int = 2, ranks: int = 2,
               launcher: str = "deepspeed", fault: str | None = None) -> Node:
    """``script --cpu *args`` as node ``node`` of ``nnodes``, ``ranks`` CPU ranks, meeting at localhost:``port``;
    ``fault``: RING_SP_EXAMPLE_FAULT for this node's ranks."""
    environ = {**os.environ, "PYTHON": sys.executable, "NUM_RANKS": str(ranks), "LAUNCHER": launcher}
    environ.pop("RING_SP_EXAMPLE_FAULT", None)
    if fault is not None:
        environ["RING_SP_EXAMPLE_FAULT"] = fault
    folder.mkdir(parents=True, exist_ok=True)
    out, err = folder / f"node{node}.out", folder / f"node{node}.err"
    with open(out, "w") as stdout, open(err, "w") as stderr:
        proc = subprocess.Popen([str(script), "--cpu", *args, "--nnodes", str(nnodes), "--node-rank", str(node),
                                 "--master-addr", "127.0.0.1", "--master-port", port],
                                env=environ, stdout=stdout, stderr=stderr, start_new_session=True)
    return Node(proc, out, err)


def start_nodes(script: Path, *args: str, folder: Path, nnodes: int = 2, launcher: str = "deepspeed",
                fault: str | None = None) -> list[Node]:
    """Every node of ``nodes`` at a free port (:func:`start_node`); ``fault`` for all of them."""
    port = str(_free_port())
    return [start_node(script, *args, node=node, port=port, folder=folder, nnodes=nnodes, launcher=launcher,
                       fault=fault) for node in range(nnodes)]


def wait_all(nodes: list[Node], timeout: float = 300) -> list[tuple[int, list[dict[str, Any]], str]]:
    """Every node to its end (any left when one fails or times out is killed); each must succeed."""
    try:
        results = [node.wait(timeout) for node in nodes]
    finally:
        for node in nodes:
            if node.proc.poll() is None:
                node.kill()
    for returncode, _, stderr in results:
        assert returncode == 0, stderr[-4000:]
    return results


def run_nodes(script: Path, *args: str, folder: Path, launcher: str = "deepspeed", timeout: float = 300,
              links: bool = True) -> list[dict]:
    """Two emulated nodes to the end: both succeed; node 0's JSON lines (rank 0 logs). ``links``: the
    script logs its topology's links (the ring crosses the nodes)."""
    results = wait_all(start_nodes(script, *args, folder=folder, launcher=launcher), timeout)
    assert not links or ("'ring': 'inter'" in results[0][2] and "(nodes of 2 ranks)" in results[0][2]), results[0][2][-2000:]
    return results[0][1]


def run_one_node(script: Path, *args: str, launcher: str = "deepspeed") -> list[dict]:
    """The same example on one node of 4 ranks (the reference): its JSON lines."""
    return assert_ok(launch(script, *args, ranks=4, launcher=launcher)).lines


def assert_same_losses(got: list[dict], want: list[dict]) -> None:
    got, want = [r for r in got if "loss" in r], [r for r in want if "loss" in r]
    assert want, "the reference logged no loss"
    assert [r["step"] for r in got] == [r["step"] for r in want], (got, want)
    for a, b in zip(got, want):
        assert abs(a["loss"] - b["loss"]) <= 1e-6 * abs(b["loss"]), (got, want)


GPT_GRID = [*GPT_TINY, "--ulysses-size", "2", "--ring-size", "2"]


@pytest.fixture(scope="module")
def one_node_gpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], Path]:
    """The demo's run (``make demo``: U2 x R2, DeepSpeed's launcher), tiny: one node of 4 ranks, 6 steps, saved."""
    if not HAVE_DEEPSPEED:
        pytest.skip("deepspeed is not installed")
    folder = tmp_path_factory.mktemp("one_node")
    return run_one_node(GPT, *GPT_GRID, "--steps", "6", "--save", str(folder)), folder


@needs_deepspeed
def test_gpt_on_one_node_trains_and_saves(one_node_gpt: tuple[list[dict], Path]) -> None:
    """The loss falls and a checkpoint is saved (the reference of the two-node run below)."""
    lines, folder = one_node_gpt
    assert [r["step"] for r in lines] == [1, 2, 3, 4, 5, 6] and lines[-1]["loss"] < lines[0]["loss"] - 0.3, lines
    assert (folder / "latest").read_text() == "global_step6"


# U1 x R4 over two nodes of 2 ranks: a double ring of 2 x 2 (inner rings of the two ranks of each node)
DOUBLE_RING = [*GPT_TINY, "--ulysses-size", "1", "--ring-size", "4", "--kv-exchange", "double_ring"]


@needs_deepspeed
def test_gpt_on_two_nodes_equals_one_node(one_node_gpt: tuple[list[dict], Path], tmp_path: Path) -> None:
    """Two emulated nodes of 2 ranks (DeepSpeed's launcher on each, --no_ssh), the ring over both as a double
    ring (issue 45 item 2): the one-node U2 x R2 run's losses."""
    assert_same_losses(run_nodes(GPT, *DOUBLE_RING, "--steps", "6", folder=tmp_path), one_node_gpt[0])


@pytest.mark.slow
@needs_deepspeed
def test_gpt_on_two_nodes_plain_ring_equals_one_node(one_node_gpt: tuple[list[dict], Path], tmp_path: Path) -> None:
    """The same grid as the one-node run (U2 x R2: each ring's two ranks on two nodes), the flat ring."""
    assert_same_losses(run_nodes(GPT, *GPT_GRID, "--steps", "6", folder=tmp_path), one_node_gpt[0])


@pytest.mark.slow
@needs_deepspeed
def test_gpt_on_two_nodes_under_torchrun(tmp_path: Path) -> None:
    one = run_one_node(GPT, *GPT_GRID, "--steps", "4", launcher="torchrun")
    assert_same_losses(run_nodes(GPT, *GPT_GRID, "--steps", "4", folder=tmp_path, launcher="torchrun"), one)


@pytest.mark.slow
@needs_hf
def test_trainer_on_two_nodes_equals_one_node(tmp_path: Path) -> None:
    args = [*TRAINER_TINY, "--ulysses-size", "2", "--ring-size", "2", "--steps", "4"]
    one = run_one_node(TRAINER, *args, "--output-dir", str(tmp_path / "one"))
    assert_same_losses(run_nodes(TRAINER, *args, "--output-dir", str(tmp_path / "two"), folder=tmp_path / "logs"), one)
    double = [*TRAINER_TINY, "--ulysses-size", "1", "--ring-size", "4", "--kv-exchange", "double_ring", "--steps", "4"]
    assert_same_losses(run_nodes(TRAINER, *double, "--output-dir", str(tmp_path / "double"),
                                 folder=tmp_path / "double_logs"), one)


MEGATRON = Path(__file__).resolve().parents[1] / "examples" / "megatron" / "pretrain_gpt.sh"
MEGATRON_TINY = ["--log-json", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                 "--num-query-groups", "2", "--ffn-hidden-size", "128", "--seq-length", "128", "--micro-batch-size", "2",
                 "--lr-warmup-iters", "0", "--corpus-bytes", "300000", "--train-iters", "3"]


@pytest.mark.slow
def test_megatron_on_two_nodes_equals_one_node(tmp_path: Path) -> None:
    """Megatron's example through torchrun on two emulated nodes: CP = 4 over both (U2 x R2), one node's losses."""
    pytest.importorskip("megatron.core")
    one = run_one_node(MEGATRON, *MEGATRON_TINY)
    assert_same_losses(run_nodes(MEGATRON, *MEGATRON_TINY, folder=tmp_path, links=False), one)


def lose_node_one(nodes: list[Node], stopped_rank: int, timeout: float = 240) -> float:
    """Wait until ``stopped_rank`` (of node 1) stopped itself (the injected fault, after a checkpoint), then
    SIGKILL node 1's launcher and ranks; returns when that happened (time.time())."""
    deadline = time.monotonic() + timeout
    while f"[fault injection] rank {stopped_rank} stops itself" not in nodes[1].stderr.read_text():
        assert nodes[1].proc.poll() is None and time.monotonic() < deadline, nodes[1].stderr.read_text()[-4000:]
        time.sleep(0.2)
    nodes[1].kill()
    return time.time()


def assert_node_zero_names_the_lost_ranks(node: Node, killed_at: float) -> float:
    returncode, _, stderr = node.wait(timeout=LOST_NODE_EXIT_S + 60)
    seconds = time.time() - killed_at
    assert returncode != 0 and seconds < LOST_NODE_EXIT_S, (seconds, stderr[-4000:])
    named = re.search(r"lost rank 2 \(pid \d+ on node [^)]*/1\), rank 3 \(pid \d+ on node [^)]*/1\) in step \d+",
                      stderr)
    assert named, stderr[-4000:]
    return seconds


def assert_no_orphans(marker: Path) -> None:
    """No process of either node is left (every rank's command line names ``marker``)."""
    left = [p.pid for p in psutil.process_iter(["cmdline"]) if str(marker) in " ".join(p.info["cmdline"] or ())]
    assert not left, left


def lose_a_node(script: Path, *args: str, folder: Path, marker: Path, launcher: str = "deepspeed") -> float:
    """Two nodes of ``script *args``; node 1 lost in step 3 (its rank 2 stops itself there, then every process
    of node 1 is killed): node 0 must stop naming ranks 2 and 3, leaving no process (each names ``marker``).
    Returns the seconds node 0 took to stop."""
    nodes = start_nodes(script, *args, folder=folder, launcher=launcher, fault="stop:2:3")
    try:
        seconds = assert_node_zero_names_the_lost_ranks(nodes[0], lose_node_one(nodes, 2))
    finally:
        for node in nodes:
            if node.proc.poll() is None:
                node.kill()
    assert_no_orphans(marker)
    return seconds


@pytest.mark.slow
@needs_deepspeed
@pytest.mark.parametrize("launcher", ["deepspeed", "torchrun"])
def test_gpt_lost_node_resumes_bitwise(tmp_path: Path, launcher: str) -> None:
    """Node 1's every process killed with SIGKILL in step 3 (its rank 2 stopped itself there first, after the
    step-2 checkpoint): node 0's ranks stop with an error naming ranks 2 and 3 on node 1; both nodes started
    again end bitwise equal to an uninterrupted one-node run. Under torchrun both launches are the same
    command with --auto-resume (what a scheduler's requeue runs), else the second adds --load."""
    common = [*GPT_GRID, "--steps", "4", "--timeout-s", "60"]
    run = tmp_path / "run"
    whole = run_one_node(GPT, *common, "--save", str(tmp_path / "whole"), launcher="torchrun")
    same = ["--auto-resume"] if launcher == "torchrun" else []
    seconds = lose_a_node(GPT, *common, "--save", str(run), "--save-interval", "2", *same, folder=tmp_path / "logs",
                          launcher=launcher, marker=run)
    assert (run / "latest").read_text() == "global_step2"
    resumed = run_nodes(GPT, *common, "--save", str(run), "--save-interval", "2", *(same or ["--load", str(run)]),
                        folder=tmp_path / "resumed", launcher=launcher)
    assert [r["step"] for r in resumed] == [3, 4]
    assert_same_losses(resumed, whole[2:])
    compared = assert_bitwise_equal(run / "global_step4", tmp_path / "whole" / "global_step4", "*.pt")
    print(f"{launcher}: node 0 stopped {seconds:.1f} s after node 1 was killed; {compared} tensors bitwise equal")


def wait_until(condition, what: str, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def listening(port: str) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", int(port))) == 0


def run_elastic(script: Path, args: list[str], folder: Path, lost: str) -> list[tuple[int, list[dict], str]]:
    """``script *args --max-restarts 1`` on two emulated nodes under torchrun's c10d rendezvous; ``lost``:
    ``rank`` (rank 2 killed with SIGKILL in step 3) or ``node`` (node 1's every process killed in step 3,
    then node 1 started again). Each node's (returncode, JSON lines, stderr)."""
    port = str(_free_port())
    elastic = [*args, "--max-restarts", "1"]
    # node 0 first: the node at --master-addr hosts the rendezvous store (here both nodes are that address)
    nodes = [start_node(script, *elastic, node=0, port=port, folder=folder, launcher="torchrun")]
    try:
        wait_until(lambda: listening(port), "node 0's rendezvous store")
        nodes.append(start_node(script, *elastic, node=1, port=port, folder=folder, launcher="torchrun",
                                fault="kill:2:3" if lost == "rank" else "stop:2:3"))
        if lost == "node":
            lose_node_one(nodes, 2)
            wait_until(lambda: "lost rank 2" in nodes[0].stderr.read_text(), "node 0's ranks to stop")
            nodes[1] = start_node(script, *elastic, node=1, port=port, folder=folder / "rejoined", launcher="torchrun")
    except BaseException:
        for node in nodes:
            if node.proc.poll() is None:
                node.kill()
        raise
    return wait_all(nodes)


@pytest.mark.slow
@needs_deepspeed
@pytest.mark.parametrize("lost", ["rank", "node"])
def test_gpt_elastic_restart_resumes_bitwise(tmp_path: Path, lost: str) -> None:
    """torchrun's elastic restart (``--max-restarts 1``: the c10d rendezvous) on two emulated nodes, with
    --auto-resume and a checkpoint every 2 steps. ``rank``: both agents restart every rank. ``node``: node
    0's agent restarts its ranks and waits; node 1 started again rejoins. Either way the ranks resume from
    the step-2 checkpoint and end bitwise equal to a run never stopped."""
    common = [*GPT_GRID, "--steps", "4", "--timeout-s", "60"]
    whole = run_one_node(GPT, *common, "--save", str(tmp_path / "whole"), launcher="torchrun")
    run = tmp_path / "run"
    results = run_elastic(GPT, [*common, "--save", str(run), "--save-interval", "2", "--auto-resume"],
                          tmp_path / "logs", lost)
    assert results[0][2].count("GPT 0.03M parameters") == 2, results[0][2][-3000:]  # node 0's ranks ran twice
    assert [r["step"] for r in results[0][1]] == [1, 2, 3, 4]
    assert_same_losses(results[0][1], whole)  # steps 1-2, then 3-4 after the restart
    compared = assert_bitwise_equal(run / "global_step4", tmp_path / "whole" / "global_step4", "*.pt")
    print(f"elastic ({lost}): {compared} tensors bitwise equal")


@pytest.mark.slow
@needs_hf
def test_trainer_ddp_elastic_restart_resumes_bitwise(tmp_path: Path) -> None:
    """The Trainer example under DDP (``--ddp``), U2 x R2 over two nodes, torchrun's elastic restart after
    rank 2 is killed in step 3, ``--auto-resume``: bitwise as a run never stopped."""
    common = [*TRAINER_TINY, "--ulysses-size", "2", "--ring-size", "2", "--steps", "4", "--save-steps", "2", "--ddp"]
    whole = run_one_node(TRAINER, *common, "--output-dir", str(tmp_path / "whole"))
    run = tmp_path / "run"
    results = run_elastic(TRAINER, [*common, "--output-dir", str(run), "--auto-resume"], tmp_path / "logs", "rank")
    assert [r["step"] for r in results[0][1] if "loss" in r] == [1, 2, 3, 4]
    assert_same_losses(results[0][1], whole)
    compared = assert_trainer_checkpoints_equal(run / "checkpoint-4", tmp_path / "whole" / "checkpoint-4", True)
    print(f"trainer (ddp, elastic): {compared} tensors bitwise equal")


def assert_trainer_checkpoints_equal(got: Path, want: Path, ddp: bool) -> int:
    """Every tensor of two Trainer checkpoints bitwise equal: DeepSpeed's states, or DDP's model
    (safetensors), optimizer and scheduler; every rank's RNG state."""
    if not ddp:
        compared = assert_bitwise_equal(trainer_states(got), trainer_states(want), "*.pt")
    else:
        from safetensors.torch import load_file

        a, b = load_file(got / "model.safetensors"), load_file(want / "model.safetensors")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in b), "model.safetensors differ"
        compared = len(b) + assert_bitwise_equal(got, want, "*.pt")
    return compared + assert_bitwise_equal(got, want, "rng_state*.pth")


@pytest.mark.slow
@needs_hf
@pytest.mark.parametrize("engine", ["deepspeed", "ddp"])
def test_trainer_lost_node_resumes_bitwise(tmp_path: Path, engine: str) -> None:
    """The Trainer example at U2 x R2 over two nodes (DeepSpeed, or DDP), checkpoints every 2 steps, node 1 lost
    in step 3: node 0 names ranks 2 and 3; --resume on both nodes ends bitwise as a run never stopped."""
    common = [*TRAINER_TINY, "--ulysses-size", "2", "--ring-size", "2", "--steps", "4", "--save-steps", "2",
              *(["--ddp"] if engine == "ddp" else [])]
    whole = run_one_node(TRAINER, *common, "--output-dir", str(tmp_path / "whole"))
    run = tmp_path / "run"
    seconds = lose_a_node(TRAINER, *common, "--output-dir", str(run), folder=tmp_path / "logs", marker=run)
    resumed = run_nodes(TRAINER, *common, "--output-dir", str(run), "--resume", folder=tmp_path / "resumed")
    assert [r["step"] for r in resumed if "loss" in r] == [3, 4]
    assert_same_losses(resumed, [r for r in whole if "loss" in r][2:])
    compared = assert_trainer_checkpoints_equal(run / "checkpoint-4", tmp_path / "whole" / "checkpoint-4", engine == "ddp")
    print(f"trainer ({engine}): node 0 stopped {seconds:.1f} s after node 1 was killed; {compared} tensors bitwise equal")



SRUN = """#!/usr/bin/env bash
# stand-in for SLURM's srun: the command once per node, in parallel, SLURM_NODEID set; fails if one fails
while [[ "$1" == --* ]]; do shift; done
pids=()
for ((node = 0; node < SLURM_JOB_NUM_NODES; node++)); do SLURM_NODEID=$node "$@" & pids+=($!); done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
exit $status
"""


@pytest.mark.slow
@needs_deepspeed
def test_slurm_script_starts_one_launcher_per_node(tmp_path: Path) -> None:
    """examples/slurm/pretrain_gpt.sbatch with local stand-ins for srun and scontrol: two 'nodes' of 2 CPU ranks
    train and save; the script run again (a requeue) resumes from the newest checkpoint (--auto-resume)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(SRUN)
    (bin_dir / "scontrol").write_text("#!/usr/bin/env bash\necho 127.0.0.1\n")
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NUM_NODES": "2",
           "SLURM_JOB_NODELIST": "node[0-1]", "SLURM_SUBMIT_DIR": str(Path(__file__).resolve().parents[1]),
           "MASTER_PORT": str(_free_port()), "NUM_RANKS": "2", "PYTHON": sys.executable}
    env.pop("RING_SP_EXAMPLE_FAULT", None)
    script = Path(__file__).resolve().parents[1] / "examples" / "slurm" / "pretrain_gpt.sbatch"

    def submit(steps: int) -> list[dict]:
        proc = subprocess.run([str(script), "--cpu", *GPT_GRID, "--steps", str(steps), "--save", str(tmp_path / "ckpt"),
                               "--save-interval", "2"], env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-4000:]
        assert "'ring': 'inter'" in proc.stderr and "(nodes of 2 ranks)" in proc.stderr, proc.stderr[-2000:]
        return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]

    assert [r["step"] for r in submit(2)] == [1, 2]
    assert [r["step"] for r in submit(4)] == [3, 4]  # requeued with more steps: it resumes at step 3
