"""Two "hosts" as network namespaces joined by a veth pair: `launchers/torchrun.sh` with
NNODES=2 from each forms one 2-rank job across them (c10d rendezvous over the link)."""

from __future__ import annotations

import contextlib
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from framework.core import startup_clock
from tests.conftest import (
    DIST_ENV_VARS,
    FAULTS,
    REPO,
    plant_shadowing_modules,
    read_metrics,
    train_losses,
    unavailable,
)
from tests.faults import FAULT_ENV, GATE_ENV, assert_same_weights, final_weights
from tests.integration.test_faults import assert_no_process_left_within

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
HOSTS = {"a": "10.77.0.1", "b": "10.77.0.2"}


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@pytest.fixture
def two_hosts():
    """Namespaces <prefix>a and <prefix>b, veth <prefix>a <-> <prefix>b; removed afterwards."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        unavailable("needs root and iproute2 to create network namespaces")
    prefix = f"fw{os.getpid() % 100000}"
    names = {host: f"{prefix}{host}" for host in HOSTS}
    try:
        for name in names.values():
            _ip("netns", "add", name)
        _ip("link", "add", names["a"], "type", "veth", "peer", "name", names["b"])
        for host, name in names.items():
            _ip("link", "set", name, "netns", name)
            _ip("-n", name, "addr", "add", f"{HOSTS[host]}/24", "dev", name)
            _ip("-n", name, "link", "set", name, "up")
            _ip("-n", name, "link", "set", "lo", "up")
    except subprocess.CalledProcessError as error:
        for name in names.values():
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        unavailable(f"cannot create network namespaces here: {error.stderr.strip()}")
    yield names
    for name in names.values():
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def test_torchrun_across_two_namespaces_trains_like_a_local_two_rank_job(
    two_hosts, tmp_path, fault_references
):
    """launchers/torchrun.sh on each host, in a working dir whose files are named like modules
    Python imports: the agents and ranks import Python's."""
    plant_shadowing_modules(tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV_VARS}
    # One thread per rank, as in the local reference (2 ranks sharing 2 cores): more threads
    # change the summation order of some kernels, and the losses in the 7th digit.
    env.update(
        PATH=f"{Path(sys.executable).parent}:{env['PATH']}",
        PYTHONPATH=str(REPO),
        NNODES="2",
        NPROC="1",
        RDZV_ENDPOINT=f"{HOSTS['a']}:29555",
        RUN_ID="two-hosts",
        MAX_RESTARTS="0",
        OMP_NUM_THREADS="1",
    )
    nodes = []
    for host, namespace in two_hosts.items():
        node_env = {
            **env,
            "LOCAL_ADDR": HOSTS[host],
            "GLOO_SOCKET_IFNAME": namespace,
            "RDZV_HOST": "1" if host == "a" else "0",
        }
        nodes.append(
            subprocess.Popen(
                [
                    "ip",
                    "netns",
                    "exec",
                    namespace,
                    "bash",
                    str(REPO / "launchers" / "torchrun.sh"),
                    *FAULTS,
                ],
                cwd=tmp_path,
                env=node_env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = [node.communicate(timeout=240)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(o[-2000:] for o in outputs)
    # One run dir, named by the rendezvous id; the ranks reached each other over the veth link.
    [run_dir] = [p.parent for p in tmp_path.glob("outputs/torchrun/two-hosts/config.yaml")]
    reference = fault_references["allreduce"]
    assert [e.get("train/loss") for e in read_metrics(run_dir)] == [
        e.get("train/loss") for e in read_metrics(reference)
    ]
    assert_same_weights(final_weights(run_dir), final_weights(reference))


# An elastic job of 1 to 2 nodes, 1 rank each: node a hosts the rendezvous, and its rank is rank
# 0 (the rendezvous numbers the nodes in the order of their addresses). 4 steps per epoch on 2
# ranks: the checkpoint at step 6 is mid-epoch, so the single rank left continues the epoch from
# its global sample position (the second half of epoch 1).
ELASTIC_STEPS = 20
ELASTIC = (
    *FAULTS,
    f"trainer.max_steps={ELASTIC_STEPS}",
    "checkpoint.every=6",
    "checkpoint.keep=100",  # the checkpoint the restart resumed from is still there at the end
    # A node that vanishes without closing its connections is noticed when a collective times
    # out. Both ranks start together (the rendezvous starts them) and wait for each other only
    # tenths of a second before the gate.
    "dist.timeout_s=5",
)
RENDEZVOUS = (
    "launcher=torchrun",
    "launcher.nnodes=1:2",
    "launcher.nproc_per_node=1",
    "launcher.max_restarts=1",
    f"launcher.rdzv_endpoint={HOSTS['a']}:29556",
    # A lost node is dropped after 1 s x 3 missed keep-alives; a round then starts 3 s after
    # its first node joined. The nodes of this test join a round together only after a join,
    # where the waiting node joins within a second (it polls the rendezvous once a second).
    "launcher.rdzv_keep_alive_s=1",
    "launcher.rdzv_keep_alive_attempts=3",
    "launcher.rdzv_last_call_s=3",
)


def _start_node(
    host: str,
    namespace: str,
    run_dir: Path,
    cwd: Path,
    script: bool,
    job: tuple[str, ...],
    faults: dict[str, str] | None = None,
) -> subprocess.Popen:
    """`train launcher=torchrun ...` on one node, or (script) launchers/torchrun.sh with the
    same settings in its environment variables; `faults`: the FRAMEWORK_TEST_* variables."""
    # Not the start-up marks an earlier `train` in this process left (the cli fixture): a node's
    # start-up counts from its own start.
    left_out = (*DIST_ENV_VARS, startup_clock.VARIABLE)
    env = {k: v for k, v in os.environ.items() if k not in left_out}
    env.update(
        PATH=f"{Path(sys.executable).parent}:{env['PATH']}",
        PYTHONPATH=str(REPO),
        OMP_NUM_THREADS="1",
        GLOO_SOCKET_IFNAME=namespace,
        **(faults or {}),
    )
    if script:  # its run dir is outputs/torchrun/<RUN_ID> in the (shared) working dir
        env.update(
            NNODES="1:2",
            NPROC="1",
            MAX_RESTARTS="1",
            RDZV_ENDPOINT=f"{HOSTS['a']}:29556",
            RUN_ID=run_dir.name,
            LOCAL_ADDR=HOSTS[host],
            RDZV_HOST="1" if host == "a" else "0",
            # Both nodes join the first round within its last call: node b retries its
            # connection to node a's store, not yet up, after 0.3, 0.4, 0.8, 1.4, 3.2 s...
            RDZV_CONF="last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=3",
        )
        command = ["bash", str(REPO / "launchers" / "torchrun.sh"), *job]
    else:
        command = [sys.executable, "-m", "framework.cli", *job, *RENDEZVOUS]
        command += [
            f"launcher.local_addr={HOSTS[host]}",
            f"launcher.rdzv_host={str(host == 'a').lower()}",
            f"hydra.run.dir={run_dir}",
        ]
    with open(cwd / f"node_{host}.out", "w") as output:
        return subprocess.Popen(
            ["ip", "netns", "exec", namespace, *command],
            cwd=cwd,
            env=env,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: killed whole, as a lost node
        )


@contextlib.contextmanager
def _nodes() -> Iterator[dict[str, subprocess.Popen]]:
    """The nodes a test starts, by host; whichever still runs at the end is killed."""
    nodes: dict[str, subprocess.Popen] = {}
    try:
        yield nodes
    finally:
        for node in nodes.values():
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
                node.wait()


def _kill_node(namespace: str) -> None:
    """SIGKILL to every process of the node (torchrun starts its ranks in sessions of their own:
    a process group is not the whole node)."""
    found = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True)
    for pid in found.stdout.split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)


def _wait_for(condition, node: subprocess.Popen, timeout_s: float, what: str) -> None:
    """Until condition() holds, while `node` runs."""
    started = time.monotonic()
    while not condition():
        assert node.poll() is None, f"node ended (code {node.returncode}) before {what}"
        assert time.monotonic() - started < timeout_s, f"no {what} within {timeout_s} s"
        time.sleep(0.1)


def _one_rank_here(cli, job: tuple[str, ...], run_dir: Path, cwd: Path, *overrides: str):
    """`train` of the same job on one rank, in this process, with one thread as the nodes' ranks
    (OMP_NUM_THREADS=1, which a running torch no longer reads): more threads change the last
    bits of the weights, and on busy cores they wait for each other at every small kernel."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return cli(
            *job,
            "launcher.nproc_per_node=1",
            f"hydra.run.dir={run_dir}",
            *overrides,
            cwd=cwd,
            env={"OMP_NUM_THREADS": "1", FAULT_ENV: None, GATE_ENV: None},
        )
    finally:
        torch.set_num_threads(threads)


def test_an_elastic_job_that_loses_a_node_goes_on_alone_from_the_last_checkpoint(
    two_hosts, tmp_path, cli
):
    """Both nodes started by launchers/torchrun.sh. Node b is unplugged: its link goes down
    before its processes die, so nothing reaches node a, whose collective times out
    (dist.timeout_s). (A node killed with its link up, under `train launcher=torchrun`: the
    global-batch test below.)"""
    # One run dir for both nodes, outputs/torchrun/<RUN_ID> in their working dir: a shared file
    # system.
    run_dir = tmp_path / "outputs" / "torchrun" / "elastic"
    gate, log_file = tmp_path / "gate", run_dir / "train.log"
    checkpoint = run_dir / "checkpoints" / "step_00000006.pt"
    gate.touch()
    # Node b's rank holds before its 7th step while the gate exists (tests/faults.py): the job
    # waits after the checkpoint at step 6 for the test to unplug node b, and node a's rank
    # waits in that step's collective.
    hold = {FAULT_ENV: "hold:1:7", GATE_ENV: str(gate)}
    with _nodes() as nodes:
        # Node b first: it waits for node a's rendezvous store, so both join within the last call.
        nodes["b"] = _start_node("b", two_hosts["b"], run_dir, tmp_path, True, ELASTIC, hold)
        nodes["a"] = _start_node("a", two_hosts["a"], run_dir, tmp_path, True, ELASTIC)
        _wait_for(checkpoint.exists, nodes["a"], 180, "checkpoint 6")
        assert nodes["b"].poll() is None
        _ip("-n", two_hosts["b"], "link", "set", two_hosts["b"], "down")
        _kill_node(two_hosts["b"])  # the node is gone: agent and rank
        lost = time.monotonic()
        # While node a's rank waits out its collective, its agent restarts it and the new rank
        # imports: the same job resumed from that checkpoint on one rank by hand, in another
        # run dir, to compare with.
        resume = f"checkpoint.resume={checkpoint}"
        by_hand = _one_rank_here(cli, ELASTIC, tmp_path / "by_hand", tmp_path, resume)
        _wait_for(lambda: "world_size=1" in log_file.read_text(), nodes["a"], 120, "restart")
        delay = time.monotonic() - lost
        nodes["a"].wait(timeout=120)
    output = (tmp_path / "node_a.out").read_text()
    assert nodes["a"].returncode == 0, output[-4000:]
    # The survivor learned it from the timeout, and said so in one line.
    assert "rank 0 waited dist.timeout_s=5 s in a collective without an answer" in output
    log = log_file.read_text()
    # Two ranks first, then one, from the checkpoint written before the loss, resharded.
    assert log.index("world_size=2") < log.index("world_size=1"), log[-3000:]
    assert f"resumed from {checkpoint} at step 6" in log, log[-3000:]
    assert "written by 2 ranks, on 1" in log
    # One metrics event per step: none lost at the checkpoint, none left from after it.
    events = [e for e in read_metrics(run_dir) if "train/loss" in e]
    assert [e["step"] for e in events] == list(range(1, ELASTIC_STEPS + 1))
    losses = [e["train/loss"] for e in events]
    assert all(math.isfinite(loss) for loss in losses) and losses[-1] < losses[0]
    assert by_hand.returncode == 0, by_hand.stderr[-3000:]
    assert train_losses(tmp_path / "by_hand") == losses[6:]
    assert_same_weights(final_weights(run_dir), final_weights(tmp_path / "by_hand"))
    print(f"node b unplugged -> node a's rank started again within {delay:.1f} s")
    assert_no_process_left_within(1, tmp_path)


# An elastic job with a constant global batch (trainer.global_batch_size): 64 samples per step =
# 32 per rank x 2 ranks, or x 1 rank x 2 accumulation steps; 4 steps per epoch either way.
# Rank 0 holds at its HOLD_AT-th micro-batch of each round while the gate file exists
# (tests/faults.py): alone, in step 5; the join stops it at step 6, and the 2-rank round holds
# at step 15, after its checkpoint at step 10, mid-epoch.
HOLD_AT, CHECKPOINT_EVERY = 9, 5
CONSTANT = (
    *FAULTS,
    "model._target_=tests.faults.SteadyMLP",  # no per-rank noise: the samples decide the losses
    "data.batch_size=32",
    "trainer.global_batch_size=64",
    "trainer.max_steps=30",
    f"checkpoint.every={CHECKPOINT_EVERY}",
    "checkpoint.keep=100",
    # A joining node's rank may start long after the others (its fork server still importing):
    # they wait for it. The lost node is killed, so its peer's collective fails at once.
    "dist.timeout_s=120",
)


def test_an_elastic_job_keeps_its_global_batch_as_a_node_joins_and_is_lost(
    two_hosts, tmp_path, cli
):
    """Both nodes started by `train launcher=torchrun`. Node a trains alone (1 rank x 2
    accumulation steps) and holds; node b joins later and the group restarts bigger by itself
    (2 ranks x 1); node b's processes are killed with its link up (node a's next collective
    fails at once) and node a finishes alone from the newest checkpoint. Every step's loss
    equals an uninterrupted one-rank run's with the same global batch, and the last round's
    losses and weights those of a resume of its checkpoint by hand."""
    run_dir = tmp_path / "run"
    log_file = run_dir / "train.log"
    with _nodes() as nodes:
        joined, newest = _join_then_lose_node_b(two_hosts, run_dir, tmp_path, nodes)
        lost = time.monotonic()
        # While node a restarts its rank: the runs to compare with, in this process.
        uninterrupted = _one_rank_here(cli, CONSTANT, tmp_path / "uninterrupted", tmp_path)
        resume = f"checkpoint.resume={newest}"
        by_hand = _one_rank_here(cli, CONSTANT, tmp_path / "by_hand", tmp_path, resume)
        _wait_for(lambda: _text(log_file).count("world_size=") == 3, nodes["a"], 120, "restart")
        delay = time.monotonic() - lost
        nodes["a"].wait(timeout=180)
    output = (tmp_path / "node_a.out").read_text()
    assert nodes["a"].returncode == 0, output[-4000:]
    # Killed, the survivor's collective failed at once (no timeout), and its agent reported the
    # failed rank in one line (framework/launch/torchrun/agent.py).
    assert "waited dist.timeout_s" not in output, output[-4000:]
    assert "Traceback" not in output, output[-4000:]
    log = log_file.read_text()
    rounds = re.findall(r"world_size=\d .*global batch (64 = 32 per rank x \d ranks x \d)", log)
    assert rounds == [f"64 = 32 per rank x {n} ranks x {3 - n}" for n in (1, 2, 1)], log[-3000:]
    # The join stopped the ranks with a checkpoint of the step reached, and said that the job
    # goes on by itself; the loss resumed from the newest checkpoint, which the 2 ranks wrote.
    assert "the agent restarts them by itself from this checkpoint" in log
    assert "To continue" not in log, log[-3000:]
    resumed = re.findall(r"resumed from (\S+) at step (\d+)", log)
    assert [int(step) for _, step in resumed[:1]] == [joined], log[-3000:]
    assert resumed[1:] == [(str(newest), str(int(newest.stem.removeprefix("step_"))))]
    assert "written by 1 ranks, on 2" in log and "written by 2 ranks, on 1" in log
    events = [e for e in read_metrics(run_dir) if "train/loss" in e]
    assert [e["step"] for e in events] == list(range(1, 31))
    losses = [e["train/loss"] for e in events]
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-3000:]
    expected = train_losses(tmp_path / "uninterrupted")
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, expected, strict=True))
    print(f"largest relative difference from the uninterrupted run: {worst:.2e}")
    torch.testing.assert_close(losses, expected, rtol=1e-5, atol=0)
    assert by_hand.returncode == 0, by_hand.stderr[-3000:]
    assert train_losses(tmp_path / "by_hand") == losses[int(resumed[1][1]) :]
    assert_same_weights(final_weights(run_dir), final_weights(tmp_path / "by_hand"))
    print(f"node b killed -> node a's rank started again within {delay:.1f} s")
    assert_no_process_left_within(1, tmp_path)


def _join_then_lose_node_b(
    two_hosts: dict[str, str], run_dir: Path, cwd: Path, nodes: dict[str, subprocess.Popen]
) -> tuple[int, Path]:
    """Node a alone, node b joining, node b killed while the 2-rank round holds. Returns the
    step the join stopped the lone rank at, and the newest checkpoint when node b was lost."""
    gate, log_file = cwd / "gate", run_dir / "train.log"
    gate.touch()
    faults = {FAULT_ENV: f"hold:0:{HOLD_AT}", GATE_ENV: str(gate)}
    nodes["a"] = _start_node("a", two_hosts["a"], run_dir, cwd, False, CONSTANT, faults)
    _wait_for(lambda: "world_size=1" in _text(log_file), nodes["a"], 180, "node a alone")
    nodes["b"] = _start_node("b", two_hosts["b"], run_dir, cwd, False, CONSTANT, faults)
    _wait_for(lambda: "world_size=2" in _text(log_file), nodes["a"], 180, "node b joining")
    joined = int(re.findall(r"stopped on SIGTERM at step (\d+)", _text(log_file))[0])
    # The 2-rank round (1 micro-batch per step) holds at step joined + HOLD_AT: its last
    # checkpoint before that is the newest one when node b is lost.
    last = (joined + HOLD_AT - 1) // CHECKPOINT_EVERY * CHECKPOINT_EVERY
    newest = run_dir / "checkpoints" / f"step_{last:08d}.pt"
    _wait_for(newest.exists, nodes["a"], 120, "the 2-rank round's last checkpoint")
    _kill_node(two_hosts["b"])
    gate.unlink()  # node a's rank goes on, finds its peer gone, and restarts alone
    return joined, newest


def _text(path: Path) -> str:
    return path.read_text() if path.exists() else ""
