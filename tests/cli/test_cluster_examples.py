"""The cluster examples (``examples/cluster``, docs/cluster.md): each template renders for the
example spec into a well-formed file whose node and GPU counts are the spec's, the SLURM script
starts Ray and the run as documented (executed with SLURM's, Ray's and Relax's commands replaced by
recorders), and the ``relax run`` command each file holds validates with ``relax validate``."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from relax.config import load_spec_dict
from relax.spec.models import RunSpec

from .conftest import ROOT, run_relax

EXAMPLES = ROOT / "examples" / "cluster"
SPEC = EXAMPLES / "qwen3-4b-2x8.yaml"
NODES = ["gpu-a", "gpu-b"]
HEAD_IP = "10.1.2.3"


def load_render():
    """``examples/cluster/render.py`` as a module (it is an example script, not a package)."""
    spec = importlib.util.spec_from_file_location("cluster_render", EXAMPLES / "render.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


render = load_render()


def cluster_of(*overrides: str):
    raw, _ = load_spec_dict(str(SPEC), list(overrides))
    return RunSpec.model_validate(raw).cluster


def validate_command(argv: list[str]) -> subprocess.CompletedProcess:
    """``relax validate`` with the spec and overrides of a rendered ``relax run`` command line."""
    assert argv[:2] == ["relax", "run"], argv
    return run_relax("validate", *[a for a in argv[2:] if a != "--resume"])


# -- SLURM ------------------------------------------------------------------------------------------

#: Each call is logged in one write: the script starts its ``srun ray start`` steps in the
#: background, and two stubs writing a line piece by piece interleaved their pieces.
STUB = """#!/bin/bash
line="$(basename "$0")$(printf '\\x1f%s' "$@")"
printf '%s\\n' "$line" >> "$STUB_LOG"
case "$(basename "$0")" in
  scontrol) printf '%s\\n' gpu-a gpu-b ;;
  srun) [[ " $* " == *" hostname --ip-address "* ]] && echo "10.1.2.3 fd00::3" ;;
  python) cat > /dev/null ;;
esac
exit 0
"""


def run_sbatch(script: Path, tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> tuple[
        subprocess.CompletedProcess, list[list[str]]]:
    """Run a rendered sbatch script with ``scontrol``, ``srun``, ``python`` and ``relax`` replaced
    by recorders (put on PATH by the venv's ``activate``); the commands they were called with."""
    stubs, log = tmp_path / "stubs", tmp_path / "calls.log"
    stubs.mkdir(exist_ok=True)
    for name in ("scontrol", "srun", "python", "relax"):
        (stubs / name).write_text(STUB)
        (stubs / name).chmod(stat.S_IRWXU)
    venv = tmp_path / "venv" / "bin"
    venv.mkdir(parents=True, exist_ok=True)
    (venv / "activate").write_text(f'export PATH="{stubs}:$PATH"\n')
    full_env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "STUB_LOG": str(log),
                "SLURM_JOB_NODELIST": "gpu-[a-b]", **(env or {})}
    result = subprocess.run(["bash", str(script), *args], capture_output=True, text=True, env=full_env, timeout=60,
                            cwd=tmp_path)
    calls = [line.split("\x1f") for line in log.read_text().splitlines()] if log.exists() else []
    return result, calls


def rendered_slurm(tmp_path: Path, *overrides: str) -> Path:
    text = render.render("slurm", str(SPEC), list(overrides), venv=str(tmp_path / "venv"))
    script = tmp_path / "run.sbatch"
    script.write_text(text)
    return script


def sbatch_options(script: Path) -> dict[str, str]:
    lines = [line[len("#SBATCH "):] for line in script.read_text().splitlines() if line.startswith("#SBATCH ")]
    return dict(line.lstrip("-").split("=", 1) for line in lines if "=" in line)


