"""What this machine can give a run that starts its own Ray: how many NVIDIA GPUs it sees.

``relax validate`` and ``relax run`` both ask (``relax plan`` does not: it shows the layout a spec
asks for on the cluster it names, wherever it is run). Counting must not import torch, which
``relax validate`` never loads, so the count comes from the driver's own listing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator, Mapping
from pathlib import Path

from relax.spec.errors import SpecIssue
from relax.spec.models import RunSpec
from relax.spec.rules import RuleContext, gpus_requested, rule

#: One folder per GPU that the NVIDIA kernel driver has bound.
NVIDIA_PROC_GPUS = Path("/proc/driver/nvidia/gpus")
#: ``nvidia-smi -L`` may take a few seconds on a busy machine; more means it is stuck.
NVIDIA_SMI_TIMEOUT_S = 20.0


def _driver_gpu_count(proc_dir: Path) -> int:
    """GPUs the driver lists: its ``/proc`` folders, else the lines of ``nvidia-smi -L``."""
    if proc_dir.is_dir():
        return sum(1 for entry in proc_dir.iterdir() if entry.is_dir())
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        listing = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError):
        return 0
    if listing.returncode != 0:
        return 0
    return sum(1 for line in listing.stdout.splitlines() if line.startswith("GPU "))


def local_gpu_count(proc_dir: Path = NVIDIA_PROC_GPUS, env: Mapping[str, str] | None = None) -> int:
    """NVIDIA GPUs a process started here can use: those the driver lists, narrowed by
    ``CUDA_VISIBLE_DEVICES`` as CUDA narrows them (an empty value hides every GPU; the list ends
    at its first negative index)."""
    found = _driver_gpu_count(proc_dir)
    visible = (os.environ if env is None else env).get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return found
    count = 0
    for entry in (e.strip() for e in visible.split(",")):
        if not entry or entry.startswith("-"):
            break
        count += 1
    return min(found, count)


@rule("cluster", "roles", "placement")
def check_machine(spec: RunSpec, ctx: RuleContext) -> Iterator[SpecIssue]:
    """A spec without ``cluster.address`` runs on an embedded Ray on this machine, whose GPUs
    must then hold every GPU the roles ask for."""
    if spec.cluster.address is not None:
        return
    asked = gpus_requested(spec)
    if asked == 0:
        return
    here = local_gpu_count()
    if here < asked:
        yield SpecIssue("cluster.address",
                        f"the spec asks for {asked} GPU{'s' if asked != 1 else ''} on this machine "
                        f"(cluster.address is null: an embedded Ray), which has {here}",
                        "set cluster.address to run on a GPU cluster, or use a CPU preset such as tiny-cpu "
                        "(`relax plan` still shows this spec's layout)")
