"""A real two-node Ray cluster on this machine, with token authentication on: `rlpipe submit` runs a tiny job
through the Ray Jobs API, and the roles land on the nodes their placement names.

The head advertises `learner_host`, the second node `rollout_host`; both start from `ray start`, as on a TPU VM.
(Ray advertises this machine's outward address once a cluster has several nodes; the head's dashboard and
job API stay on 127.0.0.1.)
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlpipe.cli import main
from tests.integration.conftest import node_environment

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
PYTHON_BIN = Path(sys.executable).parent


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for sock in sockets:
        sock.bind(("127.0.0.1", 0))
    ports = [sock.getsockname()[1] for sock in sockets]
    for sock in sockets:
        sock.close()
    return ports


def _node_ports() -> list[str]:
    manager, objects, agent, agent_grpc, metrics, runtime_env = _free_ports(6)
    return [
        f"--node-manager-port={manager}", f"--object-manager-port={objects}",
        f"--dashboard-agent-listen-port={agent}", f"--dashboard-agent-grpc-port={agent_grpc}",
        f"--metrics-export-port={metrics}", f"--runtime-env-agent-port={runtime_env}",
    ]


class Cluster:
    def __init__(self, token: str):
        # The environment of an activated virtual environment, so jobs find the same `python`.
        self.env = {
            **node_environment(), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token,
            "PATH": f"{PYTHON_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        }
        gcs, dashboard, client = _free_ports(3)
        self.address, self.dashboard = f"127.0.0.1:{gcs}", f"http://127.0.0.1:{dashboard}"
        common = ["--block", "--node-ip-address=127.0.0.1", "--disable-usage-stats"]
        self.processes = [self._start(
            ["--head", f"--port={gcs}", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}",
             f"--ray-client-server-port={client}", "--include-dashboard=true", "--num-cpus=4",
             '--resources={"learner_host": 2}', *common, *_node_ports()]
        )]
        self._wait_for(lambda nodes: len(nodes) == 1, "the head")
        self.processes.append(self._start(
            [f"--address={self.address}", "--num-cpus=3", '--resources={"rollout_host": 1}', *common, *_node_ports()]
        ))
        self.nodes = self._wait_for(lambda nodes: len(nodes) == 2, "the second node")

    def _start(self, arguments: list[str]) -> subprocess.Popen:
        # Each node in its own process group, so the test stops exactly its own Ray processes (`ray stop` would
        # stop every Ray cluster on the machine).
        return subprocess.Popen(
            [str(PYTHON_BIN / "ray"), "start", *arguments], env=self.env, start_new_session=True,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )

    def alive_nodes(self) -> list[dict]:
        script = (
            "import json, ray; ray.init(address=%r, logging_level='ERROR', log_to_driver=False);"
            "print('NODES ' + json.dumps([n for n in ray.nodes() if n['Alive']]))" % self.address
        )
        done = subprocess.run([sys.executable, "-c", script], env=self.env, capture_output=True, text=True, timeout=60)
        # The cluster's workers may print to this driver too: only the marked line is the answer.
        answers = [line for line in done.stdout.splitlines() if line.startswith("NODES ")]
        return json.loads(answers[-1][len("NODES "):]) if done.returncode == 0 and answers else []

    def _wait_for(self, ready, what: str, timeout_s: float = 90.0) -> list[dict]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            nodes = self.alive_nodes()
            if ready(nodes):
                return nodes
            time.sleep(1.0)
        self.stop()
        raise RuntimeError(f"{what} of the test's Ray cluster did not come up within {timeout_s:g} s")

    def node_with(self, resource: str) -> str:
        return next(node["NodeID"] for node in self.nodes if resource in node["Resources"])

    def stop(self) -> None:
        for process in reversed(self.processes):
            try:
                os.killpg(process.pid, signal.SIGTERM)
                process.wait(timeout=30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                os.killpg(process.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def cluster():
    started = Cluster(secrets.token_hex(16))
    yield started
    started.stop()


def _submit(cluster: Cluster, *arguments: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`rlpipe submit` in a fresh process with the cluster's token in its environment, as a user's shell runs it.

    Never in the test process: Ray reads the token once per process, and a later test's local cluster (with a
    token of its own) would then be refused."""
    return subprocess.run(
        [sys.executable, "-m", "rlpipe.cli", "submit", "--address", cluster.dashboard, *arguments],
        env=env or cluster.env, capture_output=True, text=True, timeout=600,
    )


