"""RunState's waits across threads: Ray runs a threaded actor's calls in several threads at once, so
a call that blocks must wake when another thread's call moves the state, and time out otherwise."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

from relax.algo.staleness import AutoStaleness, StalenessPolicy
from relax.runtime.state.ledger import RolloutLedger
from relax.runtime.state.records import StepReport
from relax.runtime.state.run_state import RunState, partition_of


def _later(delay_s: float, fn, *args) -> threading.Thread:
    def run() -> None:
        time.sleep(delay_s)
        fn(*args)
    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_a_lease_beyond_the_bound_waits_for_the_version_another_thread_publishes() -> None:
    ledger = RolloutLedger(steps=4, prompts_per_step=2, samples_per_prompt=2, unit_prompts=2)
    state = RunState(ledger, StalenessPolicy(1))
    first = state.lease("r", 0, 1.0)
    assert first.unit["step"] == 0 and first.policy.version == -1
    assert state.lease("r", None, 0.05) is None  # step 1 needs version 0: a slice runs out
    publisher = _later(0.1, state.publish, 0, ["weights"])
    started = time.monotonic()
    second = state.lease("r", None, 5.0)
    publisher.join()
    assert second.unit["step"] == 1 and second.policy.version == 0 and second.policy.weights == ["weights"]
    assert time.monotonic() - started < 2.0  # woken by the publish, not by its deadline


def test_waiters_in_many_threads_wake_on_their_own_signal_and_on_stop() -> None:
    state = RunState(RolloutLedger(steps=4, prompts_per_step=2, samples_per_prompt=2, unit_prompts=2))
    with ThreadPoolExecutor(8) as pool:
        ready = pool.submit(state.wait_ready, 0, ["advantages"], 5.0)
        version = pool.submit(state.wait_version, 3, 5.0)
        reports = pool.submit(state.wait_reports, 0, ["rollout", "actor"], 5.0)
        time.sleep(0.05)
        assert not (ready.done() or version.done() or reports.done())
        state.announce(partition_of(0), "advantages")
        assert ready.result(timeout=2.0) is not None
        state.report([StepReport(0, "rollout", {"a": 1.0}), StepReport(0, "actor", {"b": 2.0})])
        got = reports.result(timeout=2.0)
        assert got.first == 0 and got.reports == [{"rollout": {"a": 1.0}, "actor": {"b": 2.0}}] and got.evals == []
        assert not version.done()
        state.stop("boom")
        assert version.result(timeout=2.0) is None  # a stop wakes a waiter, which answers None
    assert state.status().stopped
    # the step's signals were forgotten with its reports
    assert state.wait_ready(0, ["advantages"], 0.01) is None


def test_complete_and_lease_acknowledges_the_units_before_it_leases_the_next_steps_s() -> None:
    state = RunState(RolloutLedger(steps=3, prompts_per_step=2, samples_per_prompt=2, unit_prompts=2))
    first = state.lease("r", 0, 1.0)
    [nxt] = state.complete_and_lease("r", [(0, first.unit["unit"], first.unit["attempt"], {"rollout_s": 0.1},
                                            ["response"])], [1], 1.0)
    assert nxt.unit["step"] == 1  # step 1's unit, granted (only_step: no version gate)
    assert state.step_stats(0) == [{"rollout_s": 0.1}]  # step 0 acknowledged, its stats kept
    assert state.lease("r", 0, 0.05).done  # nothing of step 0 is left to lease
    # a revoked lease is acknowledged as not accepted, and the next lease is still granted
    state.release("r")
    again = state.lease("r2", 1, 1.0)
    late = state.complete_and_lease("r", [(1, nxt.unit["unit"], nxt.unit["attempt"], {}, ["response"])], [2], 0.05)
    assert again.unit["step"] == 1 and [g.unit["step"] for g in late] == [2]
    assert state.lease("r3", 1, 0.05) is None  # step 1 is not done: its unit is r2's now


def test_one_call_acknowledges_several_steps_and_leases_several_ending_at_the_first_not_granted() -> None:
    state = RunState(RolloutLedger(steps=6, prompts_per_step=2, samples_per_prompt=2, unit_prompts=2))
    [a] = state.complete_and_lease("r", [], [0], 1.0)
    b, c, d = state.complete_and_lease("r", [(0, 0, a.unit["attempt"], {"s": 0}, ["response"])], [1, 2, 3], 1.0)
    assert [g.unit["step"] for g in (b, c, d)] == [1, 2, 3]
    assert state.lease("other", 2, 0.05) is None  # step 2's only unit is r's already
    acks = [(s, 0, g.unit["attempt"], {"s": s}, ["response"]) for s, g in ((1, b), (2, c), (3, d))]
    assert state.complete_and_lease("r", acks, [], 1.0) == []  # acknowledging only
    assert [state.step_stats(s) for s in (1, 2, 3)] == [[{"s": 1}], [{"s": 2}], [{"s": 3}]]
    # a step whose unit someone else holds ends the answer; a done step answers done
    held = state.lease("other", 5, 1.0)
    got = state.complete_and_lease("r", [], [4, 5], 1.0)
    assert held.unit["step"] == 5 and [g.unit["step"] for g in got] == [4]
    assert [g.done for g in state.complete_and_lease("r", [], [3], 1.0)] == [True]
    assert state.complete_and_lease("r", [], [5], 0.05) is None  # step 5 not done, its unit held: wait ran out


def test_an_admitted_lease_of_one_step_waits_for_the_version_its_bound_needs_and_carries_it() -> None:
    state = RunState(RolloutLedger(steps=4, prompts_per_step=2, samples_per_prompt=2, unit_prompts=2),
                     StalenessPolicy(1))
    [zero] = state.complete_and_lease("r", [], [0], 1.0, admit=True)  # step 0 needs version -1: granted
    assert zero.unit["step"] == 0 and zero.policy.version == -1
    ack = [(0, 0, zero.unit["attempt"], {}, ["response"])]
    assert state.complete_and_lease("r", ack, [2], 0.05, admit=True) is None  # step 2 needs version 1
    assert state.step_stats(0) == [{}]  # the acknowledgement was taken all the same
    publisher = _later(0.1, state.publish, 1, ["v1"])
    started = time.monotonic()
    [two] = state.complete_and_lease("r", [], [2], 5.0, admit=True)
    publisher.join()
    assert two.unit["step"] == 2 and two.policy.version == 1 and two.policy.weights == ["v1"]
    assert time.monotonic() - started < 2.0  # woken by the publish
    # without admit a step's unit is granted whatever the version (colocate trains it itself)
    [three] = state.complete_and_lease("r", [], [3], 0.05)
    assert three.unit["step"] == 3 and three.policy.version == 1


def test_a_wait_for_reports_takes_every_finished_step_from_the_one_asked_and_stops_at_a_gap() -> None:
    state = RunState(RolloutLedger(steps=6, prompts_per_step=2, samples_per_prompt=2, unit_prompts=2))
    roles = ["rollout", "actor"]
    state.report([StepReport(s, role, {"step": s}) for s in (0, 1, 2) for role in roles])
    state.report([StepReport(3, "rollout", {"step": 3}), StepReport(4, "rollout", {"step": 4}),
                  StepReport(4, "actor", {"step": 4})])  # the actor has not reported step 3
    state.post_eval({"eval/version": 1.0})
    got = state.wait_reports(0, roles, 1.0)
    assert got.first == 0 and [r["actor"]["step"] for r in got.reports] == [0, 1, 2]
    assert got.evals == [{"eval/version": 1.0}]
    assert state.wait_reports(3, roles, 0.05) is None  # step 3 still lacks the actor's report
    state.report([StepReport(3, "actor", {"step": 3})])
    got = state.wait_reports(3, roles, 1.0)
    assert [r["rollout"]["step"] for r in got.reports] == [3, 4] and got.evals == []
    assert state.wait_reports(0, roles, 0.05) is None  # taken steps are gone


def test_step_reports_riding_on_a_lease_are_taken_before_it_waits() -> None:
    state = RunState(RolloutLedger(steps=3, prompts_per_step=2, samples_per_prompt=2, unit_prompts=2))
    first = state.lease("r", 0, 1.0)
    [second] = state.complete_and_lease("r", [(0, first.unit["unit"], first.unit["attempt"], {}, ["response"])],
                                        [1], 1.0, [StepReport(0, "rollout", {"x": 1.0})])
    assert second.unit["step"] == 1
    # a lease that finds nothing still records the reports it carried, and the waiter sees them
    with ThreadPoolExecutor(1) as pool:
        reports = pool.submit(state.wait_reports, 0, ["rollout", "actor"], 5.0)
        assert state.lease("r", 1, 0.05, [StepReport(0, "actor", {"y": 2.0})]) is None
        got = reports.result(timeout=2.0)
    assert got.reports == [{"rollout": {"x": 1.0}, "actor": {"y": 2.0}}]
    assert state.progress() == {"rollout": 0, "actor": 0}


def test_the_run_state_owns_the_bound_and_each_lease_carries_the_one_it_was_admitted_under() -> None:
    """``max_staleness: auto``: the run state moves the bound on a trained step's metrics row; the
    units leased before keep theirs, the ones leased after carry the new one."""
    from relax.spec.models import AutoStalenessSpec

    policy = AutoStaleness(AutoStalenessSpec(start=2, max=3, kl_budget=0.02, hold_steps=1))
    state = RunState(RolloutLedger(steps=6, prompts_per_step=2, samples_per_prompt=2, unit_prompts=2), policy)
    first = state.lease("r", None, 1.0)
    assert (first.unit["step"], first.bound) == (0, 2)
    # without a version published, the bound 2 admits steps 0 and 1 only (version -1 + 2)
    second = state.lease("r", None, 1.0)
    assert (second.unit["step"], second.bound) == (1, 2) and state.lease("r", None, 0.05) is None
    # a drift over the budget narrows the bound for what is leased next
    assert state.judge_step({"staleness/bound": 2, "offpolicy/kl": 0.5, "time/step_s": 1.0}) == 1
    state.publish(1, ["v1"])  # version 1 with bound 1 admits step 2
    third = state.lease("r", None, 1.0)
    assert (third.unit["step"], third.bound) == (2, 1) and state.lease("r", None, 0.05) is None
    # a row of a step admitted under the old bound does not judge the new one
    assert state.judge_step({"staleness/bound": 2, "offpolicy/kl": 0.5, "time/step_s": 1.0}) == 1
