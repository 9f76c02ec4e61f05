"""Roles on different hosts, as on a TPU deployment where learner and rollout run on different VMs: three hosts on
this machine, each a network namespace with its own address and /dev/shm running a Ray node (hosts.py). The
driver runs on host A, next to the Ray head. A GRPO run places its roles host by host; a run loses its rollout
host mid-step and goes on with the engine on another host, losing and repeating nothing."""

from __future__ import annotations

import json
import socket
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
STEPS = 3
GROUP_SIZE = 4
HOSTS = {
    "host_a": {"cpus": 4, "resources": {"host_a": 8}},
    # B and C each have room for one engine (rollout_slot): an engine that loses one can start on the other.
    "host_b": {"cpus": 2, "resources": {"host_b": 8, "rollout_slot": 1}},
    "host_c": {"cpus": 2, "resources": {"host_c": 8, "rollout_slot": 1}},
}


def _train_command(hosts, output_dir: Path, model: str, name: str, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "rlpipe.cli", "train", f"ray.address={hosts.address}",
        f"run.output_dir={output_dir}", f"run.name={name}", f"model.path={model}", "learner.ranks=2",
        # 24 tokens: a step's generation lasts long enough for a test to lose the engine's host in the middle of it,
        # even on a loaded machine.
        f"rollout.group_size={GROUP_SIZE}", "rollout.max_tokens=24", "rollout.max_model_len=144",
        "data.max_prompt_tokens=112", "data.size=32", "data.eval_size=0", f"train.steps={STEPS}",
        "train.prompts_per_step=2", "train.micro_batch_size=4", "train.lr=1e-3", "metrics.tensorboard=false",
        "metrics.plot=false", "metrics.export=false",
        # Rewards that differ within a group, so every step moves the weights the probe then checks.
        "reward.functions=[{name: 'tests.unit.reward_fixtures:length', weight: 0.01}]", *extra,
    ]


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _prompts_by_step(run_dir: Path) -> list[tuple[int, int, int]]:
    """(step, prompt's sample id, completions) of every group, from samples.jsonl (which holds two groups a step:
    all of them here)."""
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    return [(s["step"], s["sample_id"], len(s["completions"])) for s in samples]


def _check_steps(run_dir: Path) -> list[dict]:
    """Every step logged once, in order, each a new policy version, each sync checked by the probe."""
    records = _records(run_dir)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert [r["policy_version"] for r in records] == list(range(1, STEPS + 1))
    for record in records:
        assert record["sync/probe_max_abs"] < 1e-4, record
        assert record["sync/bytes"] > 0
        assert record["sync/pairs_ray"] == 2 and record["sync/pairs_shm"] == 0  # learner and engine hosts differ
    assert any(r["sync/policy_shift"] > 1e-3 for r in records)  # the weights did move
    return records


@pytest.fixture(scope="module")
def uninterrupted(hosts, tiny_qwen3, tmp_path_factory):
    """A GRPO run with its learner ranks on host A, its engine on host B and its reward worker on host C: the
    placement test checks it, the fault test compares a run that loses a host with it. Returns the run directory
    and the driver's result."""
    output = tmp_path_factory.mktemp("hosts-runs")
    command = _train_command(
        hosts, output, tiny_qwen3, "placed", "placement.learner.resources={host_a: 1}",
        "placement.rollout.resources={host_b: 1}", "placement.reward.resources={host_c: 1}",
    )
    return output / "placed", hosts.head.run(command, cwd=str(REPO), timeout=600)


def test_each_host_has_its_own_address_network_and_shared_memory(hosts):
    nodes = {node["address"]: node for node in hosts.nodes()}
    assert sorted(nodes) == sorted(host.address for host in hosts.hosts.values())
    for name, host in hosts.hosts.items():
        assert name in nodes[host.address]["resources"]  # each Ray node advertises its host's name
        addresses = host.run(["ip", "-o", "-4", "addr", "show", "eth0"]).stdout
        assert f"inet {host.address}/24" in addresses
        assert "default" not in host.run(["ip", "route"]).stdout  # no way out of the hosts' network
    # Hosts reach each other, and only each other: a port open on the machine's own loopback is not theirs.
    connect = "import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2)"
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = str(server.getsockname()[1])
        assert hosts.hosts["host_b"].run([sys.executable, "-c", connect, hosts.head.address, "6379"]).returncode == 0
        assert hosts.head.run([sys.executable, "-c", connect, "127.0.0.1", port]).returncode != 0
    # Each host has a /dev/shm of its own: what one writes there, neither another host nor the machine sees.
    a, b = hosts.hosts["host_a"], hosts.hosts["host_b"]
    marker = f"/dev/shm/rlpipe-hosts-{hosts.tag}"
    assert a.run(["sh", "-c", f"echo a > {marker} && cat {marker}"]).stdout == "a\n"
    assert b.run(["cat", marker]).returncode != 0
    assert not Path(marker).exists()


