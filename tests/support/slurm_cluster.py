"""A real Slurm on this one machine, for the launcher tests: install, start, use, stop.

    cluster = start_cluster(Path("/tmp/slurm"), nodes=4, cpus_per_node=4)
    subprocess.run(["sbatch", "--wait", "job.sbatch"], env=cluster.env())
    cluster.stop()

What it builds (the settings measured in ../shared/notes/slurm-local.md, Slurm 22.05 on Debian 12):
- munged, started as user munge when `munge -n | unmunge` fails (and stopped again by PID
  only if this module started it);
- one slurmctld and one `slurmd -N nX` per virtual node, all on 127.0.0.1 with their own
  ports, every file (slurm.conf, state, spool, logs, pid files) under one directory, so the
  machine's /etc/slurm is never touched and concurrent clusters do not collide;
- `SlurmdParameters=config_overrides` so the virtual nodes may claim more CPUs than exist,
  `ProctrackType=proctrack/linuxproc`, `TaskPlugin=task/none`, no accounting;
- optionally fake GPUs (character devices made with mknod, `GresTypes=gpu`), enough for
  sbatch to accept `--gpus-per-node` requests.

The Debian packages are installed with apt-get when missing; that needs root (CI runs as
root on a fresh machine). Daemons are stopped by the PIDs in their pid files, never by name.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

SLURM_PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
"""Debian packages of a single-machine Slurm (22.05 on Debian 12)."""

MUNGE_RUN_DIR = Path("/run/munge")
MUNGE_PID_FILE = MUNGE_RUN_DIR / "munged.pid"


class SlurmUnavailable(RuntimeError):
    """Slurm cannot be installed or started here; the message says why and what would fix it."""


def _run(cmd: list[str], timeout: float = 60, env: dict | None = None,
         check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if check and done.returncode != 0:
        raise SlurmUnavailable(f"`{' '.join(cmd)}` failed with exit {done.returncode}:\n{done.stdout}{done.stderr}")
    return done


def missing_programs() -> list[str]:
    """Which of the programs a Slurm cluster needs are not on PATH (or in /usr/sbin)."""
    search = os.environ.get("PATH", "") + os.pathsep + "/usr/sbin:/sbin"
    wanted = ("slurmctld", "slurmd", "sbatch", "scontrol", "munged", "munge", "unmunge")
    return [name for name in wanted if shutil.which(name, path=search) is None]


def ensure_installed() -> None:
    """Install the Debian packages when a program is missing (root only).

    `apt-get install` alone first (the package lists of a fresh CI image are usually recent
    enough); if that fails, `apt-get update` and once more."""
    missing = missing_programs()
    if not missing:
        return
    if os.geteuid() != 0:
        raise SlurmUnavailable(
            f"Slurm programs {missing} are missing and installing them needs root: run as root, or "
            f"`sudo apt-get install -y --no-install-recommends {' '.join(SLURM_PACKAGES)}`"
        )
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = ["apt-get", "install", "-y", "--no-install-recommends", *SLURM_PACKAGES]
    if _run(install, timeout=600, env=env, check=False).returncode != 0:
        _run(["apt-get", "update"], timeout=600, env=env)
        _run(install, timeout=600, env=env)
    still = missing_programs()
    if still:
        raise SlurmUnavailable(f"after installing {SLURM_PACKAGES}, {still} are still missing")


def _munge_works() -> bool:
    encode = subprocess.run(["munge", "-n"], capture_output=True, timeout=10)
    if encode.returncode != 0:
        return False
    decode = subprocess.run(["unmunge"], input=encode.stdout, capture_output=True, timeout=10)
    return decode.returncode == 0


def ensure_munge() -> int | None:
    """Start munged (as user munge) unless a working one runs; its PID if started here, else None."""
    if _munge_works():
        return None
    if os.geteuid() != 0:
        raise SlurmUnavailable("munged is not running and starting it needs root")
    _run(["install", "-d", "-o", "munge", "-g", "munge", "-m0755", str(MUNGE_RUN_DIR)])
    _run(["runuser", "-u", "munge", "--", "/usr/sbin/munged"])
    deadline = time.monotonic() + 10
    while not _munge_works():
        if time.monotonic() > deadline:
            raise SlurmUnavailable("munged started but `munge -n | unmunge` still fails")
        time.sleep(0.1)
    return int(MUNGE_PID_FILE.read_text().split()[0])


def _free_port_block(count: int) -> int:
    """The first of `count` consecutive TCP ports that are free on 127.0.0.1 right now."""
    rng_base = 20000 + (os.getpid() * 7919) % 20000
    for base in range(rng_base, 60000 - count, count):
        sockets = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                sockets.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise SlurmUnavailable(f"no block of {count} free ports on 127.0.0.1")


def _alive(pid: int) -> bool:
    """True while `pid` runs (a zombie counts as gone: init reaps daemons here late)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