def _job(tmp_path, tiny_qwen3, *extra) -> list[str]:
    return [
        str(REPO / "configs" / "default.yaml"),
        f"run.output_dir={tmp_path}", f"model.path={tiny_qwen3}", "run.name=on-cluster",
        "rollout.group_size=2", "rollout.max_tokens=8", "data.eval_size=2", "data.size=50",
        "train.steps=1", "train.prompts_per_step=2", "train.micro_batch_size=4", "metrics.tensorboard=false",
        "metrics.plot=false", "metrics.export=false", *extra,
    ]


def test_submit_follows_a_job_whose_roles_land_where_placement_says(cluster, tmp_path, tiny_qwen3):
    placement = [
        "learner.ranks=2", "placement.learner.resources={learner_host: 1}",
        "placement.rollout.resources={rollout_host: 1}",
    ]
    done = _submit(cluster, "--working-dir", str(REPO), *_job(tmp_path, tiny_qwen3, *placement))
    logs = done.stdout
    assert done.returncode == 0, (logs + done.stderr)[-3000:]
    assert "submitted job" in logs and "step 1/1" in logs and "succeeded" in logs
    summary = json.loads((tmp_path / "on-cluster" / "summary.json").read_text())
    learner_node, rollout_node = cluster.node_with("learner_host"), cluster.node_with("rollout_host")
    assert learner_node != rollout_node
    assert summary["placement"]["learner"] == [learner_node, learner_node]
    assert summary["placement"]["rollout"] == [rollout_node]


def test_a_role_the_cluster_cannot_place_fails_the_job_naming_it(cluster, tmp_path, tiny_qwen3):
    done = _submit(cluster, "--working-dir", str(REPO), *_job(
        tmp_path, tiny_qwen3, "placement.rollout.resources={tpu_host: 1}", "ray.placement_timeout_s=3"
    ))
    logs = done.stdout
    assert done.returncode == 1, (logs + done.stderr)[-3000:]
    assert "placement.rollout: the cluster cannot place 1 bundle(s) of {'CPU': 1.0, 'tpu_host': 1.0}" in logs
    assert not (tmp_path / "on-cluster").exists()  # nothing written for a run that could not start


def test_submit_without_the_clusters_token_is_refused_in_one_line(cluster, tmp_path, tiny_qwen3):
    done = _submit(
        cluster, "--working-dir", str(REPO), *_job(tmp_path, tiny_qwen3),
        env={**cluster.env, "RAY_AUTH_TOKEN": "not-the-token"},
    )
    lines = [line for line in done.stderr.splitlines() if line.startswith("rlpipe:")]
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-2000:]
    assert lines[0].startswith(f"rlpipe: Ray cluster at {cluster.dashboard}:") and "auth" in lines[0].lower()
    assert "submitted job" not in done.stdout


def test_submit_checks_the_recipe_before_uploading(cluster, tmp_path, capsys):  # no job reaches the cluster
    status = main(["submit", "--address", cluster.dashboard, str(REPO / "configs" / "default.yaml"), "train.stepz=1"])
    assert status == 2 and "train.stepz: unknown key" in capsys.readouterr().err
    outside = tmp_path / "recipe.yaml"
    outside.write_text("train: {steps: 1}\n")
    status = main(["submit", "--address", cluster.dashboard, "--working-dir", str(REPO), str(outside)])
    assert status == 2 and "must be inside the uploaded working directory" in capsys.readouterr().err


def test_submit_checks_the_clusters_resources_before_uploading(cluster, tmp_path, tiny_qwen3):
    done = _submit(cluster, "--working-dir", str(REPO), *_job(
        tmp_path, tiny_qwen3, "learner.device=tpu", "placement.learner.tpu=v6e-8", "learner.ranks=8"
    ))
    lines = [line for line in done.stderr.splitlines() if line.startswith("rlpipe:")]
    assert done.returncode == 2 and len(lines) == 1, (done.stdout + done.stderr)[-2000:]
    assert lines[0].startswith(f"rlpipe: config error: learner.device: the run needs TPU chips, the cluster at {cluster.dashboard} "
                               "has no TPU resource (resources: CPU, ")
    assert "learner_host" in lines[0] and "submitted job" not in done.stdout
    done = _submit(cluster, "--working-dir", str(REPO), *_job(tmp_path, tiny_qwen3, "rollout.num_engines=40"))
    assert done.returncode == 2 and "but the roles need 42" in done.stderr and "submitted job" not in done.stdout