def test_roles_run_on_the_hosts_their_placement_names(hosts, uninterrupted):
    run_dir, done = uninterrupted
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    a, b, c = (hosts.hosts[name].address for name in ("host_a", "host_b", "host_c"))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["hosts"] == {"learner": [a, a], "rollout": [b], "reward": [c]}
    # sync.transport auto: learner ranks and engine on different hosts, so the object store for both pairs.
    assert set(summary["sync_routes"].values()) == {"ray"} and len(summary["sync_routes"]) == 2
    assert summary["sync_check"]["sync/probe_max_abs"] < 1e-4  # the start-up check, learner on A to engine on B
    assert summary["sync_check"]["sync/bytes"] > 0
    records = _check_steps(run_dir)
    assert all(r["rollout/restarts"] == 0 for r in records)


def test_a_forced_shm_between_hosts_stops_at_start_up_naming_both(hosts, tiny_qwen3, tmp_path):
    """Shared-memory segments exist only on the host that made them: sync.transport=shm with the learner on host
    A and the engine on host B is refused before any actor starts, in one line naming both hosts."""
    command = _train_command(
        hosts, tmp_path, tiny_qwen3, "shm", "sync.transport=shm", "placement.learner.resources={host_a: 1}",
        "placement.rollout.resources={host_b: 1}", "placement.reward.resources={host_c: 1}",
    )
    done = hosts.head.run(command, cwd=str(REPO), timeout=300)
    lines = [line for line in done.stderr.splitlines() if line.startswith("rlpipe:")]
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-3000:]
    a, b = hosts.hosts["host_a"].address, hosts.hosts["host_b"].address
    assert lines[0].startswith("rlpipe: config error: sync.transport: shm") and a in lines[0] and b in lines[0]
    assert not (tmp_path / "shm").exists()  # nothing written for a run that never started


def _engine(hosts, unreachable=None) -> tuple[object, int] | tuple[None, None]:
    """The host running the rollout engine and the engine's process id (Ray titles a worker after its actor), not
    counting a host cut off from the network (`unreachable`), whose processes run on unseen."""
    for host in hosts.hosts.values():
        if host is unreachable:
            continue
        for pid in host.processes():
            try:
                if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"ray::RolloutActor"):
                    return host, pid
            except OSError:  # gone meanwhile
                pass
    return None, None


def _generating(pid: int) -> bool:
    try:
        return b"RolloutActor.generate" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _switch_on_every_host(hosts) -> None:
    """Start the Ray node again on any host an earlier test powered off."""
    for name, host in hosts.hosts.items():
        if host.ray is None:
            hosts.start_ray(name, HOSTS[name])


def _start_run(hosts, uninterrupted, model: str, tmp_path: Path, name: str, rollout_resources: str, *extra: str):
    """With every host switched on, start a run in the background: learner ranks and reward worker on host A, the
    engine where `rollout_resources` allow. Returns the uninterrupted run's directory, this run's, the files of the
    driver's stdout and stderr, and the driver."""
    baseline_dir, baseline = uninterrupted
    assert baseline.returncode == 0, "the uninterrupted run failed; see test_roles_run_on_the_hosts_their_placement_names"
    _switch_on_every_host(hosts)
    command = _train_command(
        hosts, tmp_path, model, name, "placement.learner.resources={host_a: 1}",
        f"placement.rollout.resources={rollout_resources}", "placement.reward.resources={host_a: 1}", *extra,
    )
    run_dir, stdout, stderr = tmp_path / name, tmp_path / "driver.stdout", tmp_path / "driver.stderr"
    with open(stdout, "w") as out, open(stderr, "w") as err:
        driver = hosts.head.popen(command, cwd=str(REPO), stdout=out, stderr=err)
    return baseline_dir, run_dir, stdout, stderr, driver


def _lose_the_engines_host_in_step_2(hosts, driver, run_dir: Path, stderr: Path, deadline: float,
                                     how: str = "power_off"):
    """Lose the host running the rollout engine (`how`: power_off or cut, see hosts.Host) as the engine starts
    generating after step 1 was logged; returns that host. Fails if the driver ends or the deadline passes first."""
    lost, pid = None, None
    while lost is None:
        assert driver.poll() is None and time.monotonic() < deadline, stderr.read_text()[-3000:]
        lost, pid = _engine(hosts)
        time.sleep(0.1)
    was_generating = False
    while True:
        assert driver.poll() is None and time.monotonic() < deadline, stderr.read_text()[-3000:]
        generating = _generating(pid)
        if generating and not was_generating and (run_dir / "metrics.jsonl").exists() and _records(run_dir):
            getattr(lost, how)()
            return lost
        was_generating = generating
        time.sleep(0.002)


