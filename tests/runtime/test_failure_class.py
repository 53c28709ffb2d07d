"""Errors by class (``relax.runtime.failure_class``): which exceptions a role's step loop catches
stop the run at once (a retry would fail the same way) and which keep the restart policy."""

from __future__ import annotations

import json

import pytest

from relax.contracts import TransientError
from relax.runtime.failure_class import repeats_on_retry
from relax.runtime.worker.workers import role_failure


def caught(raise_it) -> BaseException:
    try:
        raise_it()
    except BaseException as exc:  # noqa: BLE001 - the point is to keep whatever it raised
        return exc
    raise AssertionError("nothing was raised")


def missing_column():
    return {"prompt": "1+1="}["question"]


def wrapped(inner, outer):
    def raise_it():
        try:
            inner()
        except BaseException as exc:
            raise outer from exc
    return raise_it


def raise_(exc: BaseException):
    def raise_it():
        raise exc
    return raise_it


@pytest.mark.parametrize("make, repeats", [
    (missing_column, True),
    (lambda: json.loads("{oops"), True),  # JSONDecodeError: a ValueError
    (lambda: len(5), True),  # TypeError: a plugin's bug
    (lambda: None.strip(), True),
    (wrapped(missing_column, RuntimeError("the environment failed")), True),
    (raise_(RuntimeError("CUDA out of memory? a collective that broke?")), False),
    (raise_(OSError("disk")), False),
    (raise_(ConnectionError("reset by peer")), False),
    (raise_(TimeoutError("waited 600 s for the step's rows")), False),
    (raise_(TransientError("judge down")), False),
    (wrapped(raise_(ConnectionError("refused")), ValueError("no answer to parse")), False),
    (wrapped(missing_column, TransientError("sandbox not ready")), False),
], ids=["KeyError", "JSONDecodeError", "TypeError", "AttributeError", "RuntimeError-from-KeyError",
        "RuntimeError", "OSError", "ConnectionError", "TimeoutError", "TransientError",
        "ValueError-from-ConnectionError", "TransientError-from-KeyError"])
def test_mistakes_repeat_and_the_worlds_failures_do_not(make, repeats: bool) -> None:
    assert repeats_on_retry(caught(make)) is repeats


def test_a_mistake_class_raised_inside_the_machinery_keeps_the_restart() -> None:
    import torch.distributed as dist

    # torch.distributed raises ValueError from its own code when there is no process group (as
    # when the group's peer process died and it was torn down): the run's failure, not the role's.
    exc = caught(dist.get_rank)
    assert isinstance(exc, ValueError) and not repeats_on_retry(exc)


def test_rays_own_errors_are_transient() -> None:
    from ray.exceptions import ObjectLostError, RayActorError

    assert not repeats_on_retry(RayActorError())
    assert not repeats_on_retry(caught(wrapped(raise_(ObjectLostError("ab" * 14, None, "a call site")), KeyError("row"))))


def test_the_role_failure_carries_the_verdict_to_the_controller() -> None:
    import pickle

    stop = pickle.loads(pickle.dumps(role_failure("role rollout failed at step 0", caught(missing_column))))
    assert stop.stops_run and stop.headline == "role rollout failed at step 0: KeyError: 'question'"
    retry = pickle.loads(pickle.dumps(role_failure("role rollout failed at step 0", TransientError("down"))))
    assert not retry.stops_run
