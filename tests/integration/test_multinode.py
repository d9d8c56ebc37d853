"""Two "hosts" as network namespaces joined by a veth pair: `launchers/torchrun.sh` with
NNODES=2 from each forms one 2-rank job across them (c10d rendezvous over the link)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import DIST_ENV_VARS, FAULTS, REPO, read_metrics
from tests.faults import assert_same_weights, final_weights

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
HOSTS = {"a": "10.77.0.1", "b": "10.77.0.2"}


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@pytest.fixture
def two_hosts():
    """Namespaces <prefix>a and <prefix>b, veth <prefix>a <-> <prefix>b; removed afterwards."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 to create network namespaces")
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
        pytest.skip(f"cannot create network namespaces here: {error.stderr.strip()}")
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
