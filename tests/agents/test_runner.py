"""The trajectory runner's logic: tool-call errors, failing and hanging environments, slow tools,
budgets and backend failures.

The model is scripted here (its turns are chosen by the test, tokenized with the tiny omni model's
real tokenizer and chat template): what is tested is how trajectories advance, are batched and end,
not what a model says. The runtime tests run the same runner on a real model."""

from __future__ import annotations

import re
import threading
import time

import pytest
from pydantic import BaseModel

from relax.agents.chat import ChatTokens
from relax.agents.runner import AgentLimits, BackendFailure, EnvironmentDriver, GenerationBatcher, run_trajectories
from relax.contracts import AgentTask, Generation, Observation, TokenPrompt, ToolSpec

CALL = '<tool_call>{"name": "wait", "arguments": {"seconds": %s}}</tool_call>'
WAIT = ToolSpec("wait", "waits", {"type": "object", "properties": {"seconds": {"type": "number"}},
                                  "required": ["seconds"]})


@pytest.fixture(scope="module")
def tokenizer(omni_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(omni_path)


class Script:
    """A model whose turns are chosen per trajectory: ``turns[task][k]`` is its k-th turn's text.
    Each call records the trajectories it served together (what the batcher batched)."""

    def __init__(self, tokenizer, turns: dict[int, list[str]], fail_on_call: int | None = None) -> None:
        self.tokenizer, self.turns, self.fail_on_call = tokenizer, turns, fail_on_call
        self.batches: list[list[int]] = []
        self.stop = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def __call__(self, prompts: list[TokenPrompt], seed: int) -> list[Generation]:
        if self.fail_on_call is not None and len(self.batches) == self.fail_on_call:
            raise RuntimeError("engine died")
        out, served = [], []
        for i, prompt in enumerate(prompts):
            text = self.tokenizer.decode(prompt.ids)
            task = int(re.search(r"task (\d+)", text).group(1))
            turn = text.count("<|im_start|>assistant") - 1
            served.append(task)
            answer = self.turns[task][min(turn, len(self.turns[task]) - 1)]
            ids = self.tokenizer(answer, add_special_tokens=False)["input_ids"]
            budget = prompt.max_new_tokens
            finished = len(ids) + 1 <= budget
            ids = ids + [self.stop] if finished else ids[:budget]
            out.append(Generation(prompt_index=i, prompt_ids=list(prompt.ids), response_ids=ids,
                                  logprobs=[-0.5] * len(ids), text=self.tokenizer.decode(ids[:-1] if finished else ids),
                                  finished=finished))
        self.batches.append(served)
        return out


class Waiter:
    """Waits as long as the model asks; ``raise_for``/``hang_for`` trajectories fail instead."""

    class Config(BaseModel):
        pass

    def __init__(self, raise_for: frozenset[int] = frozenset(), hang_for: frozenset[int] = frozenset()) -> None:
        self.raise_for, self.hang_for = raise_for, hang_for
        self.seen: list[tuple[int, int]] = []
        self.finished_at: dict[int, float] = {}
        self.tool_returned_at: dict[int, float] = {}
        self._lock = threading.Lock()

    def tools(self) -> list[ToolSpec]:
        return [WAIT]

    def start(self, task: AgentTask) -> int:
        return task.sample

    def step(self, state: int, turn) -> Observation:
        with self._lock:
            self.seen.append((state, turn.index))
        if state in self.raise_for:
            raise ValueError("the sandbox is gone")
        if state in self.hang_for:
            time.sleep(30)
        if not turn.tool_calls:
            self.finished_at[state] = time.monotonic()
            return Observation(done=True, reward=1.0)
        time.sleep(float(turn.tool_calls[0].arguments["seconds"]))
        self.tool_returned_at[state] = time.monotonic()
        return Observation("waited", info={"tool": "wait"})


def run(tokenizer, environment, script, count: int, **limits):
    settings = dict(max_turns=4, max_tokens=400, max_new_tokens=80, tool_timeout_s=10.0, concurrency=16)
    settings.update(limits)
    chat = ChatTokens(tokenizer, environment.tools(), None, 256)
    driver = EnvironmentDriver(environment, "waiter", chat, AgentLimits(**settings), version=lambda: 1)
    tasks = [AgentTask(prompt=f"task {j}", label=None, row={}, index=0, sample=j, trajectory_id=f"0:0:{j}")
             for j in range(count)]
    return run_trajectories(tasks, driver, script, seed=0)


def test_a_malformed_tool_call_is_answered_with_an_error_and_the_trajectory_goes_on(tokenizer):
    environment = Waiter()
    script = Script(tokenizer, {0: ['<tool_call>{"name": "wait", "arguments": {"seconds": "soon"}}</tool_call>',
                                    "<tool_call>{not json</tool_call>", "<tool_call>{\"name\": \"sleep\"}</tool_call>",
                                    "done"],
                                1: [CALL % 0, "done"]})
    batch = run(tokenizer, environment, script, 2, max_tokens=2000)
    bad, good = batch.trajectories
    assert bad.error is None and len(bad.turns) == 4 and bad.tool_errors == 3 and bad.tool_calls == 3
    assert good.tool_errors == 0 and good.tool_calls == 1 and len(good.turns) == 2
    # the environment never saw the malformed calls: only trajectory 0's last turn and trajectory 1's two
    assert sorted(environment.seen) == [(0, 3), (1, 0), (1, 1)]
    observations = tokenizer.decode(bad.response_ids)
    assert "argument 'seconds' of 'wait' must be number" in observations
    assert "its body is not valid JSON" in observations and "no tool named 'sleep'" in observations
    assert batch.stats["agent_tool_errors"] == 3


def test_an_environment_that_raises_or_hangs_ends_only_its_own_trajectory(tokenizer):
    environment = Waiter(raise_for=frozenset({1}), hang_for=frozenset({2}))
    script = Script(tokenizer, {j: [CALL % 0, "done"] for j in range(4)})
    started = time.monotonic()
    batch = run(tokenizer, environment, script, 4, tool_timeout_s=0.5)
    assert time.monotonic() - started < 10  # the hanging call (30 s) was given up at its time limit
    raised, hung = batch.trajectories[1], batch.trajectories[2]
    assert "environment 'waiter': step raised ValueError: the sandbox is gone" in raised.error
    assert "took longer than roles.rollout.agent.tool_timeout_s=0.5 s" in hung.error
    for ok in (batch.trajectories[0], batch.trajectories[3]):
        assert ok.error is None and len(ok.turns) == 2 and ok.turn_reward == 1.0
    # every task gives exactly one trajectory; a failed one keeps its tokens but trains on none of them
    assert len(batch.trajectories) == 4 and batch.stats["agent_trajectories"] == 4
    assert sum(raised.to_generation(0).loss_mask) == 0 and sum(raised.loss_mask) > 0
    assert batch.stats["agent_tool_errors"] == 2


def test_a_slow_tool_holds_only_its_own_trajectory(tokenizer):
    environment = Waiter()
    slow = {0, 2, 4, 6}
    script = Script(tokenizer, {j: [CALL % (1 if j in slow else 0), CALL % 0, "done"] for j in range(8)})
    batch = run(tokenizer, environment, script, 8)
    assert all(t.error is None and len(t.turns) == 3 for t in batch.trajectories)
    first_slow_tool = min(environment.tool_returned_at[j] for j in slow if j in environment.tool_returned_at)
    # every fast trajectory ran all its turns while the slow tools were still sleeping
    assert all(environment.finished_at[j] < first_slow_tool for j in range(8) if j not in slow)
    # and the model served trajectories together whenever they waited together: 24 requests in a
    # handful of calls (5 on an idle machine: all first turns, then the fast and the slow second and
    # third turns). How many first turns share the first call depends on scheduling: a trajectory
    # still in its environment's start call after the batcher's settle window (10 ms, which a busy
    # CI machine can exceed) joins the next call instead.
    assert sum(len(b) for b in script.batches) == 24
    assert len(script.batches) <= 12 and max(len(b) for b in script.batches[1:]) >= 2


def test_budgets_truncate_and_mask_policy_removes_them_from_training(tokenizer):
    environment = Waiter()
    script = Script(tokenizer, {0: [CALL % 0], 1: ["x" * 100], 2: ["done"]})
    batch = run(tokenizer, environment, script, 3, max_turns=2, max_new_tokens=80)
    turns_spent, cut, fine = batch.trajectories
    assert turns_spent.truncated and len(turns_spent.turns) == 2  # still calling tools after its last turn
    assert cut.truncated and len(cut.response_ids) == 80  # its turn was cut at the turn budget
    assert not fine.truncated
    assert sum(cut.to_generation(0, masked=True).loss_mask) == 0 and sum(cut.to_generation(0).loss_mask) == 80
    assert batch.stats["agent_truncated"] == pytest.approx(2 / 3)


def test_a_backend_failure_stops_every_trajectory_and_is_raised(tokenizer):
    environment = Waiter()
    script = Script(tokenizer, {j: [CALL % 0, "done"] for j in range(3)}, fail_on_call=1)
    with pytest.raises(BackendFailure, match="engine died"):
        run(tokenizer, environment, script, 3)


class FailsFirst(Waiter):
    """Fails the first ``fails[sample]`` tries of a sample's trajectory in ``start`` (a sandbox that
    did not come up, or a server gone: ``ConnectionError``), then serves it as the Waiter does."""

    def __init__(self, fails: dict[int, int]) -> None:
        super().__init__()
        self.fails, self.starts = dict(fails), {j: 0 for j in fails}

    def start(self, task: AgentTask) -> int:
        with self._lock:
            self.starts[task.sample] = self.starts.get(task.sample, 0) + 1
            if self.starts[task.sample] <= self.fails.get(task.sample, 0):
                raise ConnectionError(f"sandbox {task.sample} did not come up")
        return task.sample


def test_failed_trajectories_are_regenerated_up_to_the_budget_and_counted(tokenizer):
    script = Script(tokenizer, {j: [CALL % 0, "done"] for j in range(4)})
    # sample 1 fails once, sample 2 twice, sample 3 always; budget 2
    environment = FailsFirst({1: 1, 2: 2, 3: 99})
    batch = run(tokenizer, environment, script, 4, regenerate_failed=2)
    assert environment.starts == {0: 1, 1: 2, 2: 3, 3: 3}  # the budget bounds the tries
    assert [t.outcome for t in batch.trajectories] == ["ok", "ok", "ok", "infra"]
    assert [t.turn_reward for t in batch.trajectories[:3]] == [1.0, 1.0, 1.0]
    assert [t.info.get("regenerated", 0) for t in batch.trajectories] == [0, 1, 2, 2]
    assert "sandbox 2 did not come up" in batch.trajectories[2].info["last_failure"]
    assert batch.stats["agent_regenerated"] == 5 and batch.stats["agent_failed"] == 1
    assert batch.stats["agent_outcome/infra"] == 1 and batch.stats["agent_trajectories"] == 4
    # without a budget (the default) a failure is the sample
    environment = FailsFirst({1: 1})
    batch = run(tokenizer, environment, script, 2)
    assert environment.starts == {0: 1, 1: 1} and [t.outcome for t in batch.trajectories] == ["ok", "infra"]
    assert batch.stats["agent_regenerated"] == 0


class Timed:
    """A model that answers every prompt with one token after ``seconds``, recording each call's
    prompts (their first token: the trajectory) and when it was made."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.calls = seconds, []

    def __call__(self, prompts: list[TokenPrompt], seed: int) -> list[Generation]:
        self.calls.append((time.monotonic(), sorted(p.ids[0] for p in prompts)))
        time.sleep(self.seconds)
        return [Generation(prompt_index=i, prompt_ids=list(p.ids), response_ids=[1], logprobs=[-0.5], text="x",
                           finished=True) for i, p in enumerate(prompts)]


def _programs(batcher, thinking: dict[int, float], turns: int = 2) -> list[threading.Thread]:
    """Agent programs as the gateway drives the batcher: outside until their first call, then
    returning after each reply; program ``j`` thinks ``thinking[j]`` seconds before each later call."""

    def program(j: int) -> None:
        batcher.outside(+1)
        outside = True
        try:
            for turn in range(turns):
                if turn:
                    time.sleep(thinking[j])
                if outside:
                    batcher.outside(-1)
                    outside = False
                batcher.request(TokenPrompt([j], [], 1), j)
                batcher.returning(j)
        finally:
            if outside:
                batcher.outside(-1)
            batcher.returning(j, back=False)
            batcher.left()

    threads = []
    for j in thinking:
        batcher.joined()
        threads.append(threading.Thread(target=program, args=(j,), daemon=True))
    return threads


def test_a_batch_waits_for_programs_reading_their_replies_one_after_another():
    model = Timed(1.0)
    batcher = GenerationBatcher(model, seed=0)
    # 8 programs come back 20 ms apart (more than the 10 ms of quiet that sends a batch without
    # trajectories that are outside): all within the last call's 1 s, so one batch takes them all
    threads = _programs(batcher, {j: 0.02 * j for j in range(8)})
    for thread in threads:
        thread.start()
    batcher.serve()
    for thread in threads:
        thread.join()
    assert [served for _, served in model.calls] == [list(range(8)), list(range(8))]


def test_a_program_that_thinks_longer_than_a_generation_does_not_hold_the_others():
    model = Timed(0.5)
    batcher = GenerationBatcher(model, seed=0)
    threads = _programs(batcher, {0: 0.0, 1: 0.0, 2: 0.0, 3: 4.0})
    for thread in threads:
        thread.start()
    batcher.serve()
    for thread in threads:
        thread.join()
    (first, all4), (second, fast), (third, slow) = model.calls
    assert all4 == [0, 1, 2, 3] and fast == [0, 1, 2] and slow == [3]
    # the fast programs' batch went once the slow one had been thinking for about a generation's
    # time (0.5 s after its reply), not when it came back 4 s later
    assert second - first < 0.5 + 0.5 + 1.5 and third - first >= 4.0
