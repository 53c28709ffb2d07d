"""Hostile-input catalogue, second round (issue 43).

- Interpolation bombs on both load paths (plain file, ``extends`` with an override), a time bomb
  of empty values, a cycle, ``oc.decode`` of text that makes interpolations.
- Chat-template bombs (memory, time, nesting, doubling, recursion, padding) at validate time and
  at render time, and a model's own template bomb met by the rollout and by an agent.
- The lower items: a remote reward's oversized answer, a bad or code-holding ``optimizer.pt``, a
  half-written metrics row under ``relax report``, an unwritable ``output_dir``, an earlier run
  folder holding the run's own data, one failed worker of three roles counting one restart, and a
  full disk (``/dev/full``) under metrics and checkpoints. The reward that calls ``os._exit`` is the
  ``reward_exits`` probe of tests/hostile/test_failure_causes.py (faults lane: it runs a run).

The CLI cases run ``python -m relax`` in a child process under a 2 GiB address-space limit
(``RLIMIT_AS``) and a generous wall-clock timeout: a blow-up fails the test instead of eating the
machine, and a hang fails it instead of hanging the suite. What must come back is exit 2 and a
message naming the key or the file, with no traceback."""

from __future__ import annotations

import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

from relax.chat_templates import TemplateBoundError, render

ROOT = Path(__file__).resolve().parents[2]
MEMORY_LIMIT = 2 * 1024**3


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def validate(folder: Path, *args: str, timeout: float = 60) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "relax", "validate", *args], cwd=folder, capture_output=True,
                          text=True, timeout=timeout, preexec_fn=_limit_memory)
    return done, time.monotonic() - started


def assert_refused(done: subprocess.CompletedProcess[str], *words: str) -> None:
    out = done.stdout + done.stderr
    assert done.returncode == 2, out
    assert "Traceback" not in out and "MemoryError" not in out and "RecursionError" not in out, out
    for word in words:
        assert word in out, (word, out)


def nested_bomb(levels: int = 12, fanout: int = 10, first: str = "x" * 10) -> list[str]:
    """``a1: ${a0}${a0}...``, each level ``fanout`` references to the one before (10**12 lookups)."""
    lines = [f"a0: '{first}'"]
    lines += [f"a{i}: '" + f"${{a{i - 1}}}" * fanout + "'" for i in range(1, levels + 1)]
    return lines


# --- interpolation ---------------------------------------------------------------------------------

def test_a_nested_interpolation_bomb_without_extends_is_refused(tmp_path):
    (tmp_path / "bomb.yaml").write_text("\n".join(["name: bomb", *nested_bomb()]) + "\n")
    done, _ = validate(tmp_path, "bomb.yaml")
    assert_refused(done, "a4:", "lookups")  # the first key past the budget is named


def test_a_flat_bomb_on_the_plain_path_is_refused_unbuilt(tmp_path):
    """No omegaconf: one long value named 100000 times (10 GB once joined)."""
    (tmp_path / "bomb.yaml").write_text("name: b\na: " + "x" * 100_000 + "\nb: '" + "${a}" * 100_000 + "'\n")
    done, _ = validate(tmp_path, "bomb.yaml")
    assert_refused(done, "b:", "10000000000 characters")


def test_a_time_bomb_of_empty_values_is_refused(tmp_path):
    """Nothing grows, but omegaconf resolves without memoising: 10**12 lookups of ''."""
    (tmp_path / "bomb.yaml").write_text("\n".join(["name: bomb", *nested_bomb(first="")]) + "\n")
    done, _ = validate(tmp_path, "bomb.yaml")
    assert_refused(done, "lookups")


def test_an_interpolation_bomb_through_extends_and_an_override_is_refused(tmp_path):
    (tmp_path / "bomb.yaml").write_text("\n".join(["extends: tiny-cpu", *nested_bomb(levels=3)]) + "\n")
    override = "a4=" + "${a3}" * 10  # the override adds the level that goes past the budget
    done, _ = validate(tmp_path, "bomb.yaml", f"+{override}")
    assert_refused(done, "a4:", "lookups")


