"""Histories that branch (``roles.rollout.agent.history: segments``): a program that summarizes its
conversation at its third call is not refused; its trajectory continues as a second segment whose
prompt is the summarized conversation, rendered anew. The sample is two rows, one per segment, each
exactly what the model read and wrote in that segment and each training only its own segment's
model tokens (none twice); the trainer's batch holds both.

The real ``hf`` rollout on the tiny omni model behind the real gateway and ``openai`` client."""

from __future__ import annotations

import openai

from relax.agents.gateway import ProgramDriver
from relax.agents.outcomes import linked_rows
from relax.agents.runner import AgentLimits, run_trajectories
from relax.algo.batch import TrainBatch
from relax.contracts import AgentTask
from relax.runtime.worker.rows import rollout_columns
from relax.spec.models import AgentSpec, GatewaySpec

#: Per trajectory: the token prompts the model was asked to continue, and what it wrote.
READ: dict[str, list[tuple[list[int], list[int]]]] = {}
REPLIES: dict[str, list[str]] = {}


def summarizes(task: AgentTask, base_url: str, api_key: str) -> None:
    """Two turns, then the history replaced by a summary (a memory-rewriting agent), then one more
    turn that extends the summarized conversation."""
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=60)
    messages: list = [{"role": "user", "content": task.prompt}]
    replies = []
    for turn in range(4):
        if turn == 2:
            messages = [{"role": "system", "content": f"Summary: {task.prompt} twice."},
                        {"role": "user", "content": "Go on."}]
        elif turn:
            messages += [{"role": "user", "content": "Go on."}]
        reply = client.chat.completions.create(model="m", messages=messages, max_tokens=6)
        replies.append(reply.choices[0].message.content)
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
    REPLIES[task.trajectory_id] = replies


