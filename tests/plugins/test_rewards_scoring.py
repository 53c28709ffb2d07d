"""The reward scorer: concurrency, time limits, error policies, routing and per-reward stats."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from relax.contracts import RewardSample
from relax.runtime.worker.scoring import RewardEntry, RewardError, RewardScorer


def samples(n: int) -> list[RewardSample]:
    return [RewardSample(prompt=f"p{i}", response=str(i), label=str(i), metadata={"sample_id": f"0:{i}:0"})
            for i in range(n)]


class Constant:
    def __init__(self, value: float) -> None:
        self.value = value
        self.seen: list[list[str]] = []

    def score(self, batch):
        self.seen.append([s.response for s in batch])
        return [self.value] * len(batch)


class SlowAsync:
    def __init__(self, delay: float, value: float = 1.0) -> None:
        self.delay, self.value = delay, value
        self.cancelled = False

    async def score(self, batch):
        try:
            await asyncio.sleep(self.delay)
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        return [self.value] * len(batch)


class SlowSync:
    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.calls = 0

    def score(self, batch):
        self.calls += 1
        time.sleep(self.delay)
        return [0.5] * len(batch)


class FailsOn:
    """Raises whenever the batch holds the response ``bad``."""

    def __init__(self, bad: str) -> None:
        self.bad = bad

    def score(self, batch):
        if any(s.response == self.bad for s in batch):
            raise ValueError(f"cannot parse {self.bad!r}")
        return [1.0] * len(batch)


def entry(key: str, plugin, **kw) -> RewardEntry:
    return RewardEntry(key=key, name=kw.pop("name", key), plugin=plugin, **kw)


def test_weighted_sum_and_per_reward_stats():
    scorer = RewardScorer([entry("a", Constant(1.0), weight=2.0), entry("b", Constant(0.25), weight=-1.0)])
    report = scorer.score(samples(4))
    assert report.totals == [1.75] * 4
    stats = report.stats()
    assert stats["a/mean"] == 1.0 and stats["b/mean"] == 0.25
    assert stats["a/count"] == 4 and stats["b/errors"] == 0
    assert stats["a/time"] >= 0


def test_slow_async_rewards_run_at_the_same_time_as_each_other_and_sync_ones():
    scorer = RewardScorer([entry("a", SlowAsync(0.4)), entry("b", SlowAsync(0.4)), entry("c", SlowSync(0.4))])
    started = time.monotonic()
    report = scorer.score(samples(3))
    elapsed = time.monotonic() - started
    assert report.totals == [2.5] * 3
    assert elapsed < 0.9, elapsed  # serialised, it would take 1.2 s


def test_an_async_reward_past_its_timeout_fails_naming_it_and_is_cancelled():
    slow = SlowAsync(5.0)
    scorer = RewardScorer([entry("judge", slow, timeout_s=0.2), entry("fast", Constant(1.0))])
    started = time.monotonic()
    with pytest.raises(RewardError, match=r"reward 'judge' \(judge\) failed on sample 0:0:0 .*timeout_s=0.2"):
        scorer.score(samples(2))
    assert time.monotonic() - started < 1.0
    time.sleep(0.1)
    assert slow.cancelled


def test_a_sync_reward_past_its_timeout_is_not_called_again_while_it_runs():
    slow = SlowSync(0.6)
    scorer = RewardScorer([entry("slow", slow, timeout_s=0.1, on_error="zero", max_error_frac=1.0), entry("one", Constant(1.0))])
    started = time.monotonic()
    report = scorer.score(samples(2))
    assert time.monotonic() - started < 0.5
    assert report.totals == [1.0, 1.0] and report.errors == {"slow": 2}
    again = scorer.score(samples(2))  # the first call still sleeps: refused, not piled up
    assert again.errors == {"slow": 2} and slow.calls == 1
    time.sleep(0.7)
    scorer.score(samples(2))  # that call has returned: called again (and times out again)
    assert slow.calls == 2


def test_a_raising_reward_names_the_failing_sample():
    batch = samples(4)
    batch[2].response = "bad"
    scorer = RewardScorer([entry("mv", FailsOn("bad"), name="math_verify")])
    with pytest.raises(RewardError) as info:
        scorer.score(batch)
    message = str(info.value)
    assert "reward 'mv' (math_verify) failed on sample 0:2:0" in message
    assert "ValueError: cannot parse 'bad'" in message and "on_error: zero" in message


def test_zero_policy_scores_only_the_failing_samples_zero():
    batch = samples(4)
    batch[1].response = "bad"
    scorer = RewardScorer([entry("mv", FailsOn("bad"), on_error="zero", weight=2.0)])
    report = scorer.score(batch)
    assert report.totals == [2.0, 0.0, 2.0, 2.0]
    assert report.errors == {"mv": 1} and report.stats()["mv/errors"] == 1


@pytest.mark.parametrize("bad", [float("nan"), "x"])
def test_unusable_scores_are_failures(bad):
    class Bad:
        def score(self, batch):
            return [1.0, bad]

    with pytest.raises(RewardError, match="sample 0:1:0"):
        RewardScorer([entry("b", Bad())]).score(samples(2))
    assert RewardScorer([entry("b", Bad(), on_error="zero")]).score(samples(2)).totals == [1.0, 0.0]


def test_a_wrong_number_of_scores_is_an_error_whatever_the_policy():
    class Short:
        def score(self, batch):
            return [1.0]

    with pytest.raises(RewardError, match="returned 1 scores for 3 samples"):
        RewardScorer([entry("s", Short(), on_error="zero")]).score(samples(3))


def test_routing_sends_each_sample_to_the_rewards_it_names():
    math, code, length = Constant(1.0), Constant(0.5), Constant(-0.1)
    scorer = RewardScorer([entry("math", math, name="math_verify"), entry("code", code, name="remote"),
                           entry("len", length, name="overlong_penalty", always=True)])
    report = scorer.score(samples(4), ["math", "remote", None, ["math", "code"]])
    assert math.seen == [["0", "2", "3"]] and code.seen == [["1", "2", "3"]]
    assert length.seen == [["0", "1", "2", "3"]]  # always: every sample
    assert report.totals == pytest.approx([0.9, 0.4, 1.4, 1.4])
    assert report.scores["math"] == [1.0, None, 1.0, 1.0]
    assert report.stats()["code/count"] == 3


def test_a_route_naming_no_reward_is_a_clear_error():
    scorer = RewardScorer([entry("math", Constant(1.0), name="math_verify")])
    with pytest.raises(RewardError, match=r"sample 0:1:0: .*'cod' names no reward .*known: math, math_verify"):
        scorer.score(samples(2), [None, "cod"])
    with pytest.raises(RewardError, match="neither a reward name nor a list"):
        scorer.score(samples(1), [3])


def test_duplicate_keys_are_refused():
    with pytest.raises(ValueError, match="more than once"):
        RewardScorer([entry("a", Constant(1.0)), entry("a", Constant(0.0))])


def test_sync_rewards_run_off_the_calling_thread():
    seen = []

    class Where:
        def score(self, batch):
            seen.append(threading.current_thread() is threading.main_thread())
            return [0.0] * len(batch)

    RewardScorer([entry("w", Where())]).score(samples(1))
    assert seen == [False]