def test_the_slurm_script_is_bash_and_asks_for_the_spec_s_nodes(tmp_path):
    script = rendered_slurm(tmp_path)
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True).returncode == 0
    assert "@{" not in script.read_text()
    cluster = cluster_of()
    options = sbatch_options(script)
    assert options["nodes"] == str(cluster.nodes) == "2"
    assert options["gpus-per-task"] == str(cluster.gpus_per_node) == "8"
    assert options["ntasks-per-node"] == "1" and options["cpus-per-task"] == str(cluster.cpus_per_node)
    assert options["job-name"] == "qwen3-4b-grpo-2x8"


def test_the_slurm_script_starts_ray_on_every_node_then_the_run_on_the_head(tmp_path):
    script = rendered_slurm(tmp_path, "trainer.steps=100")
    token = tmp_path / "token"
    token.write_text("secret")
    result, calls = run_sbatch(script, tmp_path, "--resume", env={"RAY_AUTH_TOKEN_PATH": str(token)})
    assert result.returncode == 0, result.stderr
    ray_starts = [c for c in calls if c[0] == "srun" and "ray" in c]
    head, worker = sorted(ray_starts, key=lambda c: "--head" not in c)  # started in the background: either order
    assert head[head.index("-w") + 1] == "gpu-a" and "--head" in head
    assert f"--node-ip-address={HEAD_IP}" in head and "--port=6379" in head
    assert worker[worker.index("-w") + 1] == "gpu-b" and f"--address={HEAD_IP}:6379" in worker
    for start in ray_starts:
        assert "--num-gpus=8" in start and "--num-cpus=96" in start and "--block" in start
    waits = [c for c in calls if c[0] == "python"]
    assert waits == [["python", "-", f"{HEAD_IP}:6379", "2", "8"]]
    relax_calls = [c for c in calls if c[0] == "relax"]
    assert relax_calls == [["relax", "run", str(SPEC), f"cluster.address={HEAD_IP}:6379", "trainer.steps=100",
                            "--resume"]]
    assert [c[0] for c in calls].index("python") < [c[0] for c in calls].index("relax")  # nodes first
    # the run's command line validates: the spec fits the 2 x 8 GPUs the script asked for
    check = validate_command(relax_calls[0])
    assert check.returncode == 0, check.stderr


def test_the_slurm_script_stops_without_a_ray_token(tmp_path):
    result, calls = run_sbatch(rendered_slurm(tmp_path), tmp_path)
    assert result.returncode == 1
    assert f"no Ray token in {tmp_path}/.ray/auth_token: run 'ray get-auth-token --generate'" in result.stderr
    assert not [c for c in calls if c[0] in ("srun", "relax")]
    result, calls = run_sbatch(rendered_slurm(tmp_path), tmp_path, env={"RAY_AUTH_TOKEN": "secret"})
    assert result.returncode == 0 and [c[0] for c in calls][-1] == "relax"


def test_overrides_change_the_allocation_and_reach_the_run(tmp_path):
    script = rendered_slurm(tmp_path, "cluster.nodes=3")
    assert sbatch_options(script)["nodes"] == "3"
    assert 'relax run ' + shlex.quote(str(SPEC)) + ' "cluster.address=$head_ip:$port" cluster.nodes=3 "$@"' \
        in script.read_text()


# -- KubeRay ------------------------------------------------------------------------------------------


def rendered_rayjob(*overrides: str, **options: str) -> dict:
    text = render.render("kuberay", str(SPEC), list(overrides), image="registry.example/relax:1.0",
                         pvc="relax-shared", **options)
    assert "@{" not in text
    return yaml.safe_load(text)