@pytest.mark.parametrize("how", ["power_off", "cut"])
def test_a_rollout_host_lost_mid_step_moves_its_engine_to_another_host(how, hosts, uninterrupted, tiny_qwen3, tmp_path):
    """The engine's host loses power (every process on it SIGKILLed), or its link (its processes run on, unreachable),
    while the engine generates step 2. The cluster declares the host dead, Ray moves the engine's placement bundle
    to the other host with room for an engine, a new engine starts there with the current weights and generates the
    lost prompts again; the run completes with the same steps, versions and prompts as the uninterrupted run."""
    baseline_dir, run_dir, stdout, stderr, driver = _start_run(
        hosts, uninterrupted, tiny_qwen3, tmp_path, "lost-host", "{rollout_slot: 1}"
    )
    lost = None
    try:
        deadline = time.monotonic() + 300
        lost = _lose_the_engines_host_in_step_2(hosts, driver, run_dir, stderr, deadline, how)
        moved_to = None
        while driver.poll() is None and time.monotonic() < deadline:
            moved_to = moved_to or _engine(hosts, unreachable=lost)[0]
            time.sleep(0.2)
        assert driver.wait(timeout=max(deadline - time.monotonic(), 1)) == 0, stderr.read_text()[-3000:]
    finally:
        if driver.poll() is None:
            driver.kill()
        if how == "cut" and lost is not None:  # the cut host's node, declared dead, goes; the next test restarts it
            lost.mend()
            lost.power_off()
    assert moved_to is not None and moved_to is not lost and "rollout_slot" in hosts.specs[moved_to.name]["resources"]
    assert json.loads((run_dir / "summary.json").read_text())["hosts"]["rollout"] == [lost.address]  # at the start
    notes = [line for line in stdout.read_text().splitlines() if "rollout engine 0 died" in line]
    assert len(notes) == 1 and "restart 1 of at most 3" in notes[0], stdout.read_text()[-3000:]
    records = _check_steps(run_dir)
    restarts = [r["rollout/restarts"] for r in records]
    assert restarts[0] == 0 and restarts[-1] == 1 and sorted(restarts) == restarts  # lost once, after step 1
    # Nothing lost or repeated: each step trained on the prompts the uninterrupted run drew, each a whole group.
    assert _prompts_by_step(run_dir) == _prompts_by_step(baseline_dir)
    assert [r["samples_trained"] for r in records] == [2.0 * GROUP_SIZE] * STEPS


def test_a_rollout_host_lost_with_no_room_elsewhere_is_waited_for_by_auto_resume(hosts, uninterrupted, tiny_qwen3,
                                                                               tmp_path):
    """The engine may only run on host B, which loses power as the engine generates step 2. No live host can take
    the engine, so after ray.placement_timeout_s the run gives up on it in one line; --auto-resume starts again from
    the latest checkpoint and waits for room, which comes back with B's Ray node. Steps, versions and prompts are
    those of the uninterrupted run, each step trained once."""
    baseline_dir, run_dir, stdout, stderr, driver = _start_run(
        hosts, uninterrupted, tiny_qwen3, tmp_path, "no-room", "{host_b: 1}", "train.checkpoint_every=1",
        "ray.placement_timeout_s=45", "train.max_auto_resumes=2", "--auto-resume",
    )
    host_b = hosts.hosts["host_b"]
    try:
        deadline = time.monotonic() + 480
        assert _lose_the_engines_host_in_step_2(hosts, driver, run_dir, stderr, deadline) is host_b
        while "restarting from" not in stderr.read_text():
            assert driver.poll() is None and time.monotonic() < deadline, stderr.read_text()[-3000:]
            time.sleep(0.5)
        assert _engine(hosts) == (None, None)  # nowhere to go while B is off
        hosts.start_ray("host_b", HOSTS["host_b"])
        assert driver.wait(timeout=max(deadline - time.monotonic(), 1)) == 0, stderr.read_text()[-3000:]
    finally:
        if driver.poll() is None:
            driver.kill()
    restarts = [line for line in stderr.read_text().splitlines() if "restarting from" in line]
    assert restarts and "no live node has room" in restarts[0] and "restarting from step_00000" in restarts[0], restarts
    assert all("cannot place" in line for line in restarts[1:])  # B took longer than a placement timeout to return
    assert json.loads((run_dir / "summary.json").read_text())["hosts"]["rollout"] == [host_b.address]
    records = _check_steps(run_dir)
    assert _prompts_by_step(run_dir) == _prompts_by_step(baseline_dir)
    assert [r["samples_trained"] for r in records] == [2.0 * GROUP_SIZE] * STEPS


def test_the_cluster_of_hosts_leaves_nothing_behind(hosts):
    """Last in the module: closing the cluster ends every process on every host and the namespaces with them (the
    bridge, the veth pairs and each private /dev/shm go with their namespaces)."""
    namespaces = set(hosts.namespaces)
    assert any(hosts.hosts[name].processes() for name in hosts.hosts)  # Ray nodes still running until now
    hosts.close()
    assert hosts.leftovers() == []
    assert all(host.holder.poll() is not None for host in hosts.hosts.values())
    assert hosts.sandbox.poll() is not None and len(namespaces) == len(HOSTS) + 1
