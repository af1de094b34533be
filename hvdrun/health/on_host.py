"""What ``hvdrun check`` asks a host: ``python -m hvdrun.health.on_host facts|listen|connect|clock``.

* ``facts``: one JSON line: the facts every launch asks for (:mod:`hvdrun.launch.remote.hostfacts`), the torch
  that ``import torch`` really loads (or why it fails), the GPUs (``nvidia-smi``, else
  ``torch.cuda``) and the free disk of the working directory; with ``--health`` also the node's health
  (:mod:`hvdrun.health.node_health`: ``--health-interface IF``, ``--mount PATH``..., ``--local-dir DIR``, each
  vendor tool bounded by ``--tool-timeout S``); ``--no-torch``: torch is not imported (no version, GPUs from
  ``nvidia-smi`` only).
* ``listen --token T``: serve a TCP port (printed first, on its own line) that answers every
  connection with ``T``, until stdin closes: the rendezvous port of rank 0's host.
* ``connect ADDR PORT``: connect there and print what the listener said (the token).
* ``clock``: ``ready``, then this host's ``time.time()`` for every line read, until stdin closes.

Runs under the host's Python, in the job's working directory; it needs hvdrun, never torch.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hvdrun.health.node_health import TOOL_TIMEOUT_S, NodeHealth, node_health, serve_clock
from hvdrun.launch.remote import cpubind
from hvdrun.launch.remote.hostfacts import HostFacts, facts
from hvdrun.ranks import GPU_VENDORS

_NVIDIA_SMI_TIMEOUT_S = 10.0
_CONNECT_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Gpu:
    """One GPU a host has."""

    index: int
    name: str
    memory_mib: int | None = None


@dataclass(frozen=True)
class HealthFacts:
    """A host's answer to ``on_host facts``."""

    base: HostFacts
    torch_version: str | None
    torch_error: str | None
    gpus: tuple[Gpu, ...] = ()
    gpu_source: str = "none"
    disk_free_bytes: int = 0
    workdir: str = ""
    gpu_error: str | None = field(default=None)
    cpus: tuple[int, ...] = ()  # the cores this host allows (sched_getaffinity)
    numa: dict[str, list[int]] = field(default_factory=dict)  # NUMA node -> its cores
    siblings: dict[str, list[int]] = field(default_factory=dict)  # core -> its hardware threads
    gpu_numa: dict[str, list[int]] = field(default_factory=dict)  # vendor -> NUMA node of each GPU
    node: NodeHealth | None = None  # with --health

    def to_json(self) -> str:
        """One JSON line."""
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> HealthFacts:
        """Parse :meth:`to_json`'s line."""
        data = json.loads(text)
        base = data.pop("base")
        node = data.pop("node", None)
        return cls(base=HostFacts(**{**base, "ports": tuple(base["ports"])}),
                   node=NodeHealth.from_dict(node) if node is not None else None,
                   gpus=tuple(Gpu(**g) for g in data.pop("gpus")), cpus=tuple(data.pop("cpus", ())), **data)


def torch_facts() -> tuple[str | None, str | None, list[Gpu]]:
    """(torch.__version__, why it cannot be imported, its CUDA GPUs)."""
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - any import failure is the answer
        return None, f"{type(e).__name__}: {e}", []
    gpus = []
    try:
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            gpus.append(Gpu(index, str(props.name), int(props.total_memory) >> 20))
    except Exception:  # noqa: BLE001,S110 - a broken CUDA runtime shows as no GPU (nvidia-smi says more)
        pass
    return str(torch.__version__), None, gpus


def installed_torch_version() -> str | None:
    """``torch.__version__`` as ``import torch`` would report it, read from ``torch/version.py`` without the
    import (2 s of CPU); imported when that file says nothing plain. None when torch cannot be imported."""
    spec = importlib.util.find_spec("torch")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        try:
            text = Path(folder, "version.py").read_text()
        except OSError:
            continue
        found = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]\s*$", text, re.M)
        if found:
            return found.group(1)
    return torch_facts()[0]