def test_the_rayjob_has_what_kuberay_requires_and_the_spec_s_gpus():
    job = rendered_rayjob()
    cluster = cluster_of()
    assert job["apiVersion"] == "ray.io/v1" and job["kind"] == "RayJob"
    assert job["metadata"]["name"] == "qwen3-4b-grpo-2x8"
    ray_cluster = job["spec"]["rayClusterSpec"]
    assert ray_cluster["rayVersion"] == render.RAY_VERSION == importlib.metadata.version("ray")
    assert ray_cluster["authOptions"] == {"mode": "token"}
    head = ray_cluster["headGroupSpec"]
    assert "rayStartParams" in head
    head_container, = head["template"]["spec"]["containers"]
    assert head_container["image"] == "registry.example/relax:1.0"
    assert "nvidia.com/gpu" not in head_container["resources"]["limits"]  # the driver's pod: no GPUs
    group, = ray_cluster["workerGroupSpecs"]
    assert group["groupName"] and "rayStartParams" in group
    assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == cluster.nodes == 2
    worker, = group["template"]["spec"]["containers"]
    assert worker["image"] == "registry.example/relax:1.0"
    for kind in ("requests", "limits"):
        assert worker["resources"][kind]["nvidia.com/gpu"] == str(cluster.gpus_per_node) == "8"
        assert worker["resources"][kind]["cpu"] == str(cluster.cpus_per_node)
    for pod in (head["template"]["spec"], group["template"]["spec"]):
        assert {"name": "shared", "persistentVolumeClaim": {"claimName": "relax-shared"}} in pod["volumes"]
        assert {"name": "HF_HUB_OFFLINE", "value": "1"} in pod["containers"][0]["env"]


def test_the_rayjob_entrypoint_runs_a_spec_that_validates():
    entrypoint = rendered_rayjob("trainer.steps=100", resume=True)["spec"]["entrypoint"]
    assert entrypoint.startswith("cd /shared && ")
    argv = shlex.split(entrypoint.removeprefix("cd /shared && "))
    assert argv == ["relax", "run", str(SPEC), "cluster.address=auto", "trainer.steps=100", "--resume"]
    check = validate_command(argv)
    assert check.returncode == 0, check.stderr


def test_a_spec_path_with_spaces_stays_one_argument():
    entrypoint = rendered_rayjob(spec_path="/shared/my specs/run.yaml")["spec"]["entrypoint"]
    assert shlex.split(entrypoint)[5] == "/shared/my specs/run.yaml"


# -- what render.py refuses ------------------------------------------------------------------------------


@pytest.mark.parametrize(("args", "message"), [
    (["slurm", "tiny-cpu", "--venv", "/v"], "cluster.gpus_per_node is 0: these templates start GPU nodes"),
    (["slurm", str(SPEC)], "slurm needs --venv"),
    (["kuberay", str(SPEC), "--image", "i"], "kuberay needs --image"),
    (["slurm", str(SPEC), "cluster.address=auto", "--venv", "/v"], "the templates set cluster.address themselves"),
    (["slurm", str(SPEC), "cluster.nodes=0", "--venv", "/v"], "the spec's cluster section is not valid"),
])
def test_render_refuses_what_it_cannot_render(args, message):
    result = subprocess.run([sys.executable, str(EXAMPLES / "render.py"), *args], capture_output=True, text=True,
                            cwd=ROOT, timeout=60)
    assert result.returncode == 2 and result.stdout == ""
    assert message in result.stderr


def test_k8s_names():
    assert render.k8s_name("Qwen3_4B GRPO!") == "qwen3-4b-grpo"
    with pytest.raises(render.RenderError, match="no letter or digit"):
        render.k8s_name("__")


def test_the_render_commands_of_the_runbook_work(tmp_path):
    """docs/cluster.md's render.py command lines (without their [optional] parts) as a user types them."""
    text = (ROOT / "docs" / "cluster.md").read_text().replace("\\\n", " ")
    commands = [line.split(">")[0] for line in text.splitlines() if line.startswith("python examples/cluster/render.py")]
    assert [shlex.split(c)[2] for c in commands] == ["slurm", "kuberay"]
    for command in commands:
        argv = [a for a in shlex.split(command.replace("[", "'[").replace("]", "]'")) if not a.startswith("[")]
        result = subprocess.run([sys.executable, *argv[1:]], capture_output=True, text=True, cwd=ROOT, timeout=60)
        assert result.returncode == 0, (command, result.stderr)
        assert "@{" not in result.stdout
        runs = "relax run examples/cluster/qwen3-4b-2x8.yaml" if argv[2] == "slurm" else \
            "relax run /shared/relax/examples/cluster/qwen3-4b-2x8.yaml cluster.address=auto"
        assert runs in result.stdout
