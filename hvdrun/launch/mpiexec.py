"""Start every rank with one ``mpiexec``: MPICH hydra, Open MPI (PRRTE) or Cray PALS.

hvdrun runs ``mpiexec`` under its guard (so ``kill -9`` of hvdrun still stops the job) with the
same hosts, rank order and environment contract as its other launchers. mpiexec starts
``python -m hvdrun.launch.remote.mpirank`` on every rank, which computes that rank's slot (GPU pinning
included) and tags its output, so hvdrun splits mpiexec's merged output back into ranks and
names the rank that failed first. SSH, where mpiexec uses it, goes through a wrapper that
applies hvdrun's SSH options (port, key, known_hosts; host keys always verified).

The flavour comes from ``mpiexec --version`` unless ``--mpi-flavour`` names it; for Open MPI the same output
gives the version, which decides the spelling of its options (Open MPI 4's ``mpirun`` refuses the PRRTE
``--prtemca`` that Open MPI 5 takes).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from hvdrun import envvars
from hvdrun.errors import LaunchError, UsageError
from hvdrun.hosts import Host, is_local_host
from hvdrun.launch.launcher import Endpoint, Launcher, Worker, WorkerSpec
from hvdrun.launch.local import LOOPBACK, LocalLauncher, LocalWorker
from hvdrun.launch.output import OutputRouter
from hvdrun.launch.pals_faults import PalsLines, SickNode, job_host
from hvdrun.launch.remote.connections import SshOptions
from hvdrun.launch.remote.cpubind import parse_cpu_bind
from hvdrun.launch.remote.hostfacts import free_ports, interface_address, route_source_address
from hvdrun.launch.remote.mpirank import plan_value
from hvdrun.launch.stage_tree import ProcessRelays, RelayStarter, relay_command
from hvdrun.ranks import GpuLayout, Slot

FLAVOURS = ("mpich", "openmpi", "pals")
SRUN = "srun"  # Slurm's srun starts the ranks inside an allocation: one more flavour of "one command, all ranks"
RELAY_RANK = {"mpich": "PMI_RANK", "openmpi": "OMPI_COMM_WORLD_RANK", "pals": "PALS_RANKID", SRUN: "SLURM_PROCID"}
# (the variable each launcher puts a process's rank in: a staging relay's host, launch/stage_tree.py)


_OPEN_MPI_VERSION_RE = re.compile(r"\((?:open mpi|openrte)\)\s+v?(\d+)\.", re.IGNORECASE)


def openmpi_major(version_text: str) -> int | None:
    """Open MPI's major version from ``mpirun --version`` (``mpirun (Open MPI) 4.1.5`` -> 4); PRRTE's own
    ``prterun`` counts as Open MPI 5, whose launcher it is. None when the text names neither."""
    match = _OPEN_MPI_VERSION_RE.search(version_text)
    if match:
        return int(match.group(1))
    return 5 if "prrte" in version_text.lower() else None


def detect_flavour(version_text: str) -> str | None:
    """The flavour of an ``mpiexec --version`` output, or None when it is none we know."""
    text = version_text.lower()
    if "pals" in text:
        return "pals"
    if "open mpi" in text or "prrte" in text or "openrte" in text:
        return "openmpi"
    if "hydra" in text or "mpich" in text:
        return "mpich"
    return None


@dataclass(frozen=True)
class MpiexecCommand:
    """Everything one ``mpiexec`` line is built from.

    Attributes:
        flavour: mpich, openmpi or pals.
        mpiexec: path of the program.
        hosts: the hosts in rank order, each with the number of ranks it runs.
        env: variables every rank gets (the rank-independent contract, config env, ``-x``). The secret
            (``HVDRUN_SECRET``) among them never goes on the command line, where ``ps`` shows it to
            every user of the node: mpiexec gets it in its own environment and passes it on by name.
        rank_command: what mpiexec starts per rank (the shim and the user's command).
        ssh_agent: the SSH wrapper mpiexec should use, or None for its default.
        callback_addr: this machine's address as the hosts reach it (hydra's ``-localhost``).
        hostfile: PALS: a file listing the hosts, one per line; srun: one line per rank
            (``SLURM_HOSTFILE`` with ``--distribution=arbitrary`` places rank i on line i's host).
        extra_args: ``--mpi-args``, inserted before the command.
        cpu_bind: ``--cpu-bind``: PALS and srun bind ``numa`` and ``list:`` themselves (and get an
            explicit ``none`` otherwise, so that their own default binding cannot shrink what hvdrun's
            guard splits for ``cores``); hydra and Open MPI (``--bind-to none``) leave it to the guard.
    """

    flavour: str
    mpiexec: str
    hosts: tuple[Host, ...]
    env: Mapping[str, str]
    rank_command: tuple[str, ...]
    ssh_agent: str | None = None
    callback_addr: str | None = None
    hostfile: str | None = None
    extra_args: tuple[str, ...] = ()
    cpu_bind: str = "none"
    gpu_bind: str | None = None  # PALS ``--gpu-bind list:...`` when the cluster lets the launcher pin GPUs
    openmpi_major: int | None = None  # Open MPI's major version (None: 5 and later, PRRTE's spellings)

    @property
    def num_proc(self) -> int:
        """Total ranks."""
        return sum(host.slots for host in self.hosts)

    def argv(self) -> list[str]:
        """The ``mpiexec`` command line for this flavour."""
        build = {"mpich": self._mpich, "openmpi": self._openmpi, "pals": self._pals, SRUN: self._srun}[self.flavour]
        return [self.mpiexec, *build(), *self.extra_args, *self.rank_command]

    def process_env(self, base: Mapping[str, str]) -> dict[str, str]:
        """The environment mpiexec itself runs with: the secret, and for srun (which passes its own
        environment to every rank) every variable of the job."""
        hidden = {name: value for name, value in self.env.items() if name in envvars.OFF_THE_COMMAND_LINE}
        if self.flavour != SRUN:
            return {**base, **hidden}
        return {**base, **self.env, **({envvars.SLURM_HOSTFILE: self.hostfile} if self.hostfile else {})}

    def _shown_env(self) -> list[tuple[str, str]]:
        """The variables passed by value on the command line (all but the secret), sorted."""
        return sorted((name, value) for name, value in self.env.items() if name not in envvars.OFF_THE_COMMAND_LINE)

    def _hidden_names(self) -> list[str]:
        return sorted(name for name in self.env if name in envvars.OFF_THE_COMMAND_LINE)

    def _srun(self) -> list[str]:
        return [f"--nodes={len(self.hosts)}", f"--ntasks={self.num_proc}", "--distribution=arbitrary",
                "--kill-on-bad-exit=1", "--export=ALL", f"--cpu-bind={self._srun_cpu_bind()}"]

    def _srun_cpu_bind(self) -> str:
        bind = parse_cpu_bind(self.cpu_bind)
        if bind.policy == "numa":
            return "ldoms"
        if bind.policy == "list":
            return "mask_cpu:" + ",".join(hex(sum(1 << core for core in cores)) for cores in bind.lists)
        return "none"

    def _pals_cpu_bind(self) -> list[str]:
        """PALS's binding flags: ``numa`` and ``list:`` as they are, ``depth:D`` as ALCF writes it
        (``--depth=D --cpu-bind depth``), and ``none`` for what the guard binds itself."""
        bind = parse_cpu_bind(self.cpu_bind)
        if bind.policy == "depth":
            return [f"--depth={bind.depth}", "--cpu-bind", "depth"]
        return ["--cpu-bind", self.cpu_bind if bind.policy in ("numa", "list") else "none"]

    def launcher_binds(self) -> bool:
        """Whether this flavour's own launcher applies ``cpu_bind`` (the guard then must not)."""
        binds_itself = {"pals": ("numa", "list", "depth"), SRUN: ("numa", "list")}.get(self.flavour, ())
        return parse_cpu_bind(self.cpu_bind).policy in binds_itself

    def _host_slots(self) -> str:
        return ",".join(f"{host.name}:{host.slots}" for host in self.hosts)

    def _mpich(self) -> list[str]:
        args = ["-n", str(self.num_proc), "-hosts", self._host_slots()]
        if self.ssh_agent:
            args += ["-launcher", "ssh", "-launcher-exec", self.ssh_agent]
        if self.callback_addr:
            args += ["-localhost", self.callback_addr]
        hidden = ["-genvall"] if self._hidden_names() else []  # hydra's -genvlist loses them on remote hosts
        return args + hidden + [word for name, value in self._shown_env() for word in ("-genv", name, value)]

    def _openmpi(self) -> list[str]:
        args = ["-n", str(self.num_proc), "--host", self._host_slots(), "--map-by", "slot", "--bind-to", "none"]
        if os.geteuid() == 0:
            args.append("--allow-run-as-root")
        if self.ssh_agent:
            args += self._openmpi_agent(self.ssh_agent)
        hidden = [word for name in self._hidden_names() for word in ("-x", name)]  # -x NAME: from the environment
        return args + hidden + [word for name, value in self._shown_env() for word in ("-x", f"{name}={value}")]

    def _openmpi_agent(self, agent: str) -> list[str]:
        """The SSH wrapper ``agent``, as this Open MPI spells it: ORTE's ``--mca plm_rsh_agent`` up to Open MPI 4,
        PRRTE's ``--prtemca plm_ssh_agent`` from Open MPI 5 on (each refuses the other's)."""
        if self.openmpi_major is not None and self.openmpi_major < 5:
            return ["--mca", "plm_rsh_agent", agent]
        return ["--prtemca", "plm_ssh_agent", agent]

    def _pals(self) -> list[str]:
        per_host = {host.slots for host in self.hosts}
        if len(per_host) != 1:
            listed = ",".join(f"{h.name}:{h.slots}" for h in self.hosts)
            raise UsageError(f"Cray PALS mpiexec runs the same number of ranks on every host (--ppn); the ranks "
                             f"fall unevenly on {listed}: give -np a multiple of the slots per host")
        args = ["--np", str(self.num_proc), "--ppn", str(per_host.pop()), *self._pals_cpu_bind(), "--envall",
                "--line-buffer"]
        if self.gpu_bind:
            args += ["--gpu-bind", self.gpu_bind]
        if self.hostfile:
            args += ["--hostfile", self.hostfile]
        return args + [word for name, value in self._shown_env() for word in ("--env", f"{name}={value}")]  # --envall


def ssh_agent_script(options: SshOptions) -> str:
    """A ``/bin/sh`` wrapper around OpenSSH's ``ssh`` that applies hvdrun's SSH options."""
    words = ["ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes",
             "-o", f"UserKnownHostsFile={options.known_hosts_path}"]
    if options.port or options.default_port:
        words += ["-p", str(options.port or options.default_port)]
    if options.identity_file:
        words += ["-i", options.identity_file]
    return f'#!/bin/sh\nexec {shlex.join(words)} "$@"\n'


def find_srun() -> str:
    """Slurm's ``srun``; only inside an allocation (``sbatch``/``salloc``) can it start ranks."""
    found = shutil.which("srun")
    if not found:
        raise LaunchError("srun not found on PATH: --launcher srun runs inside a Slurm allocation")
    if not os.environ.get(envvars.SLURM_JOB_ID):
        raise LaunchError("--launcher srun needs a Slurm allocation (SLURM_JOB_ID is not set): run hvdrun in a "
                          "job script ('hvdrun qsub --cluster slurm') or under salloc")
    return found


def find_mpiexec() -> str:
    """``$HVDRUN_MPIEXEC``, else ``mpiexec`` beside this Python (a virtualenv's, e.g. the mpich wheel's),
    else on PATH."""
    chosen = os.environ.get(envvars.MPIEXEC)
    if chosen:
        if not shutil.which(chosen):
            raise LaunchError(f"{envvars.MPIEXEC}={chosen!r} is not an executable program")
        return chosen
    beside = Path(sys.executable).parent / "mpiexec"
    found = str(beside) if beside.is_file() else shutil.which("mpiexec")
    if not found:
        raise LaunchError(f"mpiexec not found beside {sys.executable} or on PATH; load your MPI module "
                          "(or pip install mpich) or use --launcher ssh")
    return found


class MpiexecWorker(LocalWorker):
    """The whole job as one mpiexec; reports the first rank that failed as the failure.

    mpiexec does not always stop the job when a rank exits non-zero (hydra waits for the others),
    so as soon as a rank's shim reports a failure, the worker stops mpiexec: SIGTERM, which
    mpiexec passes to every rank, then SIGKILL after the grace period.
    """

    def __init__(self, slots: Sequence[Slot], process: subprocess.Popen[bytes], grace_s: float) -> None:
        super().__init__(slots[0], process)
        self.slots, self.grace_s = list(slots), grace_s
        self.exits: list[tuple[int, int]] = []
        self.output_done = threading.Event()
        self._note = ""
        self._host_known = True
        self._stopping_since: float | None = None
        self._pals = PalsLines()
        self._lines_lock = threading.Lock()  # stdout's and stderr's pumps both read mpiexec's own lines

    def record_exit(self, rank: int, code: int) -> None:
        """A rank's shim reported its exit status."""
        self.exits.append((rank, code))

    def read_own_line(self, line: bytes) -> None:
        """One of mpiexec's own lines (not a rank's): where PALS names a node it could not reach, that node is the
        failure's host (:mod:`hvdrun.launch.pals_faults`)."""
        with self._lines_lock:
            self._pals.feed(line.decode(errors="replace"))

    def _first_failure(self) -> tuple[int, int] | None:
        return next(((rank, code) for rank, code in self.exits if code != 0), None)

    def poll(self) -> int | None:
        status = self.process.poll()
        if status is None:
            self._stop_after_failure()
            return None
        if status == 0:
            return 0
        self.output_done.wait(5.0)  # the shims' exit reports arrive on mpiexec's stdout
        sick = self._pals.sick
        if sick is not None:  # the node PALS could not reach, whatever the ranks died of meanwhile
            return self._blame(sick, status)
        failed = self._first_failure()
        if failed is None:
            self._note, self._host_known = f"made mpiexec exit with code {status} (see mpiexec's messages above)", False
            return status
        self.slot = self.slots[failed[0]]
        return failed[1]

    def _blame(self, sick: SickNode, status: int) -> int:
        """The failure is the node PALS could not reach: a rank of that host, where it is one of the job's."""
        host = job_host(sick.name, [slot.hostname for slot in self.slots])
        self.slot = next((slot for slot in self.slots if slot.hostname == host), self.slot)
        self._note, self._host_known = f"made mpiexec exit with code {status}: {sick.describe()}", host is not None
        return status

    def _stop_after_failure(self) -> None:
        if self._first_failure() is None:
            return
        now = time.monotonic()
        if self._stopping_since is None:
            self._stopping_since = now
            self.signal_group(signal.SIGTERM)
        elif now - self._stopping_since > self.grace_s:
            self.signal_group(signal.SIGKILL)

    def failure_note(self) -> str:
        return self._note

    def forward_signal(self, signum: int) -> bool:
        """Not through mpiexec: MPICH's hydra dies of SIGUSR1 instead of passing it on. The group passes
        it through the job's control connections instead (:meth:`WorkerGroup` ``signal_ranks``)."""
        return False

    def knows_failed_host(self) -> bool:
        return self._host_known  # False: mpiexec itself failed and nothing named the host


class MpiexecLauncher(Launcher):
    """Runs the job as one ``mpiexec`` (see the module docstring).

    Args:
        grace_s: seconds between SIGTERM and SIGKILL.
        ssh: SSH options for the wrapper mpiexec uses to reach hosts.
        layout: the GPU layout the shims pin by.
        flavour: mpich, openmpi or pals; None detects it.
        network_interface: advertise this interface's address.
        extra_args: ``--mpi-args``.
    """

    def __init__(self, grace_s: float, ssh: SshOptions, layout: GpuLayout, flavour: str | None = None,
                 network_interface: str | None = None, extra_args: Sequence[str] = ()) -> None:
        super().__init__(grace_s)
        self.ssh, self.layout, self.flavour = ssh, layout, flavour
        self.network_interface, self.extra_args = network_interface, tuple(extra_args)
        self.mpiexec = ""
        self._local = LocalLauncher(grace_s)
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._hosts: tuple[Host, ...] = ()
        self._callback_addr: str | None = None
        self._version_text = ""

    def prepare(self, slots: Sequence[Slot], deadline: float) -> None:
        self.mpiexec = find_srun() if self.flavour == SRUN else find_mpiexec()
        if self.flavour in (None, "openmpi"):  # Open MPI's version decides its options' spelling
            self._version_text = self._version_output(required=self.flavour is None)
        self.flavour = self.flavour or self._detect(self._version_text)
        counts = Counter(slot.host for slot in slots)
        self._hosts = tuple(Host(host.name, count, host.user) for host, count in counts.items())
        remote = [host for host in self._hosts if not is_local_host(host.name)]
        if remote:
            self._callback_addr = self._local_address(remote[0])
        self._tmp = tempfile.TemporaryDirectory(prefix="hvdrun-mpiexec-")

    def _version_output(self, required: bool) -> str:
        """``mpiexec --version``'s output; '' when it cannot run and the flavour is known (not ``required``)."""
        try:
            done = subprocess.run([self.mpiexec, "--version"], capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired) as e:
            if not required:
                return ""
            raise LaunchError(f"cannot run '{self.mpiexec} --version': {e}") from e
        return done.stdout + done.stderr

    def _detect(self, version_text: str) -> str:
        flavour = detect_flavour(version_text)
        if flavour is None:
            raise LaunchError(f"cannot tell which MPI '{self.mpiexec}' belongs to from its --version output; "
                              f"name it with --mpi-flavour {{{','.join(FLAVOURS)}}}")
        return flavour

    def _local_address(self, towards: Host) -> str:
        if self.network_interface:
            addr = interface_address(self.network_interface)
            if addr is None:
                raise LaunchError(f"this machine has no IPv4 address on network interface '{self.network_interface}' "
                                  "(--network-interface, else the cluster file's network_interface); name one it "
                                  "has with --network-interface")
            return addr
        return route_source_address(towards.name)

    def is_remote(self, host: Host) -> bool:
        """Every host, this machine too, stages through the tree: one ``mpiexec`` starts every host's relay."""
        return True

    def callback_address(self, hosts: Sequence[Host]) -> str:
        """This machine's address as the hosts reach it (loopback when every host is this machine)."""
        return self._callback_addr or LOOPBACK

    def relays(self, hosts: Sequence[tuple[Host, str]], directory: str) -> RelayStarter:
        """One ``mpiexec`` that starts the staging relay on each of ``hosts`` (one process a host, in this order)."""
        return ProcessRelays(lambda addr, port, token: self._relay_command(hosts, directory, addr, port, token))

    def _relay_command(self, hosts: Sequence[tuple[Host, str]], directory: str, addr: str, port: int,
                       token: str) -> tuple[list[str], dict[str, str]]:
        """One process a host, each knowing its host by the rank its launcher gives it (``RELAY_RANK``)."""
        assert self.flavour is not None
        relay_hosts = tuple(Host(host.name, 1, host.user) for host, _ in hosts)
        agent, hostfile = self._launch_files(relay_hosts, "relay-hostfile")
        index = f"env:{RELAY_RANK[self.flavour]}"
        command = MpiexecCommand(self.flavour, self.mpiexec, relay_hosts, {envvars.STAGE_TOKEN: token},
                                 tuple(relay_command(hosts[0][1], addr, port, index, directory)), agent,
                                 self._callback_addr, hostfile, self.extra_args,
                                 openmpi_major=openmpi_major(self._version_text) if self.flavour == "openmpi" else None)
        return command.argv(), command.process_env(os.environ)

    def _launch_files(self, hosts: Sequence[Host], hostfile_name: str) -> tuple[str, str]:
        """The SSH wrapper mpiexec uses, and a hostfile of ``hosts`` (srun: a line a rank), in this job's temporary
        directory."""
        assert self._tmp is not None
        agent = Path(self._tmp.name) / "ssh"
        agent.write_text(ssh_agent_script(self.ssh))
        agent.chmod(0o700)
        hostfile = Path(self._tmp.name) / hostfile_name
        per_rank = self.flavour == SRUN  # srun --distribution=arbitrary: one line per rank
        hostfile.write_text("".join(f"{host.name}\n" * (host.slots if per_rank else 1) for host in hosts))
        return str(agent), str(hostfile)

    def endpoint(self, host: Host) -> Endpoint:
        if is_local_host(host.name):
            return Endpoint(self._callback_addr or LOOPBACK, *free_ports(2))
        return Endpoint(host.name, *free_ports(2))  # rank 0 listens on every interface of its host

    def start(self, spec: WorkerSpec, router: OutputRouter) -> Worker:
        raise NotImplementedError("mpiexec starts every rank at once: use start_all")

    def start_all(self, specs: Sequence[WorkerSpec], router: OutputRouter) -> Iterator[Worker]:
        command = self.command(specs)
        first = specs[0]
        assert self._tmp is not None
        process = self._local.spawn(WorkerSpec(first.slot, tuple(command.argv()), command.process_env(os.environ),
                                               first.cwd), remove=[self._tmp.name])  # even if hvdrun is killed
        worker = MpiexecWorker([spec.slot for spec in specs], process, self.grace_s)
        assert process.stdout is not None and process.stderr is not None
        stdout = router.attach_multiplexed("stdout", os.dup(process.stdout.fileno()), worker.record_exit,
                                           worker.read_own_line)
        router.attach_multiplexed("stderr", os.dup(process.stderr.fileno()), worker.record_exit, worker.read_own_line)
        threading.Thread(target=_set_when_done, args=(stdout, worker.output_done), daemon=True).start()
        process.stdout.close()
        process.stderr.close()
        yield worker

    def command(self, specs: Sequence[WorkerSpec]) -> MpiexecCommand:
        """The mpiexec command for the job whose ranks are ``specs``."""
        assert self._tmp is not None and self.flavour is not None
        first = specs[0]
        gpu_bind = self._launcher_gpu_bind()
        shim_layout = replace(self.layout, gpus_per_node=0) if gpu_bind else self.layout  # PALS pins, not the shim
        env = {**envvars.job_env(envvars.rendezvous_of(first.env)), **_additions(first.env),
               envvars.MPI_PLAN: plan_value(list(self._hosts), len(specs), shim_layout)}
        if gpu_bind and self.layout.hierarchy():  # PALS parses tiles only as GPU.tile ids, which need COMPOSITE
            env[envvars.ZE_FLAT_DEVICE_HIERARCHY] = "COMPOSITE"
        agent, hostfile = self._launch_files(self._hosts, "hostfile")
        rank_command = (first.python, "-m", "hvdrun.launch.remote.mpirank", f"{self.grace_s:g}", "--", *first.argv)
        command = MpiexecCommand(self.flavour, self.mpiexec, self._hosts, env, rank_command, agent,
                                 self._callback_addr, hostfile, self.extra_args,
                                 first.env.get(envvars.CPU_BIND, "none"), gpu_bind,
                                 openmpi_major(self._version_text) if self.flavour == "openmpi" else None)
        if command.launcher_binds():
            command = replace(command, env={k: v for k, v in env.items() if k != envvars.CPU_BIND})
        return command

    def _launcher_gpu_bind(self) -> str | None:
        """PALS's ``--gpu-bind list:...`` (one item per local rank) when the cluster says ``gpu_bind: launcher``."""
        if self.layout.binder != "launcher" or not self.layout.gpus_per_node or self.layout.visibility != "rank":
            return None  # node visibility: every rank of a host sees the same list, set by hvdrun's rank shim
        if self.flavour != "pals":
            raise UsageError(f"gpu_bind: launcher pins GPUs with Cray PALS's --gpu-bind, but this mpiexec is "
                             f"{self.flavour}; set gpu_bind: hvdrun in the cluster file (or --mpi-flavour pals)")
        per_host = max(host.slots for host in self._hosts)
        return "list:" + ":".join(",".join(self.layout.tile_ids_for(local, self._hosts[0].name))
                                  for local in range(per_host))

    def cancel_starts(self) -> None:
        """As :meth:`Launcher.cancel_starts`, for this machine's ranks too."""
        super().cancel_starts()
        self._local.cancel_starts()

    def close(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()


def _set_when_done(thread: threading.Thread, event: threading.Event) -> None:
    thread.join()
    event.set()


def _additions(env: Mapping[str, str]) -> dict[str, str]:
    """The variables hvdrun added to its own environment for the job (config env, -x, timeouts)."""
    per_rank = envvars.rank_variable_names()
    return {name: value for name, value in env.items()
            if os.environ.get(name) != value and name not in per_rank}
