"""Fault tolerance on a real local Ray with the real bus: each test runs ``relax run`` in a process
of its own and kills, freezes or scales its workers mid-run (``relax.testing.LiveRun``).

Every run here trains the same 10 steps of the tiny preset in separate mode; sample ids, prompts and
sampling seeds are functions of the step, so each step of a disturbed run must train exactly the
samples of the undisturbed reference run (``samples/trained_hash``, ``data/order``).
"""

from __future__ import annotations

import signal
import time

import pytest

from relax.telemetry import read_spans
from relax.testing import FAULT_TEST_OVERRIDES, LiveRun

STEPS = 10
BATCH = 16 * 8  # prompts_per_step x samples_per_prompt of tiny-cpu
pytestmark = pytest.mark.faults  # its own lane: `nox -s faults`

FAULTS = (*FAULT_TEST_OVERRIDES, f"trainer.steps={STEPS}")
FAULT_TEST_WAIT_S = 120  # fault_tolerance.wait_timeout_s of FAULT_TEST_OVERRIDES: also the ranks' group timeout


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[dict]:
    run = LiveRun(tmp_path_factory.mktemp("faults"), "reference", *FAULTS).start()
    assert run.wait() == 0, run.output()
    return run.rows()


def same_data(rows: list[dict], reference: list[dict]) -> None:
    """Step by step, the same prompts and exactly the same samples were trained."""
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert [r["data/order"] for r in rows] == [r["data/order"] for r in reference]
    assert [r["samples/trained_hash"] for r in rows] == [r["samples/trained_hash"] for r in reference]


def exactly_once(last: dict) -> None:
    assert last["samples/consumed"] == STEPS * BATCH
    assert last["samples/produced"] == last["samples/consumed"], last


def fault_spans(run: LiveRun) -> list[dict]:
    return [s for s in read_spans(run.run_dir / "traces.jsonl") if s["name"] == "relax.fault"]


def span_restarts(run: LiveRun) -> list[int]:
    """The ``relax.restarts`` total of each ``relax.fault`` span, in order."""
    return [span["attributes"]["relax.restarts"] for span in fault_spans(run)]


def restarted_once_in_place(run: LiveRun, reference: list[dict]) -> dict:
    """The run ended well, trained exactly the reference's samples, and restarted a rollout worker
    once: that restart's ``relax.fault`` span."""
    assert run.wait() == 0, run.output()
    rows = run.rows()
    same_data(rows, reference)
    exactly_once(rows[-1])
    assert rows[-1]["faults/rollout/restarts"] == 1
    # one kill of a worker holding rollout, reward and advantage is one recovery, not three
    assert rows[-1]["faults/restarts"] == 1 and span_restarts(run) == [1]
    [span] = fault_spans(run)
    assert span["attributes"]["relax.action"] == "restart"
    return span


def test_the_undisturbed_run_counts_every_sample_once(reference) -> None:
    exactly_once(reference[-1])
    assert reference[-1]["faults/restarts"] == 0 and reference[-1]["samples/regenerated"] == 0


def test_a_killed_rollout_restarts_in_place_and_loses_or_repeats_nothing(tmp_path, reference) -> None:
    run = LiveRun(tmp_path, "kill-rollout", *FAULTS).start()
    killed = run.kill_worker("rollout", at_rows=2)
    span = restarted_once_in_place(run, reference)
    assert span["attributes"]["relax.role"] == killed["holder"]
    assert "process died" in span["attributes"]["relax.reason"]