def test_an_interpolation_cycle_is_named(tmp_path):
    (tmp_path / "cycle.yaml").write_text("extends: tiny-cpu\nx: ${y}-\ny: ${x}+\n")
    done, _ = validate(tmp_path, "cycle.yaml")
    assert_refused(done, "refer back to themselves", "y -> x -> y")


def test_decode_of_text_that_makes_interpolations_is_refused(tmp_path):
    (tmp_path / "decode.yaml").write_text("extends: tiny-cpu\na: x\nb: \"${oc.decode:'\\\\${a}\\\\${a}'}\"\n")
    done, _ = validate(tmp_path, "decode.yaml")
    assert_refused(done, "b:", "oc.decode")


def test_an_ordinary_interpolating_spec_still_loads(tmp_path):
    (tmp_path / "ok.yaml").write_text("extends: tiny-cpu\nname: ok-${trainer.steps}\n")
    done, _ = validate(tmp_path, "ok.yaml")
    assert done.returncode == 0, done.stdout + done.stderr


# --- chat templates --------------------------------------------------------------------------------

TEMPLATE_BOMBS = {
    "memory": ("{{ 'x' * 2000000000 }}", "'*' would make"),
    "time": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
             "takes more than"),
    "nesting": ("{% if 1 %}" * 500 + "x" + "{% endif %}" * 500, "nest more than"),
    "doubling": ("{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}"
                 "{% endfor %}{{ ns.s }}", "more than"),
    "recursion": ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "recurses too deeply"),
    "padding": ("{{ 'x'|center(2000000000) }}", "asks for 2000000000"),
}


@pytest.mark.parametrize("name", sorted(TEMPLATE_BOMBS))
def test_a_chat_template_bomb_is_refused_at_validate(tmp_path, name):
    source, words = TEMPLATE_BOMBS[name]
    (tmp_path / "bomb.jinja").write_text(source)
    done, _ = validate(tmp_path, "tiny-cpu", f"data.chat_template={tmp_path / 'bomb.jinja'}")
    assert_refused(done, "data.chat_template", "bomb.jinja is refused", words)


