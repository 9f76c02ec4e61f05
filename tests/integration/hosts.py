"""A cluster of hosts on one machine, for tests that need roles on different hosts (a TPU deployment puts learner
and rollout on different VMs).

Each host is a Linux network namespace with an address of its own (10.231.0.x; a veth pair onto a bridge that
lives in a sandbox namespace of the test's, so nothing reaches outside) and a mount namespace with a private
tmpfs on /dev/shm: hosts share neither network nor shared memory, as real hosts. A `sleep` process holds each
namespace; commands enter it with nsenter. Each host runs one Ray node (`ray start`, token authentication on)
that advertises the host's name as a custom resource, with a Ray temp dir of its own. As root the namespaces are
the machine's own kinds; otherwise the sandbox is a user namespace that maps the caller to root.

`HostCluster.close()` leaves no process, namespace or interface behind; `leftovers()` says what remains.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from functools import cache
from pathlib import Path

PYTHON_BIN = Path(sys.executable).parent
SUBNET = "10.231.0"
RAY_PORT = 6379  # every host has its own network, so Ray's default ports never meet another cluster's
# Health checks every second, dead after 3 missed: a lost host is noticed in seconds rather than half a minute.
FAST_FAILURE_DETECTION = {
    "RAY_health_check_initial_delay_ms": "1000",
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "1000",
    "RAY_health_check_failure_threshold": "3",
}


class HostsUnavailable(RuntimeError):
    """This machine does not let the tests make namespaces (no root and no user namespaces, or a seccomp filter)."""


def _user_namespace() -> list[str]:
    return [] if os.geteuid() == 0 else ["--user", "--map-root-user"]


@cache
def unavailable() -> str | None:
    """Why this machine cannot hold a cluster of hosts, or None if it can (probed once)."""
    for tool in ("unshare", "nsenter", "ip"):
        if shutil.which(tool) is None and not Path("/usr/sbin", tool).exists():
            return f"{tool} not found"
    probe = [
        "unshare", *_user_namespace(), "--net", "--mount", "--propagation", "private",
        "sh", "-c", "mount -t tmpfs tmpfs /dev/shm && ip link add rlpipe-probe type bridge",
    ]
    try:
        done = subprocess.run(probe, capture_output=True, text=True, timeout=30, env=_tool_env())
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"cannot make a network namespace: {err}"
    if done.returncode != 0:
        return f"cannot make a network namespace with a bridge and a private /dev/shm: {done.stderr.strip()}"
    return None


def _tool_env() -> dict[str, str]:
    """`ip` lives in /usr/sbin, which a non-root PATH may leave out."""
    from tests.integration.conftest import node_environment

    return {**node_environment(), "PATH": f"{os.environ.get('PATH', '')}{os.pathsep}/usr/sbin{os.pathsep}/sbin"}


def _holder(command: list[str], env: dict[str, str]) -> subprocess.Popen:
    """A process that holds new namespaces open: it ends in `sleep`, once the namespaces are set up."""
    holder = subprocess.Popen(command, env=env, start_new_session=True, stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if holder.poll() is not None:
            raise HostsUnavailable(f"namespace holder exited {holder.returncode}: {holder.stderr.read().decode().strip()}")
        try:
            if Path(f"/proc/{holder.pid}/comm").read_text().strip() == "sleep":
                return holder
        except FileNotFoundError:
            pass
        time.sleep(0.02)
    holder.kill()
    raise HostsUnavailable("namespace holder did not come up within 30 s")


def _namespace_inode(pid: int, kind: str = "net") -> str:
    return os.readlink(f"/proc/{pid}/ns/{kind}")


def processes_in(namespace: str) -> list[int]:
    """Every process of this machine whose network namespace is `namespace` (as /proc/PID/ns/net reads)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.readlink(f"/proc/{entry}/ns/net") == namespace:
                    found.append(int(entry))
            except OSError:  # gone meanwhile, or not ours to read
                pass
    return found


