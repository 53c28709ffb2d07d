"""The Python API, for notebooks and scripts: ``relax.validate``, ``relax.plan`` and ``relax.run``
do what the commands of the same names do, and return the objects those commands work with (the
typed ``RunSpec``, the ``Plan``, and a ``RunResult`` holding the exit code the command would
return). ``import relax`` loads none of this; each function imports what it needs when called, and
``validate`` and ``plan`` import neither torch nor ray (docs/python-api.md).

A spec is given as the command line takes it (a YAML/JSON path or a preset name, with dotted
``overrides``), as a mapping (the content of a spec file; relative paths in it are taken from
``base_dir``, the working folder by default), or as a ``RunSpec`` already validated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from relax.plan.model import Plan
    from relax.spec.models import RunSpec

def validate(spec: Any, overrides: Sequence[str] = (), *, base_dir: str | Path | None = None,
             here: bool = False) -> RunSpec:
    """Check a spec as ``relax validate`` does (every rule, this runtime, and its plan; with
    ``here``, as ``relax validate --here``, also this machine); the typed ``RunSpec`` when it is
    valid, ``relax.spec.SpecError`` listing every problem otherwise (``str(error)`` is the text the
    command prints). What this machine lacks without ``here``: ``relax.spec.validate.machine_notes``."""
    from relax.plan import make_plan
    from relax.plan.inputs import checked_spec

    checked, folder = checked_spec(spec, overrides, base_dir, runnable=True, here=here)
    make_plan(checked, base_dir=folder)  # a layout or memory problem is the spec's, as for the command
    return checked


def plan(spec: Any, overrides: Sequence[str] = (), *, base_dir: str | Path | None = None) -> Plan:
    """The ``Plan`` that ``relax plan`` renders: where every role runs and its memory. It does not
    ask that this machine can run the spec (``relax plan`` shows a cluster's layout anywhere);
    ``relax.plan.render(p, "table")`` is the command's text."""
    from relax.plan import plan_spec

    return plan_spec(spec, overrides, base_dir=base_dir)


@dataclass
class RunResult:
    """What ``relax.run`` returns: the exit code ``relax run`` would have (0 done, 1 failed, 2 the
    output folder cannot be used, 130 interrupted), where the run wrote, and its metrics rows."""

    code: int
    output_dir: Path
    metrics: list[dict[str, Any]] = field(default_factory=list)
    """The rows of ``metrics.jsonl``, one per step (empty when no step finished)."""
    evals: list[dict[str, Any]] = field(default_factory=list)
    """The held-out evaluations (``eval.jsonl``, ``data.eval``), one per policy version in version order."""

    @property
    def ok(self) -> bool:
        return self.code == 0


def run(spec: Any, overrides: Sequence[str] = (), *, base_dir: str | Path | None = None, resume: bool = False,
        stream: TextIO | None = None) -> RunResult:
    """Train, as ``relax run`` does: the banner, progress and summary go to ``stream`` (stdout by
    default); an invalid spec raises ``SpecError`` before anything starts; a run that fails returns
    its exit code in the result (the cause is printed on stderr, as by the command)."""
    from relax.plan import make_plan
    from relax.plan.inputs import checked_spec
    from relax.runtime.driver.launch import output_path, run_spec
    from relax.runtime.driver.report import eval_rows
    from relax.runtime.metrics import read_metrics

    checked, folder = checked_spec(spec, overrides, base_dir, runnable=False)  # run_spec's preflight adds the rest
    code = run_spec(checked, make_plan(checked, base_dir=folder), base_dir=folder, resume=resume, stream=stream)
    output_dir = output_path(checked)
    try:
        rows = read_metrics(output_dir)
    except (FileNotFoundError, ValueError):
        rows = []
    return RunResult(code, output_dir, rows, eval_rows(output_dir))
