"""The ``relax`` command line: exit codes, error output, generated files and import weight."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from relax.config.loader import PRESETS_DIR
from relax.spec.schema import schema_text, spec_reference_markdown

from .conftest import ROOT

PRESETS = sorted(p.name for p in PRESETS_DIR.glob("*.yaml"))
CPU_PRESETS = ["tiny-agent-cpu.yaml", "tiny-cpu.yaml", "tiny-fsdp-cpu.yaml", "tiny-longtail-cpu.yaml",
               "tiny-lora-cpu.yaml", "tiny-omni-cpu.yaml"]
HEAVY = ("torch", "ray", "vllm", "megatron", "transformers")
#: A machine without GPUs, whatever runs the tests (CUDA hides every GPU for an empty value).
NO_GPUS = {"CUDA_VISIBLE_DEVICES": ""}


@pytest.mark.parametrize("preset", PRESETS)
def test_validate_accepts_every_preset_and_notes_what_this_machine_lacks(relax, preset):
    # validate judges the spec, wherever it is written: a GPU preset on a machine without GPUs is
    # valid, with a note; --here judges it for this machine, as `relax run` does, and refuses it
    result = relax("validate", str(PRESETS_DIR / preset), env_vars=NO_GPUS)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ok: ") and result.stderr == ""
    here = relax("validate", "--here", str(PRESETS_DIR / preset), env_vars=NO_GPUS)
    if preset in CPU_PRESETS:
        assert "note" not in result.stdout
        assert here.returncode == 0, here.stderr
    else:  # `relax run` would refuse it here
        assert any(line.startswith("note (this machine, not the spec; `relax run` and `relax validate --here` "
                                   "refuse it here): cluster.address: the spec asks for ")
                   for line in result.stdout.splitlines()[1:])
        assert here.returncode == 2
        assert "\n  - cluster.address: the spec asks for " in here.stderr
        assert "set cluster.address to run on a GPU cluster" in here.stderr
    # on a GPU cluster it runs from here
    assert relax("validate", "--here", str(PRESETS_DIR / preset), "cluster.address=ray://head:10001").returncode == 0


def test_validate_accepts_a_preset_name_and_overrides(relax):
    result = relax("validate", "tiny-cpu", "algorithm.samples_per_prompt=4", "name=renamed")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ok: renamed is valid")


def test_broken_spec_exits_2_with_every_error_and_no_traceback(relax, tmp_path):
    spec = tmp_path / "broken.yaml"
    spec.write_text(textwrap.dedent("""\
        extends: tiny-cpu
        name: broken
        seed: -1
        placement: {mode: colocat}
        roles:
          actor: {paralel: {tp: 2}}
        """))
    result = relax("validate", str(spec))
    assert result.returncode == 2
    assert result.stdout == ""
    assert "3 problems" in result.stderr
    for path in ("seed:", "placement.mode:", "roles.actor.paralel:"):
        assert path in result.stderr
    assert "did you mean 'colocate'?" in result.stderr
    assert "did you mean 'parallel'?" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout


def test_rule_errors_exit_2_together(relax):
    result = relax("validate", "tiny-cpu", "placement.mode=colocate", "algorithm.kl_coef=0.1",
                   "async_policy.correction=decoupled")
    assert result.returncode == 2
    for path in ("async_policy.max_staleness:", "algorithm.kl_coef:", "async_policy.correction:"):
        assert path in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("args", [
    ["validate", "no/such/spec.yaml"],
    ["validate", "tiny-cpu", "algorithm.kl_coef"],  # an override without '='
    ["plan", "tiny-cpu", "rewards.7.weight=1"],
])
def test_unusable_spec_reference_or_override_exits_2_cleanly(relax, args):
    result = relax(*args)
    assert result.returncode == 2
    assert result.stderr.strip()
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("args", [
    [],
    ["frobnicate"],
    ["validate"],
    ["plan", "tiny-cpu", "--format", "png"],
    ["validate", "tiny-cpu", "--no-such-flag"],
])
def test_bad_command_line_exits_2(relax, args):
    result = relax(*args)
    assert result.returncode == 2
    assert "usage:" in result.stderr
    assert "Traceback" not in result.stderr


def test_schema_command_prints_the_checked_in_schema(relax):
    result = relax("schema")
    assert result.returncode == 0
    assert result.stdout == (ROOT / "schemas" / "run-spec.schema.json").read_text(), \
        "stale: run `relax schema --write`"


def test_checked_in_schema_is_current():
    assert (ROOT / "schemas" / "run-spec.schema.json").read_text() == schema_text(), \
        "stale: run `relax schema --write`"


def test_checked_in_spec_reference_is_current():
    assert (ROOT / "docs" / "spec-reference.md").read_text() == spec_reference_markdown(), \
        "stale: run `relax schema --write`"


def test_schema_write_writes_the_files(relax, tmp_path):
    result = relax("schema", "--write", "--root", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "schemas" / "run-spec.schema.json").read_text() == schema_text()
    assert (tmp_path / "docs" / "spec-reference.md").read_text() == spec_reference_markdown()


IMPORT_PROBE = """
import json, sys
from relax.cli import main
rc = main(sys.argv[1:])
heavy = sorted(m for m in sys.modules if m.split('.')[0] in {heavy!r})
print("\\n" + json.dumps({{"rc": rc, "heavy": heavy}}))
"""


@pytest.mark.parametrize("command", [["validate"], ["validate", "--here"], ["plan"], ["plan", "--format", "json"]],
                         ids=["validate", "validate-here", "plan", "plan-json"])
@pytest.mark.parametrize("preset", ["tiny-cpu.yaml", "qwen3-4b-grpo-async.yaml"])
def test_validate_and_plan_import_no_heavy_library(command, preset):
    argv = [command[0], str(PRESETS_DIR / preset), *command[1:]]
    result = subprocess.run([sys.executable, "-c", IMPORT_PROBE.format(heavy=set(HEAVY)), *argv],
                            capture_output=True, text=True, timeout=120, cwd=ROOT, env={**os.environ, **NO_GPUS})
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["heavy"] == []
    # validate counts this machine's GPUs (none here) without torch: a note, an error with --here;
    # plan shows the layout anyway
    refused = command == ["validate", "--here"] and preset not in CPU_PRESETS
    assert report["rc"] == (2 if refused else 0), result.stderr


# -- relax plugins, completion, pipes -------------------------------------------------------------


@pytest.mark.parametrize("kind", ["reward", "rewards", "Rewards"])
def test_plugins_kind_takes_singular_and_plural(relax, kind):
    result = relax("plugins", "--kind", kind)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("rewards:\n")
    assert "exact_match" in result.stdout and "losses:" not in result.stdout


def test_plugins_kind_singular_of_an_ies_and_an_es_kind(relax):
    assert relax("plugins", "--kind", "modality").stdout.startswith("modalities:\n")
    assert relax("plugins", "--kind", "loss").stdout.startswith("losses:\n")


def test_plugins_unknown_kind_exits_2_with_the_kinds(relax):
    result = relax("plugins", "--kind", "rewardz")
    assert result.returncode == 2 and result.stdout == ""
    assert "'rewardz' is not a plugin kind" in result.stderr
    assert "rollout, trainer, rewards, advantages, losses" in result.stderr and "Traceback" not in result.stderr


def test_plugins_show_option_types_and_defaults(relax):
    table = relax("plugins", "--kind", "reward").stdout
    assert "      strip (bool, default true): Strip leading" in table
    assert "      stop (list[str], default [" in table
    rows = {row["name"]: row for row in json.loads(relax("plugins", "--kind", "rewards", "--json").stdout)}
    case = rows["exact_match"]["options"]["case_sensitive"]
    assert case == {"type": "bool", "required": False, "default": False, "help": case["help"]}
    assert case["help"].startswith("Compare letters with their case")


def test_plugins_into_a_closed_pipe_ends_quietly(tmp_path):
    """``relax plugins | head -1``: the reader goes away; no BrokenPipeError traceback."""
    proc = subprocess.Popen([sys.executable, "-m", "relax", "plugins"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=ROOT, env=os.environ.copy())
    assert proc.stdout.readline() == b"rollout:\n"
    proc.stdout.close()
    _, err = proc.communicate(timeout=120)
    assert b"Traceback" not in err and b"BrokenPipe" not in err, err
    assert proc.returncode == 141  # the shell's status for a writer whose reader left (128 + SIGPIPE)


@pytest.mark.parametrize("shell", ["bash", "zsh"])
def test_completion_prints_the_shell_script(relax, shell):
    result = relax("completion", shell)
    assert result.returncode == 0, result.stderr
    # argcomplete's script serves both shells: `complete` under bash, `compdef` under zsh
    assert "_ARGCOMPLETE" in result.stdout
    assert "complete -o nospace -o default -o bashdefault -F _python_argcomplete relax" in result.stdout
    assert "compdef _python_argcomplete relax" in result.stdout


def test_completion_answers_the_shell(tmp_path):
    """What the script does on <TAB>: call relax with argcomplete's variables; relax answers."""
    answer = tmp_path / "answer"
    env = {**os.environ, "_ARGCOMPLETE": "1", "COMP_LINE": "relax pl", "COMP_POINT": "8",
           "_ARGCOMPLETE_STDOUT_FILENAME": str(answer)}
    subprocess.run([sys.executable, "-m", "relax"], env=env, cwd=ROOT, timeout=120, capture_output=True)
    assert sorted(answer.read_text().split()) == ["plan", "plugins"]


def test_spec_reference_marks_required_only_what_a_spec_must_give():
    """A key with a default (a value, or a section built from its own defaults) is optional."""
    from relax.spec.models import RunSpec

    text = spec_reference_markdown()
    top = text.split("## `spec`", 1)[1].split("\n## ", 1)[0]
    required = {line.split("`")[1] for line in top.splitlines() if "| **required** |" in line}
    assert required == {k for k, f in RunSpec.model_fields.items() if f.is_required()} == {"name"}
    assert "| `trainer` | TrainerSpec | optional (its defaults below) |" in top
    assert "`required`" not in text
