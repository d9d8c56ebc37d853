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
from pathlib import Path

import pytest
import torch

from tests.conftest import (
    DIST_ENV_VARS,
    FAULTS,
    REPO,
    make_cfg,
    read_metrics,
    train_in_process,
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


# An elastic job of 1 to 2 nodes, 1 rank each. Rank 0 sleeps 0.3 s per step from its 5th
# (tests/faults.py): time to see a checkpoint and kill the other node mid-training (the 14 steps
# after the checkpoint leave it 4 s), and the survivor's pace too. 4 steps per epoch on 2
# ranks: the checkpoint at step 6 is mid-epoch, so the single rank left continues the epoch
# from its global sample position (the second half of epoch 1).
ELASTIC_STEPS = 20
ELASTIC = (
    *FAULTS,
    f"trainer.max_steps={ELASTIC_STEPS}",
    "checkpoint.every=6",
    "checkpoint.keep=100",  # the checkpoint the restart resumed from is still there at the end
    # A node that vanishes without closing its connections is noticed when a collective times out.
    "dist.timeout_s=10",
)
RENDEZVOUS = (
    "launcher=torchrun",
    "launcher.nnodes=1:2",
    "launcher.nproc_per_node=1",
    "launcher.max_restarts=1",
    f"launcher.rdzv_endpoint={HOSTS['a']}:29556",
    # A lost node is dropped after 1 s x 3 missed keep-alives; a round then starts 5 s after
    # its first node joined: the survivor trains again about 10 s after the loss.
    "launcher.rdzv_keep_alive_s=1",
    "launcher.rdzv_keep_alive_attempts=3",
    "launcher.rdzv_last_call_s=5",
)


def _start_node(
    host: str,
    namespace: str,
    run_dir: Path,
    cwd: Path,
    script: bool,
    job: tuple[str, ...] = ELASTIC,
    faults: dict[str, str] | None = None,
) -> subprocess.Popen:
    """`train launcher=torchrun ...` on one node, or (script) launchers/torchrun.sh with the
    same settings in its environment variables; `faults`: the FRAMEWORK_TEST_* variables."""
    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV_VARS}
    env.update(
        PATH=f"{Path(sys.executable).parent}:{env['PATH']}",
        PYTHONPATH=str(REPO),
        OMP_NUM_THREADS="1",
        GLOO_SOCKET_IFNAME=namespace,
        **(faults or {FAULT_ENV: "slow:0:5"}),
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


def _kill_node(namespace: str) -> None:
    """SIGKILL to every process of the node (torchrun starts its ranks in sessions of their own:
    a process group is not the whole node)."""
    found = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True)
    for pid in found.stdout.split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)


def _wait_for(condition, node: subprocess.Popen, timeout_s: float, what: str) -> float:
    """Seconds until condition() holds, while `node` runs."""
    started = time.monotonic()
    while not condition():
        assert node.poll() is None, f"node ended (code {node.returncode}) before {what}"
        assert time.monotonic() - started < timeout_s, f"no {what} within {timeout_s} s"
        time.sleep(0.1)
    return time.monotonic() - started


# Each way to start the job and each way to lose a node, once: the survivor's agent restarts its
# rank the same way whichever way the rank learned of the loss.
@pytest.mark.parametrize(("launch", "loss"), [("launcher", "killed"), ("script", "unplugged")])
def test_an_elastic_job_that_loses_a_node_goes_on_alone_from_the_last_checkpoint(
    two_hosts, tmp_path, cli, launch, loss
):
    """launcher: `train launcher=torchrun`; script: launchers/torchrun.sh. killed: node b's
    processes die, and their connections close (node a's next collective fails at once).
    unplugged: node b's link goes down first, so nothing reaches node a and its collective times
    out (dist.timeout_s)."""
    # One run dir for both nodes: a shared file system.
    script = launch == "script"
    run_dir = tmp_path / "outputs" / "torchrun" / "elastic" if script else tmp_path / "run"
    # Node b first: it waits for node a's rendezvous store, so both join within the last call.
    node_b = _start_node("b", two_hosts["b"], run_dir, tmp_path, script)
    node_a = _start_node("a", two_hosts["a"], run_dir, tmp_path, script)
    log_file = run_dir / "train.log"
    try:
        _wait_for(
            (run_dir / "checkpoints" / "step_00000006.pt").exists, node_a, 180, "checkpoint 6"
        )
        assert node_b.poll() is None
        if loss == "unplugged":
            _ip("-n", two_hosts["b"], "link", "set", two_hosts["b"], "down")
        _kill_node(two_hosts["b"])  # the node is gone: agent, fork server, rank
        delay = _wait_for(lambda: "world_size=1" in log_file.read_text(), node_a, 120, "restart")
        node_a.wait(timeout=120)
    finally:
        for node in (node_a, node_b):
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
                node.wait()
    output = (tmp_path / "node_a.out").read_text()
    assert node_a.returncode == 0, output[-4000:]
    # Unplugged, the survivor learned it from the timeout, and said so in one line.
    timed_out = "rank 0 waited dist.timeout_s=10 s in a collective without an answer"
    assert (timed_out in output) is (loss == "unplugged"), output[-4000:]
    # The agent reported its failed rank in one line (framework/launch/torchrun/agent.py).
    assert script or "Traceback" not in output, output[-4000:]
    log = log_file.read_text()
    # Two ranks first, then one, from the newest checkpoint written before the loss.
    assert log.index("world_size=2") < log.index("world_size=1"), log[-3000:]
    resumed = re.search(r"resumed from (\S+step_(\d+)\.pt) at step (\d+)", log)
    assert resumed is not None, log[-3000:]
    checkpoint, step = Path(resumed[1]), int(resumed[3])
    assert step >= 6 and "written by 2 ranks, on 1" in log
    # One metrics event per step: none lost at the checkpoint, none left from after it.
    events = [e for e in read_metrics(run_dir) if "train/loss" in e]
    assert [e["step"] for e in events] == list(range(1, ELASTIC_STEPS + 1))
    losses = [e["train/loss"] for e in events]
    assert all(math.isfinite(loss) for loss in losses) and losses[-1] < losses[0]
    # The same as resuming that checkpoint on one rank by hand.
    reference = tmp_path / "reference"
    # In this process, with one thread as the nodes' ranks (OMP_NUM_THREADS=1, which a running
    # torch no longer reads): more threads change the last bits of the weights.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        by_hand = cli(
            *ELASTIC,
            "launcher.nproc_per_node=1",
            f"checkpoint.resume={checkpoint}",
            f"hydra.run.dir={reference}",
            cwd=tmp_path,
            env={"OMP_NUM_THREADS": "1", FAULT_ENV: None},
        )
    finally:
        torch.set_num_threads(threads)
    assert by_hand.returncode == 0, by_hand.stderr[-3000:]
    assert train_losses(reference) == losses[step:]
    assert_same_weights(final_weights(run_dir), final_weights(reference))
    print(f"{launch}, node {loss} -> the survivor's rank started again: {delay:.1f} s")
    assert_no_process_left_within(1, tmp_path)