def test_a_summarized_history_continues_as_a_second_segment_trained_once(omni_backends):
    rollout, _ = omni_backends
    tokenizer, sampling = rollout.tokenizer, rollout.context.sampling
    by_prompt: dict[tuple[int, ...], str] = {}

    def generate(prompts, seed):
        out = rollout.generate_tokens(prompts, sampling, seed)
        for prompt, generation in zip(prompts, out):
            by_prompt[tuple(prompt.ids)] = generation
        return out

    limits = AgentLimits(max_turns=4, max_tokens=200, max_new_tokens=6, tool_timeout_s=60, concurrency=4)
    agent = AgentSpec(gateway=GatewaySpec(program="tests.agents.test_gateway_segments:summarizes"),
                      max_turns=4, max_tokens=200)
    assert agent.history == "segments"
    driver = ProgramDriver(agent, rollout, limits, version=lambda: 2, max_prompt_tokens=128)
    tasks = [AgentTask(prompt=f"What is {j}+1?", label="", row={}, index=0, sample=j, trajectory_id=f"seg:{j}")
             for j in range(2)]
    try:
        batch = run_trajectories(tasks, driver, generate, 5)
    finally:
        driver.close()

    for task, t in zip(tasks, batch.trajectories):
        assert t.error is None and not t.truncated, t.error
        summary = t.summary()
        assert summary["segments"] == 2
        (first,) = t.segments
        assert first["segment"] == 0 and first["parent"] is None and first["turns"] == 2
        assert "message 0 differs" in first["why"]
        # The second segment's prompt is the summarized conversation rendered anew, as the model read it.
        assert tokenizer.decode(t.prompt_ids, skip_special_tokens=False) == (
            f"<|im_start|>system\nSummary: {task.prompt} twice.<|im_end|>\n<|im_start|>user\nGo on.<|im_end|>\n"
            "<|im_start|>assistant\n")
        # Its two turns are what the model wrote, each after exactly the tokens it read.
        assert len(t.turns) == 2
        for start, end in t.turns:
            read = t.prompt_ids + t.response_ids[:start]
            assert by_prompt[tuple(read)].response_ids == t.response_ids[start:end]
            assert by_prompt[tuple(read)].logprobs == t.logprobs[start:end]
        # The sample is two rows: the first segment's, then the second's; each trains its own model tokens.
        earlier, gen = t.to_generations(0)
        assert gen.prompt_ids == t.prompt_ids and gen.response_ids == t.response_ids
        trained = [i for i, m in enumerate(gen.loss_mask) if m]
        assert trained == [i for start, end in t.turns for i in range(start, end)]
        # The first segment's row: its prompt is the first call's, and each of its two turns (a run
        # of trained tokens) is what the model wrote after exactly the tokens it read there.
        turns = _runs(earlier.loss_mask)
        assert len(turns) == 2 == first["turns"] and sum(earlier.loss_mask) == first["model_tokens"]
        for start, end in turns:
            read = earlier.prompt_ids + earlier.response_ids[:start]
            assert by_prompt[tuple(read)].response_ids == earlier.response_ids[start:end]
            assert by_prompt[tuple(read)].logprobs == earlier.logprobs[start:end]
        assert REPLIES[task.trajectory_id][:2] == [tokenizer.decode(
            earlier.response_ids[s:e], skip_special_tokens=True) for s, e in turns]
        assert all(v == 2 for v, m in zip(earlier.token_versions, earlier.loss_mask) if m)
        # No token trained twice: the two rows train as many tokens as the model wrote for this
        # trajectory in its four calls, and the second segment's prompt holds none of them.
        made = sum(len(g.response_ids) for p, g in by_prompt.items()
                   if any(p[:len(r.prompt_ids)] == tuple(r.prompt_ids) for r in (earlier, gen)))
        assert sum(earlier.loss_mask) + sum(gen.loss_mask) == made
        assert REPLIES[task.trajectory_id][2:] == [tokenizer.decode(
            t.response_ids[s:e], skip_special_tokens=True) for s, e in t.turns]
        # The first segment's counts are what the model read and wrote there.
        first_prompt = tokenizer(f"<|im_start|>user\n{task.prompt}<|im_end|>\n<|im_start|>assistant\n",
                                 add_special_tokens=False)["input_ids"]
        assert first["prompt_tokens"] == len(first_prompt)
        first_turn = by_prompt[tuple(first_prompt)]
        assert first["model_tokens"] >= len(first_turn.response_ids)


    # The rows as the rollout puts them: the earlier segment linked to the last (same group and
    # sample), both in the trainer's batch with their own loss masks.
    gens = [g for i, t in enumerate(batch.trajectories) for g in t.to_generations(i)]
    meta = [m for i, t in enumerate(batch.trajectories)
            for m in ({"group": i, "sample": 0, "agent": t.linked_summary(0)},
                      {"group": i, "sample": 0, "agent": t.summary()})]
    assert linked_rows(meta) == {0: 1, 2: 3}
    assert meta[0]["agent"]["outcome"] == "ok" and meta[0]["agent"]["segment"] == 0
    assert meta[0]["agent"]["truncated"] is False and meta[0]["agent"]["turns"] == 2
    columns = rollout_columns(gens, [t.prompt for t in tasks], ["", ""], tokenizer.pad_token_id or 0)
    train = TrainBatch.from_columns(columns, [0] * len(gens))
    assert train.response_mask.sum(dim=1).tolist() == [float(sum(g.loss_mask)) for g in gens]


def _runs(mask: list[int]) -> list[tuple[int, int]]:
    """``[start, end)`` of each run of 1s in a loss mask (a model turn)."""
    runs, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


def test_strict_history_refuses_the_summarized_call(omni_backends):
    rollout, _ = omni_backends
    limits = AgentLimits(max_turns=4, max_tokens=200, max_new_tokens=6, tool_timeout_s=60, concurrency=4)
    agent = AgentSpec(gateway=GatewaySpec(program="tests.agents.test_gateway_segments:summarizes"),
                      max_turns=4, max_tokens=200, history="strict")
    driver = ProgramDriver(agent, rollout, limits, version=lambda: 2, max_prompt_tokens=128)
    task = AgentTask(prompt="What is 1+1?", label="", row={}, index=0, sample=0, trajectory_id="strict:0")
    sampling = rollout.context.sampling
    try:
        (t,) = run_trajectories([task], driver, lambda p, s: rollout.generate_tokens(p, sampling, s), 5).trajectories
    finally:
        driver.close()
    assert "BadRequestError" in t.error and "message 0 differs" in t.error and "history=strict" in t.error
    assert len(t.turns) == 2 and not t.segments