def stop_pid(pid: int, timeout: float = 15.0) -> None:
    """SIGTERM `pid`, wait for it to end, SIGKILL after `timeout` seconds."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while _alive(pid):
        if time.monotonic() > deadline:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            return
        time.sleep(0.05)


@dataclass
class SlurmCluster:
    """A running single-machine Slurm whose files all live under `root`."""

    root: Path
    """Directory with slurm.conf, state, spool, logs and pid files."""
    node_names: tuple[str, ...]
    """Virtual nodes n1, n2, ...; every one is a slurmd on 127.0.0.1."""
    cpus_per_node: int
    """CPUs each virtual node claims (config_overrides lets it exceed the real cores)."""
    gpus_per_node: int
    """Fake GPUs (mknod character devices) per node; 0 = no gres configured."""
    munge_pid: int | None = None
    """munged's PID if this cluster started it (then stop() stops it too), else None."""
    daemon_pids: list[int] = field(default_factory=list)
    """slurmctld and slurmd PIDs, read from their pid files after start."""

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    def env(self, base: dict | None = None) -> dict:
        """`base` (default os.environ) with SLURM_CONF pointing at this cluster."""
        return dict(base if base is not None else os.environ, SLURM_CONF=str(self.conf))

    def run(self, cmd: list[str], timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
        """Run a Slurm client command against this cluster."""
        return _run(cmd, timeout=timeout, env=self.env(), check=check)

    def jobs_submitted(self) -> int:
        """How many jobs the controller has accepted since it started (sdiag's counter)."""
        out = self.run(["sdiag"]).stdout
        return int(next(line for line in out.splitlines() if line.startswith("Jobs submitted:")).split(":")[1])

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of every daemon log, for failure messages."""
        parts = []
        for log in sorted(self.root.glob("*.log")):
            text = log.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {log.name}\n" + "\n".join(text))
        return "\n".join(parts)

    def stop(self) -> None:
        """Cancel what still runs, then stop the daemons (and munged if started here) by PID."""
        if self.daemon_pids:
            self.run(["scancel", "--full", "--user", str(os.getuid())], check=False)
        for pid in reversed(self.daemon_pids):
            stop_pid(pid)
        self.daemon_pids.clear()
        if self.munge_pid is not None:
            stop_pid(self.munge_pid)
            self.munge_pid = None


def _write_config(cluster: SlurmCluster, ctld_port: int, slurmd_port: int) -> None:
    root, n = cluster.root, len(cluster.node_names)
    gres_lines = []
    node_gres = ""
    if cluster.gpus_per_node:
        # slurmd checks that every gres File exists; a character device with NVIDIA's major
        # number is all it needs. Jobs then see CUDA_VISIBLE_DEVICES.
        devices = root / "dev"
        devices.mkdir(exist_ok=True)
        for i in range(cluster.gpus_per_node):
            path = devices / f"nvidia{i}"
            if not path.exists():
                os.mknod(path, 0o666 | 0o020000, os.makedev(195, i))
        last = cluster.gpus_per_node - 1
        gres_lines.append(f"NodeName=n[1-{n}] Name=gpu File={devices}/nvidia[0-{last}]")
        node_gres = f" Gres=gpu:{cluster.gpus_per_node}"
    (root / "gres.conf").write_text("\n".join(gres_lines) + "\n")
    lines = [
        "ClusterName=launchertest",
        "SlurmctldHost=localhost(127.0.0.1)",
        f"SlurmctldPort={ctld_port}",
        "SlurmUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        "CommunicationParameters=NoInAddrAny,NoCtldInAddrAny",
        f"StateSaveLocation={root}/state",
        f"SlurmdSpoolDir={root}/spool/%n",
        f"SlurmctldPidFile={root}/slurmctld.pid",
        f"SlurmdPidFile={root}/slurmd-%n.pid",
        f"SlurmctldLogFile={root}/slurmctld.log",
        f"SlurmdLogFile={root}/slurmd-%n.log",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "MpiDefault=none",
        "AccountingStorageType=accounting_storage/none",
        "JobAcctGatherType=jobacct_gather/none",
        "JobCompType=jobcomp/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "SchedulerParameters=bf_interval=1",
        "SlurmdParameters=config_overrides",
        "ReturnToService=2",
        # Finished jobs stay known to the controller for 10 s. Also sbatch --wait polls every
        # 2 s, then 8 s, and would grow to 32 s only while below MinJobAge / 2: with the default
        # 300, a 40 s job returned after 74 s here; with 10 it returns within 8 s of its end.
        "MinJobAge=10",
        "KillWait=5",
        "InactiveLimit=0",
        *(["GresTypes=gpu"] if cluster.gpus_per_node else []),
        f"NodeName=n[1-{n}] NodeAddr=127.0.0.1 Port=[{slurmd_port}-{slurmd_port + n - 1}] "
        f"CPUs={cluster.cpus_per_node} RealMemory=4000{node_gres} State=UNKNOWN",
        "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
    ]
    cluster.conf.write_text("\n".join(lines) + "\n")


def start_cluster(root: Path, nodes: int = 4, cpus_per_node: int = 4, gpus_per_node: int = 0) -> SlurmCluster:
    """Install (if needed) and start a Slurm of `nodes` virtual nodes under `root`; wait until idle.

    Raises SlurmUnavailable with the daemon logs if the nodes do not come up in 30 s."""
    ensure_installed()
    root = Path(root)
    for sub in ("state", "spool"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    names = tuple(f"n{i}" for i in range(1, nodes + 1))
    for name in names:
        (root / "spool" / name).mkdir(exist_ok=True)
    cluster = SlurmCluster(root=root, node_names=names, cpus_per_node=cpus_per_node, gpus_per_node=gpus_per_node)
    cluster.munge_pid = ensure_munge()
    base = _free_port_block(nodes + 1)
    _write_config(cluster, ctld_port=base, slurmd_port=base + 1)
    try:
        _run(["slurmctld", "-f", str(cluster.conf), "-i"], env=cluster.env())
        cluster.daemon_pids.append(_read_pid(root / "slurmctld.pid"))
        for name in names:
            _run(["slurmd", "-f", str(cluster.conf), "-N", name], env=cluster.env())
            cluster.daemon_pids.append(_read_pid(root / f"slurmd-{name}.pid"))
        _wait_idle(cluster)
    except SlurmUnavailable as error:
        tail = cluster.log_tail()
        cluster.stop()
        raise SlurmUnavailable(f"{error}\n{tail}") from None
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _read_pid(path: Path, timeout: float = 10.0) -> int:
    """The PID a daemon wrote to `path` (daemons write it shortly after forking)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return int(path.read_text().split()[0])
        except (FileNotFoundError, IndexError, ValueError):
            if time.monotonic() > deadline:
                raise SlurmUnavailable(f"no pid file {path} after {timeout:.0f} s") from None
            time.sleep(0.05)


def _wait_idle(cluster: SlurmCluster, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    states: dict[str, str] = {}
    while time.monotonic() < deadline:
        done = cluster.run(["sinfo", "-h", "-N", "-o", "%N %T"], check=False)
        states = dict(line.split() for line in done.stdout.splitlines() if line.strip())
        if done.returncode == 0 and set(states) == set(cluster.node_names) and all(
            s == "idle" for s in states.values()
        ):
            return
        time.sleep(0.2)
    raise SlurmUnavailable(f"nodes not idle after {timeout:.0f} s: {states}")