def test_a_killed_evaluation_worker_restarts_in_place_and_training_is_untouched(tmp_path, reference) -> None:
    """The evaluation worker (``trainer.eval.host: auto`` in separate mode) dies mid-run: it is a
    rollout engine (the rollout's policy and budget), restarted in place; training trains exactly
    the reference's samples, and the final version is still evaluated."""
    import json
    import os

    evaluation = ("data.eval={source: 'synthetic:arithmetic', options: {size: 8, seed: 1}}", "trainer.eval_every=2")
    run = LiveRun(tmp_path, "kill-evaluation", *FAULTS, *evaluation).start()
    # Killed once it evaluated v0 (a version lost with its worker is not evaluated again: the object
    # store keeps the newest weights only) and while training goes on.
    run.until("the evaluation of v0", lambda: any("eval/version" in r for r in run.rows()), 300)
    run.wait_rows(2)
    [worker] = [w for w in run.status()["workers"] if w["holder"] == "evaluation" and w["pid"]]
    os.kill(worker["pid"], signal.SIGKILL)
    span = restarted_once_in_place(run, reference)
    assert span["attributes"]["relax.worker"] == "evaluation" and "process died" in span["attributes"]["relax.reason"]
    versions = [json.loads(line)["eval/version"] for line in (run.run_dir / "eval.jsonl").read_text().splitlines()]
    assert versions[0] == 0 and versions[-1] == STEPS and versions == sorted(set(versions)), versions


def test_a_killed_trainer_resumes_from_its_checkpoint_with_the_same_data(tmp_path, reference) -> None:
    run = LiveRun(tmp_path, "kill-actor", *FAULTS).start()
    run.kill_worker("actor", at_rows=3)
    assert run.wait() == 0, run.output()
    rows = run.rows()
    same_data(rows, reference)
    assert rows[-1]["faults/actor/restarts"] == 1
    assert rows[-1]["faults/restarts"] == 1  # one kill, one recovery, whatever roles the worker held
    # The counters restart with the resumed attempt: what it produced, it trained.
    assert rows[-1]["samples/produced"] == rows[-1]["samples/consumed"] > 0
    assert "resuming from step" in run.output()
    [span] = fault_spans(run)
    assert span["attributes"]["relax.action"] == "resume"


def test_a_frozen_rollout_is_found_within_the_heartbeat_timeout_and_restarted(tmp_path, reference) -> None:
    run = LiveRun(tmp_path, "hang-rollout", *FAULTS).start()
    # alive but making no progress, like a hung engine
    frozen_at = run.signal_worker("rollout", signal.SIGSTOP, at_rows=2)["signalled_at"]
    assert run.wait() == 0, run.output()
    rows = run.rows()
    same_data(rows, reference)
    exactly_once(rows[-1])
    [span] = fault_spans(run)
    assert "no heartbeat" in span["attributes"]["relax.reason"]
    detected_after = span["start"] / 1e9 - frozen_at
    # heartbeat_timeout_s=6 counts from the last beat, which came up to heartbeat_s=0.5 before the
    # freeze; then up to one supervision pass, and slack for a loaded machine.
    assert 6 - 0.5 <= detected_after <= 6 + 4, detected_after


def test_a_hung_rollout_past_its_restart_budget_stops_the_run_with_a_report(tmp_path) -> None:
    run = LiveRun(tmp_path, "hang-stop", *FAULTS, "fault_tolerance.roles.rollout.max_restarts=0").start()
    run.signal_worker("rollout", signal.SIGSTOP, at_rows=1)
    assert run.wait() == 1
    assert "max_restarts=0" in run.output() and "no heartbeat" in run.output()


def test_rollout_scales_from_one_to_two_replicas_and_back_mid_run(tmp_path) -> None:
    # Enough steps that the run outlasts both changes: a step of the tiny preset takes under 0.1 s
    # here, and starting the extra replica takes seconds (at 80 steps the run ended before the shrink).
    steps = 300
    run = LiveRun(tmp_path, "scale", *FAULTS, f"trainer.steps={steps}", "roles.rollout.max_replicas=2").start()
    run.wait_rows(2)
    grown = run.scale(2)
    assert grown["rollout"] == {"before": 1, "after": 2} and len(grown["replicas"]) == 2
    at_two = len(run.wait_rows(len(run.rows()) + 6))
    shrunk = run.scale(1)
    shrunk_at = len(run.rows())
    assert shrunk["rollout"] == {"before": 2, "after": 1}
    assert run.wait() == 0, run.output()
    rows = run.rows()
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert all(r["rollout/units"] == 2 for r in rows)  # two units of 8 prompts per step
    both = [r for r in rows if r["rollout/step_replicas"] == 2]
    # The second replica took part while it ran, and left again once its units in flight were done
    # (at most max_staleness + 1 steps ahead of the last row written when the shrink was answered).
    assert both and min(r["step"] for r in both) <= at_two
    assert max(r["step"] for r in both) <= shrunk_at + 6
    assert rows[-1]["rollout/replicas"] == 1
    assert rows[-1]["samples/consumed"] == steps * BATCH
    assert rows[-1]["samples/produced"] == rows[-1]["samples/consumed"]


