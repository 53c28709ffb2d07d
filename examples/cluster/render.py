"""Render this folder's SLURM script or KubeRay manifest for a run spec (docs/cluster.md).

    python examples/cluster/render.py slurm SPEC --venv /shared/venvs/relax [a.b=c ...] > run.sbatch
    python examples/cluster/render.py kuberay SPEC --image REGISTRY/relax:TAG --pvc relax-shared \
        --spec-path /shared/relax/examples/cluster/qwen3-4b-2x8.yaml [a.b=c ...] > rayjob.yaml

The node count, GPUs and CPUs per node come from the spec's ``cluster`` section (after its
``extends`` and the overrides given here), so the allocation a template asks for and the plan
``relax run`` makes cannot disagree; the overrides and ``--resume`` are passed on to ``relax run``.
Why a script and not only ``${VAR}`` placeholders: the node counts are read from the spec, and the
values must be quoted for bash or YAML. Placeholders are ``@{NAME}``, not ``${NAME}``, because a
bash script is full of ``${...}`` of its own. Standard library and ``relax.config`` only: it
imports neither ray nor torch, and it reads no data or model (``relax validate`` checks those).
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import string
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
TEMPLATES = {"slurm": HERE / "slurm.sbatch.in", "kuberay": HERE / "kuberay-rayjob.yaml.in"}
#: The Ray the project is tested with; the cluster's Ray must be the driver's.
RAY_VERSION = "2.60.0"
RAY_PORT = 6379


class ClusterTemplate(string.Template):
    """``@{NAME}`` placeholders only (upper case), so that ``$``, ``${...}`` and ``@`` of the
    templates' own bash and YAML pass through untouched; ``@@`` writes one ``@``."""

    delimiter = "@"
    pattern = r"@(?:(?P<escaped>@)|\{(?P<braced>[A-Z][A-Z0-9_]*)\}|(?P<named>(?!))|(?P<invalid>(?!)))"


class RenderError(ValueError):
    """The spec or the arguments cannot make a cluster file; the message says what to change."""


def k8s_name(name: str) -> str:
    """The spec's name as a Kubernetes object name (lower case letters, digits and ``-``; at most
    50 characters, leaving KubeRay room for the suffixes of the objects it creates)."""
    cleaned = re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")[:50].strip("-")
    if not cleaned:
        raise RenderError(f"the spec's name {name!r} has no letter or digit to name the Kubernetes objects by; "
                          "give the spec a name such as qwen3-grpo")
    return cleaned


def cluster_numbers(spec: str, overrides: list[str]) -> tuple[str, int, int, int]:
    """Name, nodes, GPUs per node and CPUs per node of the spec, as ``relax run`` would load it."""
    from pydantic import ValidationError

    from relax.config import load_spec_dict
    from relax.spec.models import ClusterSpec

    raw, _ = load_spec_dict(spec, overrides)
    try:
        cluster = ClusterSpec.model_validate(raw.get("cluster") or {})
    except ValidationError as exc:
        raise RenderError(f"the spec's cluster section is not valid ({exc.error_count()} problem(s)); "
                          "run `relax validate` on it first") from None
    if cluster.gpus_per_node == 0:
        raise RenderError("the spec's cluster.gpus_per_node is 0: these templates start GPU nodes; set "
                          "cluster.gpus_per_node (and cluster.nodes) to the GPUs each node has")
    return str(raw.get("name") or "relax-run"), cluster.nodes, cluster.gpus_per_node, cluster.cpus_per_node


def render(target: str, spec: str, overrides: list[str], *, spec_path: str | None = None, resume: bool = False,
           venv: str | None = None, hf_home: str | None = None, image: str | None = None, pvc: str | None = None,
           memory: str = "256Gi") -> str:
    """The text of ``target``'s template for ``spec`` (``spec_path``: where the spec is on the
    cluster, default ``spec`` as given)."""
    if target not in TEMPLATES:
        raise RenderError(f"unknown target {target!r}; choose one of {', '.join(TEMPLATES)}")
    if any(o.lstrip("+~").startswith("cluster.address") for o in overrides):
        raise RenderError("the templates set cluster.address themselves (the Ray they start); leave it out of the "
                          "overrides")
    name, nodes, gpus, cpus = cluster_numbers(spec, overrides)
    relax_args = [*overrides, *(["--resume"] if resume else [])]
    values = {"NAME": k8s_name(name), "NODES": str(nodes), "GPUS_PER_NODE": str(gpus), "CPUS_PER_NODE": str(cpus),
              "RAY_VERSION": RAY_VERSION, "RAY_PORT": str(RAY_PORT)}
    where = spec_path or spec
    if target == "slurm":
        if not venv:
            raise RenderError("slurm needs --venv: the virtualenv with Relax, at the same path on every node")
        values |= {"SPEC_PATH": shlex.quote(where), "VENV": shlex.quote(venv),
                   # evaluated on the node: the user's own HF_HOME, else Hugging Face's default
                   "HF_HOME": shlex.quote(hf_home) if hf_home else '"${HF_HOME:-$HOME/.cache/huggingface}"',
                   "RELAX_ARGS": shlex.join(relax_args)}
    else:
        if not image or not pvc:
            raise RenderError("kuberay needs --image (a container image with Relax and Ray "
                              f"{RAY_VERSION}) and --pvc (a ReadWriteMany PersistentVolumeClaim mounted at /shared)")
        command = shlex.join(["relax", "run", where, "cluster.address=auto", *relax_args])
        # JSON strings are YAML double-quoted scalars: any spec path or override stays one value.
        values |= {"SPEC_PATH": where, "IMAGE": json.dumps(image), "PVC": json.dumps(pvc),
                   "MEMORY": json.dumps(memory), "ENTRYPOINT": json.dumps(f"cd /shared && {command}")}
    return ClusterTemplate(TEMPLATES[target].read_text()).substitute(values)


def main(argv: list[str] | None = None) -> int:
    """The command line; 2 and a message on stderr for a spec or arguments it cannot render."""
    parser = argparse.ArgumentParser(prog="render.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("target", choices=sorted(TEMPLATES))
    parser.add_argument("spec", help="the run spec (a file or a preset name), read here for its cluster section")
    parser.add_argument("overrides", nargs="*", help="a.b=c overrides, applied here and passed to relax run")
    parser.add_argument("--spec-path", help="the spec's path on the cluster (default: SPEC as given)")
    parser.add_argument("--resume", action="store_true", help="pass --resume to relax run")
    parser.add_argument("--venv", help="slurm: the virtualenv with Relax, the same path on every node")
    parser.add_argument("--hf-home", help="slurm: HF_HOME on the nodes (default: theirs, else ~/.cache/huggingface)")
    parser.add_argument("--image", help="kuberay: the container image with Relax and Ray")
    parser.add_argument("--pvc", help="kuberay: the ReadWriteMany PersistentVolumeClaim mounted at /shared")
    parser.add_argument("--memory", default="256Gi", help="kuberay: memory of each GPU worker pod (default 256Gi)")
    parser.add_argument("-o", "--output", type=Path, help="write here instead of stdout")
    args = parser.parse_args(argv)
    from relax.spec import SpecError

    try:
        text = render(args.target, args.spec, args.overrides, spec_path=args.spec_path, resume=args.resume,
                      venv=args.venv, hf_home=args.hf_home, image=args.image, pvc=args.pvc, memory=args.memory)
    except (RenderError, SpecError) as exc:
        print(f"render.py: {exc}", file=sys.stderr)
        return 2
    if args.output:
        args.output.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
