"""What this machine can give a run that starts its own Ray: how many NVIDIA GPUs it sees, and
whether its Hugging Face cache holds a hub model the spec names.

``relax run`` and ``relax validate --here`` refuse a spec this machine cannot hold; ``relax
validate`` prints it as a note (a spec is often written on a laptop for a cluster), and ``relax
plan`` does not ask (it shows the layout a spec asks for on the cluster it names, wherever it is
run). Counting must not import torch, which
``relax validate`` never loads, so the count comes from the driver's own listing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator, Mapping
from pathlib import Path

from relax.errors import SpecIssue
from relax.spec.architecture import BUILTIN_PREFIX
from relax.spec.hf_cache import HUB_ID, TOKENIZER_FILES, cached_snapshot, download_hint, has_tokenizer, hub_cache_dir
from relax.spec.models import RunSpec
from relax.spec.rules import Rule, RuleContext, gpus_requested, rule

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


@rule("model", "cluster")
def check_model_on_this_machine(spec: RunSpec, ctx: RuleContext) -> Iterator[SpecIssue]:
    """A run on this machine loads a hub id from this machine's Hugging Face cache, and only from
    there: Relax never downloads a model. ``relax validate`` reads a model it has no files of from a
    shipped card (a laptop authoring for a cluster), so an uncached hub id is a machine note there,
    and an error for ``relax run``, which would otherwise leave it to ``from_pretrained`` to fetch."""
    path = spec.model.path
    if spec.cluster.address is not None or path.startswith(BUILTIN_PREFIX) or not HUB_ID.match(path):
        return
    folder = Path(path).expanduser()
    if (folder if folder.is_absolute() else ctx.base_dir / folder).is_dir():
        return
    snapshot = cached_snapshot(path)
    if snapshot is None:
        yield SpecIssue("model.path",
                        f"'{path}' is not in this machine's Hugging Face cache ({hub_cache_dir()}), and Relax never "
                        "downloads a model", download_hint(path))
    elif not has_tokenizer(snapshot):  # only config.json was downloaded (enough to validate and plan)
        yield SpecIssue("model.path", f"the Hugging Face cache holds only part of {path}: its snapshot {snapshot} has "
                                      f"a config.json but no tokenizer files (none of {', '.join(TOKENIZER_FILES)}), "
                                      "so a run here cannot load it",
                        f"download the whole model: `hf download {path}` (with the same HF_HOME)")


#: The checks that judge the machine the command runs on, not the spec (``MACHINE_RULES`` are
#: errors for ``relax run`` and ``relax validate --here``, notes for ``relax validate``).
MACHINE_RULES: tuple[Rule, ...] = (check_machine, check_model_on_this_machine)