def _held_open(namespaces: set[str]) -> list[str]:
    """Open file descriptors anywhere on the machine that keep one of `namespaces` alive."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fds = os.listdir(f"/proc/{entry}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{entry}/fd/{fd}") in namespaces:
                    found.append(f"pid {entry} fd {fd}")
            except OSError:
                pass
    return found


class Host:
    """One host: its namespaces' holder, its address, and the Ray node it runs (if started)."""

    def __init__(self, cluster: HostCluster, name: str, index: int):
        self.cluster, self.name = cluster, name
        self.address = f"{SUBNET}.{index + 1}"
        self.link = f"v{index}-{cluster.tag}"  # the bridge's end of the host's cable, in the sandbox
        self.temp_dir = cluster.base / name
        self.temp_dir.mkdir()
        # A private /dev/shm of `shm_mb`: Ray's object store and the shared-memory weight sync live there.
        setup = f"mount -t tmpfs -o size={cluster.shm_mb}m tmpfs /dev/shm && exec sleep infinity"
        self.holder = _holder(
            [*cluster.enter_sandbox(net=False), "unshare", "--net", "--mount", "--propagation", "private",
             "sh", "-c", setup],
            cluster.tool_env,
        )
        self.namespace = _namespace_inode(self.holder.pid)
        self.ray: subprocess.Popen | None = None
        cluster.in_sandbox(f"ip link add {self.link} type veth peer name eth0 netns {self.holder.pid}")
        cluster.in_sandbox(f"ip link set {self.link} master br0 up")
        self.run(["sh", "-c", f"ip link set lo up && ip addr add {self.address}/24 dev eth0 && ip link set eth0 up"],
                 check=True)

    def command(self, argv: list[str], cwd: str | None = None) -> list[str]:
        """`argv` run inside this host's namespaces, in `cwd` (default: this process's working directory)."""
        pid = self.holder.pid
        return [
            "nsenter", *self.cluster.user_ns(), f"--net=/proc/{pid}/ns/net", f"--mount=/proc/{pid}/ns/mnt",
            f"--wd={cwd or os.getcwd()}", *argv,
        ]

    def run(self, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
        kwargs.setdefault("env", self.cluster.env)
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        return subprocess.run(self.command(argv, kwargs.pop("cwd", None)), **kwargs)

    def popen(self, argv: list[str], **kwargs) -> subprocess.Popen:
        kwargs.setdefault("env", self.cluster.env)
        return subprocess.Popen(self.command(argv, kwargs.pop("cwd", None)), start_new_session=True, **kwargs)

    def processes(self) -> list[int]:
        """Every process on this host but the namespace holder."""
        return [pid for pid in processes_in(self.namespace) if pid != self.holder.pid]

    def power_off(self) -> None:
        """SIGKILL every process on this host, the Ray node's among them, as a host that loses power."""
        for _ in range(3):  # a process may fork while its siblings die
            for pid in self.processes():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        if self.ray is not None:
            self.ray.wait(timeout=30)
            self.ray = None

    def cut(self) -> None:
        """Pull the host's cable: its bridge end goes down; the processes keep running, unreachable."""
        self.cluster.in_sandbox(f"ip link set {self.link} down")

    def mend(self) -> None:
        self.cluster.in_sandbox(f"ip link set {self.link} up")


class HostCluster:
    """Hosts in namespaces, the first of them the Ray head once `start_ray` runs on it.

    `hosts`: name -> {"cpus": logical CPUs of its Ray node, "resources": its custom resources}; a host whose spec is
    None gets no Ray node until `start_ray(name)` is called (a host that joins later).
    """

    def __init__(self, hosts: dict[str, dict | None], shm_mb: int = 1024, object_store_mb: int = 256,
                 env: dict[str, str] | None = None):
        reason = unavailable()
        if reason:
            raise HostsUnavailable(reason)
        self.tag = secrets.token_hex(3)
        self.base = Path(tempfile.mkdtemp(prefix=f"rlh-{self.tag}-"))  # short: Ray's socket paths have a limit
        self.shm_mb, self.object_store_mb = shm_mb, object_store_mb
        self.tool_env = _tool_env()
        self.token = secrets.token_hex(16)
        # The environment of an activated virtual environment, so Ray's processes find the same `python`.
        self.env = {
            **self.tool_env, **FAST_FAILURE_DETECTION, **(env or {}), "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": self.token, "PATH": f"{PYTHON_BIN}{os.pathsep}{self.tool_env['PATH']}",
        }
        self.specs = dict(hosts)
        self.hosts: dict[str, Host] = {}
        self.namespaces: set[str] = set()
        self.sandbox = _holder(["unshare", *_user_namespace(), "--net", "sleep", "infinity"], self.tool_env)
        self.namespaces.add(_namespace_inode(self.sandbox.pid))
        try:
            self.in_sandbox("ip link set lo up && ip link add br0 type bridge && ip link set br0 up")
            for index, name in enumerate(hosts):
                host = self.hosts[name] = Host(self, name, index)
                self.namespaces.add(host.namespace)
            for name, spec in hosts.items():
                if spec is not None:
                    self.start_ray(name)
        except BaseException:
            self.close()
            raise

    @property
    def head(self) -> Host:
        return next(iter(self.hosts.values()))

    @property
    def address(self) -> str:
        """The Ray cluster's address, for `ray.address=` (reachable from inside the hosts only)."""
        return f"{self.head.address}:{RAY_PORT}"

    def user_ns(self) -> list[str]:
        """nsenter's arguments that join the sandbox's user namespace (as non-root only)."""
        # Its map makes the caller root inside; keep the credentials (setgroups is denied there).
        return [] if os.geteuid() == 0 else [f"--user=/proc/{self.sandbox.pid}/ns/user", "--preserve-credentials"]

    def enter_sandbox(self, net: bool = True) -> list[str]:
        """The command prefix that runs in the sandbox's namespaces (without `net`: its user namespace only)."""
        namespaces = [*self.user_ns(), *([f"--net=/proc/{self.sandbox.pid}/ns/net"] if net else [])]
        return ["nsenter", *namespaces] if namespaces else []

    def in_sandbox(self, script: str) -> None:
        done = subprocess.run([*self.enter_sandbox(), "sh", "-c", script], env=self.tool_env, capture_output=True,
                              text=True, timeout=30)
        if done.returncode != 0:
            raise HostsUnavailable(f"{script}: {done.stderr.strip()}")

    def start_ray(self, name: str, spec: dict | None = None, timeout_s: float = 120.0) -> None:
        """Start host `name`'s Ray node (the head on the first host) and wait until the cluster lists it."""
        host = self.hosts[name]
        spec = spec or self.specs[name] or {}
        self.specs[name] = spec
        arguments = [
            str(PYTHON_BIN / "ray"), "start", "--block", f"--node-ip-address={host.address}",
            f"--num-cpus={spec.get('cpus', 1)}", f"--resources={json.dumps(spec.get('resources', {}))}",
            f"--temp-dir={host.temp_dir}", f"--object-store-memory={self.object_store_mb * 2**20}",
            "--disable-usage-stats",
        ]
        if host is self.head:
            arguments += ["--head", f"--port={RAY_PORT}", "--include-dashboard=false"]
        else:
            arguments += [f"--address={self.address}"]
        with open(host.temp_dir / "ray-start.log", "ab") as log:
            host.ray = host.popen(arguments, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if host.ray.poll() is not None:
                raise RuntimeError(f"`ray start` on {name} exited {host.ray.returncode}: "
                                   + (host.temp_dir / "ray-start.log").read_text()[-2000:])
            if any(node["address"] == host.address for node in self.nodes(quick=True)):
                return
            time.sleep(0.5)
        raise RuntimeError(f"the Ray node of {name} did not join within {timeout_s:g} s")

    def nodes(self, quick: bool = False) -> list[dict]:
        """The cluster's live nodes as the head's GCS lists them: {"id", "address", "resources"}."""
        script = (
            "import json, sys\n"
            "from ray._raylet import GcsClient\n"
            "try:\n"
            f"    infos = GcsClient(address={self.address!r}).get_all_node_info(timeout=5).values()\n"
            "except Exception:\n"
            "    print('[]'); sys.exit()\n"
            "print(json.dumps([{'id': i.node_id.hex(), 'address': i.node_manager_address,"
            " 'resources': dict(i.resources_total)} for i in infos if i.state == 0]))\n"
        )
        done = self.head.run([sys.executable, "-c", script], timeout=60)
        if done.returncode != 0:
            if quick:
                return []
            raise RuntimeError(f"cannot list the cluster's nodes: {done.stderr.strip()[-2000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])

    def close(self) -> None:
        """Stop every process on every host, then the namespaces' holders; remove the Ray temp dirs."""
        for host in self.hosts.values():
            host.power_off()
        for holder in [*(host.holder for host in self.hosts.values()), getattr(self, "sandbox", None)]:
            if holder is not None and holder.poll() is None:
                holder.kill()
                holder.wait(timeout=30)
        shutil.rmtree(self.base, ignore_errors=True)

    def leftovers(self) -> list[str]:
        """What of this cluster still exists: processes in its namespaces, open handles on them, its interfaces in
        this namespace, its temp dir. Empty after `close()`."""
        found = [f"process {pid} in {ns}" for ns in self.namespaces for pid in processes_in(ns)]
        found += _held_open(self.namespaces)
        links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, env=self.tool_env).stdout
        found += [f"interface {line.split(':')[1].strip()}" for line in links.splitlines() if self.tag in line]
        if self.base.exists():
            found.append(f"directory {self.base}")
        return found