def test_a_killed_driver_resumes_with_the_same_data_order(tmp_path, reference) -> None:
    run = LiveRun(tmp_path, "kill-driver", *FAULTS).start()
    run.wait_rows(4)
    run.process.kill()  # kill -9 of `relax run` itself
    run.wait()
    resumed = LiveRun(tmp_path, "kill-driver", *FAULTS, resume=True).start()
    assert resumed.wait() == 0, resumed.output()
    rows = resumed.rows()
    same_data(rows, reference)


def test_losing_the_node_of_the_rollout_brings_it_back_on_a_spare_node(tmp_path, reference) -> None:
    """Two planned GPU nodes (fake GPUs) and a spare one; the bus lives on the head node."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 8, "num_gpus": 0,
                                                            "resources": {"relax_bus": 1}})
    try:
        gpu_nodes = [cluster.add_node(num_cpus=2, num_gpus=1) for _ in range(3)]
        cluster.wait_for_nodes()
        run = LiveRun(tmp_path, "lose-node", *FAULTS, f"cluster.address={cluster.address}", "cluster.nodes=2",
                      "cluster.gpus_per_node=1", "cluster.cpus_per_node=2", "roles.rollout.gpus_per_replica=1",
                      "roles.actor.gpus=1", "cluster.bus_node_resource=relax_bus").start()
        run.wait_rows(2)
        lost = run.worker("rollout")["node"]
        cluster.remove_node(next(node for node in gpu_nodes if node.node_id == lost))
        assert run.wait() == 0, run.output()
    finally:
        cluster.shutdown()
    rows = run.rows()
    same_data(rows, reference)
    exactly_once(rows[-1])
    assert rows[-1]["faults/rollout/restarts"] == 1
    [moved] = [line for line in run.output().splitlines() if "restarted in place on node" in line]
    assert lost[:12] not in moved


def test_a_killed_rank_of_a_two_rank_actor_resumes_the_run_with_the_same_data(tmp_path, reference) -> None:
    """The actor spans two fake GPUs (two data-parallel ranks, two processes). kill -9 of rank 1,
    which no heartbeat watches, fails rank 0's next collective: the actor resumes, both ranks anew."""
    import os

    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 8, "num_gpus": 3})
    try:
        run = LiveRun(tmp_path, "kill-rank", *FAULTS, f"cluster.address={cluster.address}",
                      "cluster.gpus_per_node=3", "roles.rollout.gpus_per_replica=1", "roles.actor.gpus=2").start()
        run.wait_rows(3)
        [rank] = run.worker("actor")["ranks"]["actor"]
        assert rank["rank"] == 1 and rank["pid"] != run.worker("actor")["pid"]
        killed_at = time.time()
        os.kill(rank["pid"], signal.SIGKILL)
        assert run.wait() == 0, run.output()
    finally:
        cluster.shutdown()
    rows = run.rows()
    same_data(rows, reference)
    assert rows[-1]["faults/actor/restarts"] == 1
    assert "resuming from step" in run.output()
    [span] = fault_spans(run)
    assert span["attributes"]["relax.action"] == "resume"
    found_s = span["start"] / 1e9 - killed_at
    print(f"rank 1 killed: found in {found_s:.1f} s ({span['attributes']['relax.reason'].splitlines()[0][:160]})")
    assert found_s < FAULT_TEST_WAIT_S  # a collective with a dead peer fails fast; it does not wait out the group timeout