def nvidia_smi_gpus() -> tuple[list[Gpu] | None, str | None]:
    """The GPUs nvidia-smi lists (None when there is no nvidia-smi), and its error if it failed."""
    program = shutil.which("nvidia-smi")
    if program is None:
        return None, None
    try:
        done = subprocess.run([program, "--query-gpu=index,name,memory.total", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=_NVIDIA_SMI_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return [], f"nvidia-smi did not answer within {_NVIDIA_SMI_TIMEOUT_S:g} s"
    if done.returncode != 0:
        return [], f"nvidia-smi failed ({done.returncode}): {(done.stdout + done.stderr).strip()[:200]}"
    gpus = []
    for line in done.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 2 and parts[0].isdigit():
            memory = int(parts[2]) if len(parts) > 2 and parts[2].isdigit() else None
            gpus.append(Gpu(int(parts[0]), parts[1], memory))
    return gpus, None


def health_facts(interface: str | None = None, node: NodeHealth | None = None, torch: bool = True) -> HealthFacts:
    """Everything ``hvdrun check`` wants to know about this host (and the address of ``interface``); ``node``: its
    health, when asked for; without ``torch`` nothing imports it (``hvdrun --preflight``: seconds of CPU and the
    shared file system's reads on every node, for versions it does not compare)."""
    version, error, cuda_gpus = torch_facts() if torch else (None, "not asked (--no-torch)", [])
    smi_gpus, gpu_error = nvidia_smi_gpus()
    gpus, source = (smi_gpus, "nvidia-smi") if smi_gpus else (cuda_gpus, "torch.cuda" if cuda_gpus else "none")
    workdir = os.getcwd()
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    return HealthFacts(base=facts(interface, 0), torch_version=version, torch_error=error, gpus=tuple(gpus),
                       gpu_source=source, disk_free_bytes=shutil.disk_usage(workdir).free, workdir=workdir,
                       gpu_error=gpu_error, cpus=tuple(cpus),
                       numa={str(n): sorted(c) for n, c in cpubind.numa_nodes().items()},
                       siblings={str(c): sorted(t) for c, t in cpubind.thread_siblings(set(cpus)).items()},
                       gpu_numa={v: n for v in GPU_VENDORS if (n := cpubind.gpu_numa_nodes(v))}, node=node)


def serve_token(server: socket.socket, token: bytes, stop: threading.Event) -> None:
    """Answer every connection to ``server`` with ``token`` until ``stop`` is set."""
    server.settimeout(0.2)
    while not stop.is_set():
        try:
            conn, _ = server.accept()
        except TimeoutError:
            continue
        except OSError:
            return
        with conn:
            try:
                conn.sendall(token + b"\n")
            except OSError:
                pass


def ask_token(addr: str, port: int, timeout_s: float = _CONNECT_TIMEOUT_S) -> str:
    """Connect to a :func:`serve_token` listener and return its token (raises OSError on failure)."""
    with socket.create_connection((addr, port), timeout=timeout_s) as conn:
        data = b""
        while not data.endswith(b"\n"):
            chunk = conn.recv(256)
            if not chunk:
                break
            data += chunk
    return data.decode(errors="replace").strip()


def _listen(token: str) -> None:
    server = socket.create_server(("", 0))
    stop = threading.Event()
    thread = threading.Thread(target=serve_token, args=(server, token.encode(), stop), daemon=True)
    thread.start()
    print(server.getsockname()[1], flush=True)
    sys.stdin.read()  # until the checker closes the channel
    stop.set()
    thread.join()
    server.close()


def _write_flushed(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> None:
    """Command-line entry: ``facts``, ``listen``, ``connect`` or ``clock``."""
    parser = argparse.ArgumentParser(prog="python -m hvdrun.health.on_host")
    sub = parser.add_subparsers(dest="action", required=True)
    facts_parser = sub.add_parser("facts")
    facts_parser.add_argument("--interface")
    facts_parser.add_argument("--health", action="store_true")
    facts_parser.add_argument("--health-interface", action="append", default=[])
    facts_parser.add_argument("--mount", action="append", default=[])
    facts_parser.add_argument("--local-dir")
    facts_parser.add_argument("--tool-timeout", type=float, default=TOOL_TIMEOUT_S)
    facts_parser.add_argument("--no-torch", action="store_true")
    sub.add_parser("clock")
    listen = sub.add_parser("listen")
    listen.add_argument("--token", required=True)
    connect = sub.add_parser("connect")
    connect.add_argument("addr")
    connect.add_argument("port", type=int)
    args = parser.parse_args(argv)
    if args.action == "facts":
        node = node_health(args.health_interface, args.mount, args.local_dir,
                           args.tool_timeout) if args.health else None
        print(health_facts(args.interface, node, torch=not args.no_torch).to_json(), flush=True)
    elif args.action == "clock":
        serve_clock(sys.stdin, _write_flushed)
    elif args.action == "listen":
        _listen(args.token)
    else:
        try:
            print(ask_token(args.addr, args.port), flush=True)
        except OSError as e:
            print(f"{type(e).__name__}: {e.strerror or e}", file=sys.stderr, flush=True)
            sys.exit(1)


if __name__ == "__main__":
    main()
