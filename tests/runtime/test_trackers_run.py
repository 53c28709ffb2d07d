"""A ``logging:`` entry that cannot start stops ``relax run`` once, at once, with exit 1 and a
message naming the entry, before any worker starts (the working run is in test_export.py)."""

from __future__ import annotations

import io

def test_a_logger_that_cannot_start_fails_the_run_before_any_worker(tmp_path, loggers_registered, capsys):
    from relax.runtime.driver.launch import run_spec
    from relax.testing import local_ray, tiny_spec

    spec, plan, base = tiny_spec(tmp_path, "bad", "logging=[{name: tensorboard}, "
                                 "{name: mlflow, options: {tracking_uri: 'nosuchscheme://x'}}]")
    with local_ray():
        code = run_spec(spec, plan, base_dir=base, stream=io.StringIO())
    err = capsys.readouterr().err
    assert code == 1
    assert "logging[1] ('mlflow') could not start" in err and "nosuchscheme" in err
    out = tmp_path / "bad"
    assert not (out / "workers.json").exists()  # no worker was started
    assert not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text()
    assert (out / "tensorboard").is_dir()  # the first logger started, and was closed again
