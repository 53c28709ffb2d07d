"""Samples and the health figures, without a run: which rows a sampled step keeps, how a row is
built and shown (the console line, ``relax samples``), samples.jsonl on resume, the loggers'
optional ``log_samples`` hook, the figures every metrics row has, and the one-time hint when an
agentic run's trajectories all truncate."""

from __future__ import annotations

import io
import json
import re

import pytest

from relax.agents.outcomes import INFRA_OUTCOMES, OUTCOMES
from relax.contracts import PluginKind
from relax.registry import PluginEntry, PluginError, check_contract
from relax.runtime.driver.trackers import Trackers
from relax.runtime.driver.truncation_hint import TRUNCATED_FRAC, TruncationHint, truncation_hint
from relax.runtime.metrics import PLAIN_WIDTH, Progress, health_figures
from relax.runtime.samples import (
    CUT,
    SAMPLES_FILE,
    TEXT_CHARS,
    SamplesError,
    SamplesLog,
    agent_outcome,
    choose_rows,
    console_line,
    due,
    format_sample,
    read_samples,
    sample_row,
    worst_rows,
)
from relax.spec.models import AgentSpec

# -- which steps, which rows ---------------------------------------------------------------------


def test_a_step_is_sampled_every_n_steps_and_never_with_0():
    assert [s for s in range(1, 11) if due(s, 3)] == [3, 6, 9]
    assert [s for s in range(1, 5) if due(s, 1)] == [1, 2, 3, 4]
    assert not any(due(s, 0) for s in range(1, 20))


def test_the_kept_rows_are_the_first_the_best_the_worst_and_the_middle_in_batch_order():
    rewards = [0.5, 0.0, 1.0, 0.2, 0.9, 0.1, 0.3, 0.4]
    chosen = choose_rows(rewards, 4)
    assert chosen == sorted(chosen) and len(set(chosen)) == 4
    assert 0 in chosen  # the first row
    assert 2 in chosen  # the best (1.0)
    assert 1 in chosen  # the worst (0.0)
    assert choose_rows(rewards, 2) == [0, 2]  # the first and the best
    assert choose_rows(rewards, 1) == [0]
    assert choose_rows(rewards, 3) == [0, 1, 2]  # first, best, worst


def test_a_small_step_keeps_every_row_and_nothing_is_chosen_from_nothing():
    assert choose_rows([0.1, 0.2], 4) == [0, 1]
    assert choose_rows([], 4) == []
    assert choose_rows([1.0, 2.0], 0) == []


def test_equal_rewards_still_give_distinct_rows():
    assert choose_rows([1.0] * 16, 4) == [0, 1, 8, 15]


# -- a row --------------------------------------------------------------------------------------


def test_a_row_holds_its_texts_rewards_and_version_and_long_texts_are_cut():
    row = sample_row(6, "2+2=", "4" * (TEXT_CHARS + 50), 4, 1.5, {"exact": 1.0, "format": 0.5, "judge": None},
                     {"sample_id": "5:1:0", "policy_version": 5, "response_tokens": 9, "trace": {"x": "y"}})
    assert row["step"] == 6 and row["sample_id"] == "5:1:0" and row["policy_version"] == 5
    assert row["prompt"] == "2+2=" and row["label"] == "4" and row["response_tokens"] == 9
    assert row["response"].endswith(CUT) and len(row["response"]) == TEXT_CHARS + len(CUT)
    assert row["reward"] == 1.5 and row["reward/exact"] == 1.0 and row["reward/format"] == 0.5
    assert "reward/judge" not in row  # not routed to that reward
    assert "trace" not in row and "outcome" not in row
    json.dumps(row)  # a JSON line as it is