@pytest.mark.parametrize("name", sorted(TEMPLATE_BOMBS))
def test_a_chat_template_bomb_is_refused_at_render(name):
    """The run renders in process: the sandbox's hooks alone must stop each bomb, in bounded time."""
    source, _ = TEMPLATE_BOMBS[name]
    started = time.monotonic()
    with pytest.raises(TemplateBoundError):
        render(source, messages=[{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert time.monotonic() - started < 30


def test_a_model_style_template_renders_as_transformers_does():
    source = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    text = render(source, messages=[{"role": "user", "content": "2+2?"}], add_generation_prompt=True)
    assert text == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"


# --- the lower items -------------------------------------------------------------------------------

def test_a_huge_remote_reward_answer_is_refused_unread():
    """A service answering 64 MB: only max_answer_bytes + 1 are read, and the error names the option."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from relax.contracts import RewardSample
    from relax.registry import get_registry
    from relax_plugins.rewards.remote import RemoteRewardError

    sent = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Length", str(64 * 1024 * 1024))
            self.end_headers()
            chunk = b" " * (1024 * 1024)
            try:
                for _ in range(64):
                    self.wfile.write(chunk)
                    sent.append(len(chunk))
            except (BrokenPipeError, ConnectionResetError):
                pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        registry = get_registry()
        options = {"url": f"http://127.0.0.1:{server.server_address[1]}/score", "max_answer_bytes": 1024 * 1024}
        remote = registry.load("rewards", "remote")(registry.build_config("rewards", "remote", options))
        with pytest.raises(RemoteRewardError, match="max_answer_bytes=1048576"):
            remote.score([RewardSample("1+1=", "2", "2", {"sample_id": "0:0:0"})])
    finally:
        server.shutdown()
        server.server_close()
    assert sum(sent) < 64 * 1024 * 1024  # the client stopped reading: the rest never had to be sent


def test_the_default_answer_cap_is_documented():
    from relax_plugins.rewards.remote import RemoteReward

    assert RemoteReward.Config().max_answer_bytes == 4 * 1024 * 1024
    assert "max_answer_bytes" in (ROOT / "docs" / "security.md").read_text()


@pytest.mark.parametrize("content", [b"not a zip and not a pickle", b"\x80\x04\x95"])
def test_a_bad_optimizer_file_is_named(tmp_path, content):
    from relax_plugins.trainer.torch_trainer import _load_optimizer_state

    bad = tmp_path / "ckpt" / "optimizer.pt"
    bad.parent.mkdir()
    bad.write_bytes(content)
    with pytest.raises(ValueError) as caught:
        _load_optimizer_state(bad, "cpu")
    assert str(bad) in str(caught.value) and "Delete it" in str(caught.value)


def test_an_optimizer_file_holding_code_is_refused_without_running_it(tmp_path):
    import torch

    from relax_plugins.trainer.torch_trainer import _load_optimizer_state

    marker = tmp_path / "ran"
    bad = tmp_path / "optimizer.pt"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    torch.save({"state": Payload()}, bad)
    with pytest.raises(ValueError, match="optimizer.pt is not an optimizer state"):
        _load_optimizer_state(bad, "cpu")
    assert not marker.exists()


def test_report_skips_a_half_written_last_row(tmp_path):
    import json

    from relax.runtime.driver.report import write_report

    row = {"step": 1, "reward/mean": 0.5, "time/step_s": 1.0, "time/rollout_s": 0.5, "time/train_s": 0.4,
           "time/wait_s": 0.0, "time/weight_sync_s": 0.1}
    full = json.dumps(row) + "\n" + json.dumps({**row, "step": 2}) + "\n"
    (tmp_path / "metrics.jsonl").write_text(full + json.dumps({**row, "step": 3})[:37])  # cut by a full disk
    done = subprocess.run([sys.executable, "-m", "relax", "report", str(tmp_path)], capture_output=True,
                          text=True, timeout=120, preexec_fn=_limit_memory)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "report.png").stat().st_size > 0
    assert write_report(tmp_path, tmp_path / "again.png").is_file()


def relax_run(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "relax", "run", *args], cwd=folder, capture_output=True, text=True,
                          timeout=120, preexec_fn=_limit_memory)


def test_an_output_dir_that_cannot_be_written_is_exit_2_naming_it(tmp_path):
    (tmp_path / "afile").write_text("not a folder\n")
    (tmp_path / "run.yaml").write_text(f"extends: tiny-cpu\ntrainer: {{output_dir: {tmp_path}/afile/out, steps: 1}}\n")
    done = relax_run(tmp_path, "run.yaml")
    out = done.stdout + done.stderr
    assert done.returncode == 2 and "Traceback" not in out, out
    assert f"trainer.output_dir {tmp_path}/afile/out cannot be written" in out


def test_an_earlier_run_folder_holding_this_runs_data_is_not_renamed(tmp_path):
    from relax.runtime.driver.launch import RUN_MARKER

    old = tmp_path / "runs" / "old"
    old.mkdir(parents=True)
    (old / RUN_MARKER).write_text("{}\n")
    data = old / "prompts.jsonl"
    data.write_text("".join(f'{{"prompt": "{i}+1=", "answer": "{i + 1}"}}\n' for i in range(8)))
    (tmp_path / "run.yaml").write_text("extends: tiny-cpu\ndata: {train: {source: runs/old/prompts.jsonl}}\n"
                                       "trainer: {output_dir: runs/old, steps: 1}\n")
    done = relax_run(tmp_path, "run.yaml")
    out = done.stdout + done.stderr
    assert done.returncode == 2, out
    assert f"data.train.source {data}, an input of this run" in out and "will not rename" in out
    assert data.is_file() and (old / RUN_MARKER).is_file() and not (tmp_path / "runs" / "old.1").exists()


def test_one_failed_worker_holding_three_roles_counts_one_restart():
    """A worker holding actor, reference and actor_fwd charges each role's budget, but the run
    recovered once: ``faults/restarts`` (``recoveries``) is 1, not 3."""
    import contextlib
    from types import SimpleNamespace

    from relax.runtime.driver.recovery import Recovery
    from relax.runtime.driver.supervisor import Attempt, Supervisor

    budget = SimpleNamespace(max_restarts=3)
    spans = []

    class Telemetry:
        @contextlib.contextmanager
        def span(self, name, **attributes):
            spans.append(attributes)
            yield

    faults = SimpleNamespace(roles=SimpleNamespace(actor=budget, reference=budget, actor_fwd=budget))
    events: list = []
    attempt = Attempt()
    Recovery(Supervisor(faults), Telemetry(), events).charge(
        attempt, ["actor", "reference", "actor_fwd"], "its process died (ActorDiedError)", "resume", "trainer")
    assert attempt.recoveries == 1 and spans[-1]["restarts"] == 1 and len(events) == 1
    assert attempt.restarts == {"actor": 1, "reference": 1, "actor_fwd": 1}
    controller = (ROOT / "relax" / "runtime" / "driver" / "controller.py").read_text()
    assert '"faults/restarts": attempt.recoveries' in controller


def test_a_full_disk_under_metrics_stops_naming_the_file(tmp_path):
    """metrics.jsonl on a full disk (``/dev/full`` answers every write with ENOSPC): the error names
    the file and says disk full, and the failure class says a retry would repeat it (no resume)."""
    from relax.runtime.failure_class import DiskFull, repeats_on_retry
    from relax.runtime.metrics import MetricsLog

    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full on this system")
    log = MetricsLog(tmp_path, None)
    log.path.unlink(missing_ok=True)
    log.path.symlink_to("/dev/full")
    with pytest.raises(DiskFull) as caught:
        log.append({"step": 3, "reward/mean": 0.5})
    assert str(log.path) in str(caught.value) and "disk full" in str(caught.value)
    assert repeats_on_retry(caught.value)


def test_a_full_disk_while_checkpointing_is_not_retried(tmp_path):
    from relax.runtime.checkpoint import save_checkpoint
    from relax.runtime.failure_class import DiskFull
    from relax.runtime.worker.workers import role_failure

    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full on this system")

    class Trainer:
        def save(self, path: str) -> None:
            Path(path).mkdir(parents=True)
            with open("/dev/full", "w") as out:  # the disk fills while the weights are written
                out.write("x" * 65536)

    with pytest.raises(DiskFull) as caught:
        save_checkpoint(tmp_path, 3, Trainer(), keep=2)
    assert "checkpoints" in str(caught.value) and "step 3" in str(caught.value) and "disk full" in str(caught.value)
    failure = role_failure("actor", caught.value)
    assert failure.stops_run and "disk full" in failure.headline
    assert not list((tmp_path / "checkpoints").glob("step-*"))  # nothing half-written is left as a checkpoint


def test_a_bare_enospc_is_worded_as_a_full_disk():
    import errno

    from relax.runtime.worker.workers import role_failure

    failure = role_failure("actor step 3", OSError(errno.ENOSPC, "No space left on device"))
    assert failure.stops_run and "disk full" in failure.headline


class _BombTokenizer:
    """A tokenizer whose own (``auto``) chat template is a memory bomb."""

    chat_template = "{{ messages[0].content * 2000000000 }}"
    special_tokens_map: dict = {}


def test_a_model_template_bomb_is_named_at_run_time_by_the_rollout():
    from relax_plugins.rollout.chat_template import PromptEncoder

    encoder = PromptEncoder(_BombTokenizer(), "auto", 64)
    started = time.monotonic()
    with pytest.raises(ValueError, match=r"the chat template \(the tokenizer's own, data.chat_template: auto\)"):
        encoder.render("2+2=")
    assert time.monotonic() - started < 30


def test_a_model_template_bomb_is_named_at_run_time_by_an_agent():
    from relax.agents.chat import ChatTokens, TemplateError

    with pytest.raises(TemplateError, match="the model's chat template is refused"):
        ChatTokens(_BombTokenizer(), [])
