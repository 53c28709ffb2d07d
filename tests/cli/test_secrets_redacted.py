"""Secrets stay secret: a credential taken from the environment (``${oc.env:...}``) or held under a
key named for it is never shown by ``relax config`` / ``relax plan`` / a validation message, nor
written to ``spec.yaml`` / ``plan.json`` / a tracker's config; the runtime still gets the value, and
a written ``spec.yaml`` resolves again from the environment. (The run-folder grep of a real run
with a judge service is in tests/runtime/test_offline_trackers.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from relax.config import load_spec
from relax.config.redaction import REDACTED, attach, is_secret_name, spec_view
from relax.spec import validate_spec
from relax.errors import SpecError

SECRET = "s3cr3t-judge-key-0123456789"
SPEC = """extends: tiny-cpu
name: judged
rewards:
  - name: exact_match
  - name: remote
    weight: 0.5
    options:
      url: http://127.0.0.1:9/score
      headers:
        X-Api-Key: ${oc.env:JUDGE_KEY}
        Authorization: Bearer ${oc.env:JUDGE_KEY}
        X-Source: relax
"""


def _spec_file(tmp_path: Path, text: str = SPEC) -> Path:
    path = tmp_path / "judged.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("name,secret", [
    ("token", True), ("hf_token", True), ("X-Api-Key", True), ("Authorization", True), ("api_key", True),
    ("openai_api_key", True), ("client_secret", True), ("password", True), ("Cookie", True), ("apikey", True),
    ("prompt_key", False), ("label_key", False), ("reward_key", False), ("media_keys", False), ("key", False),
    ("max_tokens", False), ("token_env", False), ("headers_env", False), ("pad_token", False), ("url", False),
])
def test_the_name_rule(name, secret):
    assert is_secret_name(name) is secret


def test_env_values_are_shown_as_their_expressions_and_the_runtime_gets_the_values(tmp_path, monkeypatch):
    monkeypatch.setenv("JUDGE_KEY", SECRET)
    loaded = load_spec(_spec_file(tmp_path))
    headers = loaded.raw["rewards"][1]["options"]["headers"]
    assert headers["X-Api-Key"] == SECRET and headers["Authorization"] == f"Bearer {SECRET}"
    spec = attach(validate_spec(loaded.raw, base_dir=loaded.base_dir), loaded.redactions)
    shown = spec_view(spec)
    assert shown["rewards"][1]["options"]["headers"] == {
        "X-Api-Key": "${oc.env:JUDGE_KEY}", "Authorization": "Bearer ${oc.env:JUDGE_KEY}", "X-Source": "relax"}
    assert SECRET not in json.dumps(shown)
    assert spec.rewards[1].options["headers"]["X-Api-Key"] == SECRET  # the spec itself is untouched


def test_a_literal_credential_is_redacted_and_such_a_spec_is_refused(tmp_path):
    literal = SPEC.replace("${oc.env:JUDGE_KEY}", "literal-key-value")
    loaded = load_spec(_spec_file(tmp_path, literal))
    spec = attach(validate_spec(loaded.raw, base_dir=loaded.base_dir), loaded.redactions)
    headers = spec_view(spec)["rewards"][1]["options"]["headers"]
    assert headers == {"X-Api-Key": REDACTED, "Authorization": REDACTED, "X-Source": "relax"}
    (tmp_path / "again.yaml").write_text(yaml.safe_dump(spec_view(spec)))
    with pytest.raises(SpecError, match=r"rewards\[1\]\.options\.headers\.(X-Api-Key|Authorization): holds <redacted>") as caught:
        load_spec(tmp_path / "again.yaml")
    assert "headers_env" in str(caught.value)


def test_config_plan_and_messages_never_print_the_value(relax, tmp_path):
    path = _spec_file(tmp_path)
    env = {"JUDGE_KEY": SECRET}
    config = relax("config", str(path), env_vars=env)
    assert config.returncode == 0, config.stderr
    assert SECRET not in config.stdout and "${oc.env:JUDGE_KEY}" in config.stdout
    for fmt in ("json", "table"):
        plan = relax("plan", str(path), "--format", fmt, env_vars=env)
        assert plan.returncode == 0, plan.stderr
        assert SECRET not in plan.stdout
    plan = json.loads(relax("plan", str(path), "--format", "json", env_vars=env).stdout)
    assert "${oc.env:JUDGE_KEY}" in json.dumps(plan)
    bad = relax("validate", str(path), "rewards.1.options.timeout_s=${oc.env:JUDGE_KEY}", env_vars=env)
    assert bad.returncode == 2 and "timeout_s" in bad.stderr
    assert SECRET not in bad.stdout + bad.stderr


def test_a_written_spec_yaml_repeats_the_run_from_the_environment(tmp_path, monkeypatch):
    from relax.plan import make_plan
    from relax.runtime.driver.launch import resume_mismatch, write_run_record

    monkeypatch.setenv("JUDGE_KEY", SECRET)
    loaded = load_spec(_spec_file(tmp_path))
    spec = attach(validate_spec(loaded.raw, base_dir=loaded.base_dir), loaded.redactions)
    out = tmp_path / "run"
    write_run_record(out, spec, make_plan(spec, base_dir=loaded.base_dir))
    for name in ("spec.yaml", "plan.json"):
        text = (out / name).read_text()
        assert SECRET not in text and "${oc.env:JUDGE_KEY}" in text, name
    again = load_spec(out / "spec.yaml")
    assert again.raw["rewards"][1]["options"]["headers"]["X-Api-Key"] == SECRET
    assert resume_mismatch(out, spec) == []


def test_the_trackers_get_the_redacted_config(tmp_path, monkeypatch, loggers_registered):
    from relax.runtime.driver.trackers import Trackers

    monkeypatch.setenv("JUDGE_KEY", SECRET)
    spec_text = SPEC + "logging:\n  - name: tensorboard\n    options: {text: true}\n"
    loaded = load_spec(_spec_file(tmp_path, spec_text))
    spec = attach(validate_spec(loaded.raw, base_dir=loaded.base_dir), loaded.redactions)
    trackers = Trackers.from_spec(spec, tmp_path / "out")
    trackers.close("finished")
    events = b"".join(p.read_bytes() for p in (tmp_path / "out" / "tensorboard").rglob("*") if p.is_file())
    assert b"oc.env:JUDGE_KEY" in events and SECRET.encode() not in events


def test_headers_env_reads_the_value_where_the_reward_runs(monkeypatch):
    from relax_plugins.rewards.remote import RemoteReward, RemoteRewardError

    monkeypatch.setenv("JUDGE_KEY", SECRET)
    reward = RemoteReward(RemoteReward.Config(headers_env={"X-Api-Key": "JUDGE_KEY"}))
    assert reward.headers["X-Api-Key"] == SECRET
    monkeypatch.delenv("JUDGE_KEY")
    with pytest.raises(RemoteRewardError, match=r"JUDGE_KEY \(options.headers_env.X-Api-Key\) is not set"):
        RemoteReward(RemoteReward.Config(headers_env={"X-Api-Key": "JUDGE_KEY"}))
    with pytest.raises(ValueError, match="both set"):
        RemoteReward.Config(headers={"x-api-key": "a"}, headers_env={"X-Api-Key": "JUDGE_KEY"})