def test_an_agentic_row_says_its_turns_calls_observations_and_how_it_ended():
    summary = {"outcome": "truncated", "turns": 3, "tool_calls": 2, "truncated": True,
               "calls": ['calc({"expression": "2+3"})'], "observations": ["5", "x" * 1000]}
    row = sample_row(2, "p", "r", None, 0.0, {}, {"agent": summary})
    assert row["turns"] == 3 and row["tool_calls"] == 2 and row["outcome"] == "truncated"
    assert row["calls"] == ['calc({"expression": "2+3"})'] and row["label"] is None
    assert row["observations"][0] == "5" and row["observations"][1].endswith(CUT)
    assert "error" not in row


@pytest.mark.parametrize("outcome", OUTCOMES)
def test_the_row_names_the_trajectorys_typed_outcome_and_relax_samples_prints_it(outcome, tmp_path, capsys):
    from relax.agents.trajectory import Trajectory
    from relax.cli import main

    failed = outcome in INFRA_OUTCOMES
    traj = Trajectory(prompt_ids=[1], truncated=outcome == "truncated", tool_errors=int(outcome == "tool_error"),
                      error="environment 'calc': step raised KeyError: 'x'" + "!" * 500 if failed else None,
                      failure=outcome if failed else None)
    assert traj.outcome == outcome  # the runner's own summary, as the scorer receives it
    row = sample_row(3, "p", "r", None, 0.0, {}, {"agent": traj.summary(detail=True)})
    assert row["outcome"] == outcome == agent_outcome(traj.summary())
    if failed:
        assert row["error"].startswith("environment 'calc': step raised KeyError") and row["error"].endswith(CUT)
        assert row["cause"] == outcome
    else:
        assert "error" not in row and "cause" not in row
    SamplesLog(tmp_path, None).append([row])
    assert main(["samples", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"  outcome: {outcome}  turns 0  tool calls 0" in out
    assert ("  error: environment 'calc': step raised KeyError" in out) == failed
    assert console_line(row, 120).startswith(f"sample reward 0.000 {outcome} after 0 turn(s)")


def test_rows_written_before_outcomes_were_typed_still_print():
    old = {"step": 1, "sample_id": "0:0:0", "policy_version": 0, "reward": 0.0, "turns": 1, "tool_calls": 0,
           "outcome": "failed: environment 'calc': start timed out"}
    assert "outcome: failed: environment 'calc': start timed out  turns 1" in format_sample(old)
    assert console_line(old, 100).startswith("sample reward 0.000 failed after 1 turn(s)")


# -- samples.jsonl --------------------------------------------------------------------------------


def _rows(step: int, rewards: list[float]) -> list[dict]:
    return [sample_row(step, f"prompt {step}.{i}", f"response {step}.{i}", "l", r, {"exact": r},
                       {"sample_id": f"{step - 1}:{i}:0", "policy_version": step - 1}) for i, r in enumerate(rewards)]


def test_samples_jsonl_keeps_the_rows_up_to_the_checkpoint_on_resume(tmp_path):
    log = SamplesLog(tmp_path, None)
    for step in (2, 4, 6):
        log.append(_rows(step, [0.5, 1.0]))
    with (tmp_path / SAMPLES_FILE).open("a") as out:
        out.write('{"step": 8, "prompt": "cut sho')  # a crash in the middle of a line
    SamplesLog(tmp_path, 4)  # resumed from the checkpoint of step 4
    assert [r["step"] for r in read_samples(tmp_path)] == [2, 2, 4, 4]
    SamplesLog(tmp_path, None)  # a fresh run starts a fresh file
    assert not (tmp_path / SAMPLES_FILE).exists()


def test_the_worst_rows_are_the_lowest_rewards_first():
    rows = _rows(2, [0.5, 0.1, 0.9]) + _rows(4, [0.1, 0.7])
    worst = worst_rows(rows, 3)
    assert [(r["step"], r["reward"]) for r in worst] == [(2, 0.1), (4, 0.1), (2, 0.5)]
    assert worst_rows(rows, 0) == [] and len(worst_rows(rows, 10)) == 5


def test_reading_samples_of_a_folder_that_is_not_a_run_says_what_is_wrong(tmp_path):
    with pytest.raises(SamplesError, match="is not a folder"):
        read_samples(tmp_path / "nope")
    with pytest.raises(SamplesError, match="samples.jsonl does not exist.*log_samples_every"):
        read_samples(tmp_path)


def test_relax_samples_prints_the_rows_and_refuses_bad_input_with_exit_2(tmp_path, capsys):
    from relax.cli import main

    SamplesLog(tmp_path, None).append(_rows(2, [0.5, 0.25]) + _rows(4, [1.0, 0.0]))
    assert main(["samples", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.count("step ") == 4 and "prompt 2.0" in out and "response 4.1" in out
    assert main(["samples", str(tmp_path), "--step", "4", "--worst", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("step 4  sample 3:1:0  policy v3  reward 0.000 (exact 0.000)")
    assert "prompt 2." not in out and "response 4.0" not in out
    assert main(["samples", str(tmp_path), "--step", "3"]) == 2
    assert "no samples of step 3; its sampled steps are 2, 4" in capsys.readouterr().err
    assert main(["samples", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not a folder" in err
    assert main(["samples", str(tmp_path), "--worst", "0"]) == 2
    assert "--worst 0" in capsys.readouterr().err


def test_format_sample_shows_the_agents_outcome_calls_and_observations():
    row = sample_row(2, "p", "final", None, 1.0, {}, {"agent": {"turns": 2, "tool_calls": 1, "calls": ["calc({})"],
                                                               "observations": ["line one\nline two"]}})
    text = format_sample(row)
    assert "outcome: ok  turns 2  tool calls 1" in text
    assert "call 1: calc({})" in text and "observation 1: line one line two" in text


# -- the console ----------------------------------------------------------------------------------


def test_the_console_line_is_one_line_within_its_width():
    row = sample_row(4, "What is\n2+2?", "It is 4.\n" * 100, "4", 1.0, {}, {})
    line = console_line(row, 100)
    assert "\n" not in line and len(line) <= 100
    assert line.startswith("sample reward 1.000  prompt: 'What is 2+2?'  response: 'It is 4. It is 4.")
    assert line.endswith("…'")
    short = console_line(sample_row(4, "1+1=", "2", "2", 1.0, {}, {}), 100)
    assert short == "sample reward 1.000  prompt: '1+1='  response: '2'"
    agentic = console_line(sample_row(4, "p", "r", None, 0.0, {}, {"agent": {"outcome": "truncated", "turns": 4,
                                                                                 "truncated": True}}), 100)
    assert agentic.startswith("sample reward 0.000 truncated after 4 turn(s)")


def test_progress_prints_a_sample_as_a_plain_line():
    out = io.StringIO()
    progress = Progress(4, out)
    progress.sample(sample_row(2, "1+1=", "2 " * 500, "2", 0.0, {}, {}))
    progress.note(2, "HINT: something")
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("[relax] step 2: sample reward 0.000  prompt: '1+1='") and len(lines[0]) <= PLAIN_WIDTH
    assert lines[1] == "[relax] step 2: HINT: something"


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_prints_a_sample_above_the_live_bar_on_a_terminal(monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")
    out = _Terminal()
    progress = Progress(4, out)
    row = {"step": 2, "reward/mean": 0.5, "staleness/max": 0, "throughput/tokens_per_s": 10.0, "time/step_s": 0.1,
           "time/rollout_s": 0.05, "time/train_s": 0.04, "time/weight_sync_s": 0.0, "time/wait_s": 0.0}
    progress.update(row)
    progress.sample(sample_row(2, "1+1=", "two " * 200, "2", 1.0, {}, {}))
    progress.close()
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.getvalue())  # the terminal's control codes
    sample = next(line for line in text.splitlines() if "sample reward" in line)
    assert "[relax] step 2: sample reward 1.000  prompt: '1+1='" in sample
    assert len(sample.rstrip()) <= 120


# -- the loggers' optional hook ---------------------------------------------------------------------


class _Plain:
    """A third-party logger written before samples existed: metrics only."""

    def __init__(self) -> None:
        self.rows: list = []
        self.closed = None

    def log(self, step, metrics):
        self.rows.append(step)

    def close(self, status):
        self.closed = status


class _WithSamples(_Plain):
    def __init__(self, fail: bool = False) -> None:
        super().__init__()
        self.samples: list = []
        self.fail = fail

    def log_samples(self, step, rows):
        if self.fail:
            raise OSError("disk full")
        self.samples.append((step, rows))


def test_trackers_give_samples_only_to_loggers_that_take_them_and_drop_one_that_fails():
    err = io.StringIO()
    plain, taking, failing = _Plain(), _WithSamples(), _WithSamples(fail=True)
    trackers = Trackers([("logging[0] ('plain')", plain), ("logging[1] ('taking')", taking),
                         ("logging[2] ('failing')", failing)], stream=err)
    rows = _rows(2, [1.0])
    trackers.log({"step": 2, "reward/mean": 1.0})
    trackers.log_samples(2, rows)
    assert taking.samples == [(2, rows)] and plain.rows == [2]
    assert failing.closed == "failed" and "logging[2] ('failing') failed on the samples of step 2" in err.getvalue()
    trackers.log({"step": 3, "reward/mean": 1.0})
    assert failing.rows == [2] and plain.rows == [2, 3]  # the failed one gets nothing more
    trackers.close("finished")
    assert plain.closed == "finished" and taking.closed == "finished"


def test_the_contract_takes_a_logger_with_or_without_log_samples_but_not_a_wrong_one():
    from pydantic import BaseModel

    entry = PluginEntry(PluginKind.loggers, "x", "tests:X", "tests", "0")

    class Base:
        class Config(BaseModel):
            pass

        def __init__(self, config, run):
            pass

        def log(self, step, metrics):
            pass

        def close(self, status):
            pass

    class Good(Base):
        def log_samples(self, step, rows):
            pass

    class Wrong(Base):
        def log_samples(self, rows):
            pass

    check_contract(PluginKind.loggers, entry, Base)
    check_contract(PluginKind.loggers, entry, Good)
    with pytest.raises(PluginError, match=r"defines `log_samples` but not as .*log_samples\(self, step, rows\)"):
        check_contract(PluginKind.loggers, entry, Wrong)


# -- the figures every row has ----------------------------------------------------------------------


def test_health_figures_from_the_rollout_reward_and_trainer_reports():
    rollout = {"response_tokens": 30, "rollout_samples": 4, "response_tokens_max": 12, "clipped": 1,
               "prompt_tokens": 20}
    reward = {"reward_mean": 0.5, "reward_std": 0.25, "reward_min": 0.0, "reward_max": 1.0}
    got = health_figures(rollout, reward, {"entropy": 1.25})
    assert got == {"response_length/mean": 7.5, "response_length/max": 12, "response_length/clip_frac": 0.25,
                   "prompt_length/mean": 5.0, "reward/std": 0.25, "reward/min": 0.0, "reward/max": 1.0,
                   "entropy": 1.25}
    # a trainer that reports no entropy: the key is there, null
    assert health_figures(rollout, reward, {})["entropy"] is None


def test_length_figures_add_up_over_a_steps_units():
    from relax.contracts import Generation
    from relax.runtime.worker.roles.rollout import SampledBatch, lengths, merge_unit_stats

    def gen(prompt: int, response: int, finished: bool) -> Generation:
        return Generation(prompt_index=0, prompt_ids=[1] * prompt, response_ids=[2] * response,
                          logprobs=[0.0] * response, text="", finished=finished)

    plain = SampledBatch(rows=[], gens=[gen(3, 8, False), gen(3, 2, True)], meta=[{}, {}], order=[], generate_s=0.0)
    agentic = SampledBatch(rows=[], gens=[gen(5, 20, False), gen(5, 4, True)],
                           meta=[{"agent": {"truncated": False, "error": "boom"}}, {"agent": {"truncated": True}}],
                           order=[], generate_s=0.0)
    assert lengths(plain) == {"rollout_samples": 2, "prompt_tokens": 6, "response_tokens_max": 8, "clipped": 1}
    # agentic: the trajectory's truncation counts (a failed one is not truncated)
    assert lengths(agentic)["clipped"] == 1
    unit = {"admission_wait_s": 0.0, "weight_load_s": 0.0, "rollout_s": 0.0, "bus_s": 0.0, "policy_version": 0,
            "order": [], "holder": "a"}
    merged = merge_unit_stats([{**unit, "response_tokens": 10, **lengths(plain)},
                               {**unit, "response_tokens": 24, **lengths(agentic)}])
    assert merged["rollout_samples"] == 4 and merged["clipped"] == 2 and merged["prompt_tokens"] == 16
    assert merged["response_tokens_max"] == 20


def test_reward_spread_of_a_step():
    import torch

    from relax.runtime.worker.roles.reward import spread

    assert spread(torch.tensor([0.0, 1.0, 1.0, 0.0])) == {"reward_std": 0.5, "reward_min": 0.0, "reward_max": 1.0}
    assert spread(torch.tensor([])) == {"reward_std": 0.0, "reward_min": 0.0, "reward_max": 0.0}


# -- the truncation hint ----------------------------------------------------------------------------


def _agent_row(step: int, truncated: float, turns: float = 1.0, calls: float = 0.0) -> dict:
    return {"step": step, "agent/truncated_frac": truncated, "agent/turns_mean": turns,
            "agent/tool_calls_mean": calls}


def test_the_hint_names_the_likely_cause_and_the_field_to_change():
    agent = AgentSpec(environment="calculator", max_turns=4, max_new_tokens=8)
    no_calls = truncation_hint(_agent_row(1, 1.0, turns=1.0, calls=0.0), agent)
    assert "100% of the trajectories of step 1 ended truncated" in no_calls
    assert "made no tool call" in no_calls and "`calc`" in no_calls and "tool_call_format=hermes" in no_calls
    assert "roles.rollout.agent.max_new_tokens=8" in no_calls and "data.max_prompt_tokens" in no_calls
    all_turns = truncation_hint(_agent_row(3, 0.95, turns=4.0, calls=3.0), agent)
    assert "all roles.rollout.agent.max_turns=4 turns" in all_turns and "made no tool call" not in all_turns
    cut = truncation_hint(_agent_row(2, TRUNCATED_FRAC, turns=2.0, calls=1.0), AgentSpec(environment="calculator"))
    assert "roles.rollout.agent.max_new_tokens (null: roles.rollout.sampling.max_new_tokens)" in cut
    assert "max_tokens=512" in cut


def test_no_hint_when_most_trajectories_end_or_the_run_is_not_agentic():
    agent = AgentSpec(environment="calculator")
    assert truncation_hint(_agent_row(1, 0.5), agent) is None
    assert truncation_hint(_agent_row(1, TRUNCATED_FRAC - 0.01), agent) is None
    assert truncation_hint({"step": 1, "reward/mean": 0.0}, agent) is None
    assert truncation_hint(_agent_row(1, 1.0), None) is None


def test_the_hint_is_given_once():
    hint = TruncationHint(AgentSpec(environment="calculator"))
    assert hint.check(_agent_row(1, 0.2)) is None
    assert hint.check(_agent_row(2, 1.0)) is not None
    assert hint.check(_agent_row(3, 1.0)) is None and hint.check(_agent_row(4, 1.0)) is None
