"""``relax validate --here`` and the checks ``relax run`` makes before it starts anything give every
preset the same verdict and the same problems (one source of truth: they run the same rules);
``relax validate`` judges the spec alone, and names what this machine lacks in a note."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from relax.cli import main
from relax.config import load_spec_dict
from relax.spec import SpecError, machine, validate_spec
from relax.spec.hf_cache import HUB_ID
from relax.config.loader import PRESETS_DIR

PRESETS = sorted(PRESETS_DIR.glob("*.yaml"))


def run_prestart(preset: Path) -> list[str]:
    """What ``relax run`` reports before starting: ``cmd_run`` validates the spec (exit 2 on a
    problem), then ``run_spec``'s preflight checks it against the runtime and machine (exit 1)."""
    from relax.runtime.driver.launch import preflight

    raw, base = load_spec_dict(str(preset), [])
    try:
        spec = validate_spec(raw, base_dir=base)
    except SpecError as exc:
        return [str(issue) for issue in exc.issues]
    return [str(issue) for issue in preflight(spec, base)]


def run_validate(preset: Path, capsys, *flags: str) -> tuple[int, list[str], str]:
    """The exit code, the problems listed and what was printed on stdout."""
    code = main(["validate", *flags, str(preset)])
    out, err = capsys.readouterr()
    return code, [line[len("  - "):] for line in err.splitlines() if line.startswith("  - ")], out


@pytest.mark.parametrize("gpus_here", [0, 64])
@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.stem)
def test_validate_and_the_run_prestart_check_agree(preset, gpus_here, capsys, monkeypatch, tmp_path):
    """A machine with 64 GPUs also holds the presets' hub models in its cache; one without GPUs has
    an empty cache."""
    monkeypatch.setattr(machine, "local_gpu_count", lambda: gpus_here)
    held = tmp_path / "snapshot"
    held.mkdir()
    (held / "tokenizer.json").write_text("{}")
    monkeypatch.setattr(machine, "cached_snapshot", lambda path: held if gpus_here else None)
    monkeypatch.setitem(sys.modules, "ray", None)  # nothing here may start (or import) Ray
    code, validated, _ = run_validate(preset, capsys, "--here")
    prestart = run_prestart(preset)
    assert validated == prestart
    assert (code == 0) == (prestart == [])
    raw, base = load_spec_dict(str(preset), [])
    spec = validate_spec(raw, base_dir=base)
    on_gpus = spec.cluster.address is None and any(r.gpus for r in spec.trained_roles().values())
    if gpus_here == 64:
        assert code == 0, validated  # every preset runs on a machine with the GPUs it asks for
    elif on_gpus:  # a GPU preset on a machine without GPUs fails the machine checks, and only them
        uncached = ["model.path"] if HUB_ID.match(spec.model.path) else []
        assert [line.split(":")[0] for line in validated] == ["cluster.address", *uncached]
        assert "set cluster.address to run on a GPU cluster" in validated[0]
    # without --here the spec alone is judged: every preset is valid, the machine a note
    plain, problems, out = run_validate(preset, capsys)
    assert (plain, problems) == (0, [])
    assert out.startswith(f"ok: {spec.name} is valid")
    assert ("refuse it here): cluster.address: the spec asks for" in out) == (on_gpus and gpus_here == 0)