# An elastic job with a constant global batch (trainer.global_batch_size): 64 samples per step =
# 32 per rank x 2 ranks, or x 1 rank x 2 accumulation steps; 4 steps per epoch either way.
# Rank 0 holds at each step from its 9th micro-batch while the gate file exists (tests/faults.py).
CONSTANT = (
    *FAULTS,
    "model._target_=tests.faults.SteadyMLP",  # no per-rank noise: the samples decide the losses
    "data.batch_size=32",
    "trainer.global_batch_size=64",
    "trainer.max_steps=30",
    "checkpoint.every=4",
    "checkpoint.keep=100",
    # A joining node's rank may start long after the others (its fork server still importing):
    # they wait for it. The lost node is killed, so its peer's collective fails at once.
    "dist.timeout_s=120",
)


def test_an_elastic_job_keeps_its_global_batch_as_a_node_joins_and_is_lost(two_hosts, tmp_path):
    """Node a trains alone (1 rank x 2 accumulation steps) and holds; node b joins later and
    the group restarts bigger by itself (2 ranks x 1); node b is killed and node a finishes
    alone from the newest checkpoint. Every step's loss equals an uninterrupted one-rank run's
    with the same global batch."""
    run_dir = tmp_path / "run"
    joined = _join_then_lose_node_b(two_hosts, run_dir, tmp_path)
    log = (run_dir / "train.log").read_text()
    rounds = re.findall(r"world_size=\d .*global batch (64 = 32 per rank x \d ranks x \d)", log)
    assert rounds == [f"64 = 32 per rank x {n} ranks x {3 - n}" for n in (1, 2, 1)], log[-3000:]
    # The join stopped the ranks with a checkpoint of the step reached, and said that the job
    # goes on by itself; the loss resumed from a checkpoint the 2 ranks wrote.
    assert "the agent restarts them by itself from this checkpoint" in log
    assert "To continue" not in log, log[-3000:]
    resumed = [int(step) for step in re.findall(r"resumed from \S+ at step (\d+)", log)]
    assert resumed[0] == joined < resumed[1], log[-3000:]
    events = [e for e in read_metrics(run_dir) if "train/loss" in e]
    assert [e["step"] for e in events] == list(range(1, 31))
    reference = tmp_path / "reference"
    train_in_process(make_cfg(*CONSTANT, "launcher.nproc_per_node=1"), reference)
    expected = train_losses(reference)
    losses = [e["train/loss"] for e in events]
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, expected, strict=True))
    print(f"largest relative difference from the uninterrupted run: {worst:.2e}")
    torch.testing.assert_close(losses, expected, rtol=1e-5, atol=0)
    assert_no_process_left_within(1, tmp_path)


def _join_then_lose_node_b(two_hosts: dict[str, str], run_dir: Path, cwd: Path) -> int:
    """Node a alone, node b joining, node b killed after a checkpoint of the 2-rank round;
    node a's exit checked. Returns the step the join stopped the lone rank at."""
    gate, log_file = cwd / "gate", run_dir / "train.log"
    gate.touch()
    faults = {FAULT_ENV: "hold:0:9", GATE_ENV: str(gate)}
    nodes = {}
    try:
        nodes["a"] = _start_node("a", two_hosts["a"], run_dir, cwd, False, CONSTANT, faults)
        _wait_for(lambda: "world_size=1" in _text(log_file), nodes["a"], 180, "node a alone")
        nodes["b"] = _start_node("b", two_hosts["b"], run_dir, cwd, False, CONSTANT, faults)
        _wait_for(lambda: "world_size=2" in _text(log_file), nodes["a"], 180, "node b joining")
        joined = int(re.findall(r"stopped on SIGTERM at step (\d+)", _text(log_file))[0])
        newer = run_dir / "checkpoints" / f"step_{(joined // 4 + 1) * 4:08d}.pt"
        _wait_for(newer.exists, nodes["a"], 120, "a checkpoint on 2 ranks")
        _kill_node(two_hosts["b"])
        gate.unlink()  # node a's rank goes on, finds its peer gone, and restarts alone
        nodes["a"].wait(timeout=180)
    finally:
        for node in nodes.values():
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
                node.wait()
    assert nodes["a"].returncode == 0, (cwd / "node_a.out").read_text()[-4000:]
    return joined


def _text(path: Path) -> str:
    return path.read_text() if path.exists() else ""
