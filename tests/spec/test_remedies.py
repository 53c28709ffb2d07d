"""Remedies that work when followed: every fix (the command-line overrides of a ``SpecIssue`` or a
plan's note) that a rule, a shape error, the memory check or a note gives is applied with the
project's own override loader, and the spec validates and plans again without the problem and
without a new one; and no fix leads back to the problem it came from.

The rules are enumerated from their registry: each declares the specs that make it give a fix
(``Rule.examples``; one that needs files no preset has, or a plugin trait no built-in plugin has,
is made here: ``FILE_EXAMPLES``, ``TESTKIT_EXAMPLES``), so a new
rule with a fix is tested here as soon as it declares one, and
``test_every_rule_with_a_fix_declares_an_example`` fails until there is one for each place in its
code that gives a fix.
"""

from __future__ import annotations

import ast
import inspect
import json
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

import relax.spec.machine as machine
from relax.config import load_spec_dict
from relax.plan import make_plan
from relax.plan.model import Plan
from relax.registry import get_registry
from relax.spec import RunSpec, SpecError, SpecIssue, validate_spec
from relax.spec.machine import check_machine
from relax.spec.rules import MAX_CHAT_TEMPLATE_BYTES, RULES, RUNTIME_RULES, Rule, RuleContext, RuleExample
from relax.errors.translate import BOUND_KINDS
from relax.spec.validate import resolve_architecture

ALL_RULES: tuple[Rule, ...] = (*RULES, *RUNTIME_RULES, check_machine)
EXAMPLES = [(rule, example) for rule in ALL_RULES for example in rule.examples]


@pytest.fixture(autouse=True)
def gpus_here(monkeypatch, tmp_path):
    """This machine holds any GPU spec and its model (the machine checks would otherwise stop
    validation before the plan, hiding a layout or memory problem a fix might bring)."""
    monkeypatch.setattr(machine, "local_gpu_count", lambda *args, **kwargs: 4096)
    held = tmp_path / "snapshot"
    held.mkdir()
    (held / "tokenizer.json").write_text("{}")
    monkeypatch.setattr(machine, "cached_snapshot", lambda path: held)


def outcome(ref: str, overrides: Sequence[str]) -> tuple[list[SpecIssue], Plan | None]:
    """What ``relax validate`` finds (rules, runtime rules, this machine, layout and memory), and
    the plan when it finds nothing."""
    raw, base = load_spec_dict(ref, list(overrides))
    try:
        spec = validate_spec(raw, base_dir=base, runnable=True)
        return [], make_plan(spec, base_dir=base)
    except SpecError as exc:
        return exc.issues, None


def key(issue: SpecIssue) -> tuple[str, str]:
    return issue.path, issue.message


def assert_fix_works(ref: str, overrides: Sequence[str], issue: SpecIssue) -> Plan | None:
    """Apply ``issue.fix`` after ``overrides``: the issue is gone, no issue appears that was not
    there before, and no fix offered afterwards brings the issue back."""
    before = {key(i) for i in outcome(ref, overrides)[0]}
    fixed = [*overrides, *issue.fix]
    after, plan = outcome(ref, fixed)
    assert key(issue) not in {key(i) for i in after}, f"{issue.fix} leaves {issue}"
    new = [i for i in after if key(i) not in before]
    assert not new, f"following {issue.fix} brings {[str(i) for i in new]}"
    assert_no_way_back(ref, fixed, issue, after, plan)
    return plan


def assert_no_way_back(ref: str, fixed: Sequence[str], issue: SpecIssue, after: list[SpecIssue],
                       plan: Plan | None) -> None:
    """No fix offered once ``issue`` is fixed (other issues', the plan's notes') brings it back."""
    offered = [i.fix for i in after if i.fix]
    if plan is not None:
        offered += [hint.fix for hint in plan_hints(plan) if hint.fix]
    for fix in offered:
        again, _ = outcome(ref, [*fixed, *fix])
        assert key(issue) not in {key(i) for i in again}, f"{fix} leads back to {issue}"


def plan_hints(plan: Plan):
    return [hint for hint in (plan.cores_note, plan.unused_gpus) if hint is not None]


def fired(example: RuleExample) -> SpecIssue:
    issues, _ = outcome(example.preset, example.overrides)
    with_fix = [i for i in issues if i.path == example.path and i.fix]
    assert with_fix, f"{example} gives no fix at {example.path}: {[str(i) for i in issues]}"
    return with_fix[0]


def issues_of(rule: Rule, ref: str, overrides: Sequence[str]) -> set[tuple[str, str]]:
    """What ``rule`` alone reports on a spec (after the rules before it, which load the plugin
    classes it consults)."""
    raw, base = load_spec_dict(ref, list(overrides))
    spec = RunSpec.model_validate(raw)
    registry = get_registry()
    arch, _ = resolve_architecture(spec.model.path, base, registry, spec.model.options)
    ctx = RuleContext(registry=registry, base_dir=base, architecture=arch)
    for earlier in ALL_RULES:
        if earlier is rule:
            break
        list(earlier(spec, ctx))
    return {key(i) for i in rule(spec, ctx)}


@pytest.mark.parametrize(("rule", "example"), EXAMPLES,
                         ids=[f"{rule.name}:{' '.join(ex.overrides)}" for rule, ex in EXAMPLES])
def test_a_rules_fix_validates_when_applied(rule: Rule, example: RuleExample) -> None:
    issue = fired(example)
    assert key(issue) in issues_of(rule, example.preset, example.overrides), f"{issue} is not {rule.name}'s"
    assert_fix_works(example.preset, example.overrides, issue)


def _template(folder: Path, content: bytes) -> RuleExample:
    (folder / "template.jinja").write_bytes(content)
    return RuleExample("tiny-cpu", (f"data.chat_template={folder / 'template.jinja'}",), "data.chat_template")


def _missing_media(folder: Path) -> RuleExample:
    row = {"prompt": "what is shown?", "answer": "x", "image": "gone.png", "audio": "gone.wav", "video": "gone.mp4"}
    (folder / "rows.jsonl").write_text(json.dumps(row) + "\n")
    return RuleExample("tiny-omni-cpu", (f"data.train.source={folder / 'rows.jsonl'}",), "data.train.source")


#: Examples that need files no preset has, written to a test's folder: rule name -> makers.
FILE_EXAMPLES: dict[str, list[Callable[[Path], RuleExample]]] = {
    "check_chat_template": [
        lambda folder: _template(folder, b"{{ x }}" * (MAX_CHAT_TEMPLATE_BYTES // 7 + 1)),
        lambda folder: _template(folder, b"\xff\xfe{{ x }}"),
        lambda folder: _template(folder, b"{% if %}"),
        lambda folder: _template(folder, b"{% if x %}" * 80 + b"{% endif %}" * 80),  # nested past the bound
        lambda folder: _template(folder, b'{{ "x" * 100000000 }}'),  # renders past the bound (the probe)
    ],
    "check_media_files": [_missing_media],
}
FILE_CASES = [(name, i) for name, makers in FILE_EXAMPLES.items() for i in range(len(makers))]

#: Examples whose backend, loss or trait no built-in plugin has: made with the test kit's plugins
#: (``tests/spec/testkit``: a rollout that cannot pause, join a weight group, record routing or go
#: on from token ids, a trainer that replays no routing or takes no weights in memory, a loss that
#: takes no entropy). Rule name -> (preset, overrides, path).
TESTKIT_EXAMPLES: dict[str, list[tuple[str, tuple[str, ...], str]]] = {
    "check_algorithm": [("tiny-cpu", ("algorithm.entropy_coef=0.01", "algorithm.loss=test_loss"),
                         "algorithm.entropy_coef")],
    "check_weight_sync": [("tiny-cpu", ("roles.rollout.backend=test_rollout", "roles.rollout.weight_sync=collective"),
                           "roles.rollout.weight_sync")],
    "check_router_replay": [
        ("tiny-cpu", ("algorithm.router_replay=r3", "roles.rollout.backend=test_rollout"), "roles.rollout.backend"),
        ("tiny-cpu", ("algorithm.router_replay=r2", "roles.actor.backend=test_trainer"), "roles.actor.backend"),
    ],
    "check_partial": [("tiny-cpu", ("roles.rollout.partial=true", "roles.rollout.backend=test_rollout"),
                       "roles.rollout.backend")],
    "check_agent": [("tiny-agent-cpu", ("roles.rollout.backend=test_rollout",), "roles.rollout.backend")],
    "check_actor_fwd_weights": [("tiny-cpu", ("+roles.actor_fwd.backend=test_trainer",), "roles.actor_fwd.backend")],
}
TESTKIT_CASES = [(name, i) for name, examples in TESTKIT_EXAMPLES.items() for i in range(len(examples))]


@pytest.fixture
def testkit_plugins(testkit_registry, monkeypatch):
    """The test kit's plugins installed beside the built-in ones, for validation and the plan alike."""
    import relax.registry

    monkeypatch.setattr(relax.registry, "_default", testkit_registry)


@pytest.mark.parametrize(("name", "index"), TESTKIT_CASES, ids=[f"{n}:{i}" for n, i in TESTKIT_CASES])
def test_a_rules_fix_with_test_kit_plugins_validates_when_applied(name: str, index: int, testkit_plugins) -> None:
    rule = next(r for r in ALL_RULES if r.name == name)
    example = RuleExample(*TESTKIT_EXAMPLES[name][index])
    issue = fired(example)
    assert key(issue) in issues_of(rule, example.preset, example.overrides), f"{issue} is not {rule.name}'s"
    assert_fix_works(example.preset, example.overrides, issue)


@pytest.mark.parametrize(("name", "index"), FILE_CASES, ids=[f"{n}:{i}" for n, i in FILE_CASES])
def test_a_rules_fix_on_files_validates_when_applied(name: str, index: int, tmp_path: Path) -> None:
    rule = next(r for r in ALL_RULES if r.name == name)
    example = FILE_EXAMPLES[name][index](tmp_path)
    issue = fired(example)
    assert key(issue) in issues_of(rule, example.preset, example.overrides), f"{issue} is not {rule.name}'s"
    assert_fix_works(example.preset, example.overrides, issue)


def fix_sites(func, seen: set | None = None) -> int:
    """The places a check's code makes an issue with a fix (``SpecIssue(path, message, remedy,
    fix)``), in its own body and in the functions of its module it calls."""
    seen = set() if seen is None else seen
    seen.add(func)
    tree = ast.parse(textwrap.dedent(inspect.getsource(func)))
    sites = 0
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
            continue
        if node.func.id == "SpecIssue":
            sites += len(node.args) >= 4 or any(k.arg == "fix" for k in node.keywords)
            continue
        called = func.__globals__.get(node.func.id)
        if inspect.isfunction(called) and called.__module__ == func.__module__ and called not in seen:
            sites += fix_sites(called, seen)
    return sites


def test_every_rule_with_a_fix_declares_an_example() -> None:
    """A rule that gives fixes declares a spec for each place it gives one."""
    for rule in ALL_RULES:
        examples = (len(rule.examples) + len(FILE_EXAMPLES.get(rule.name, ()))
                    + len(TESTKIT_EXAMPLES.get(rule.name, ())))
        sites = fix_sites(rule.check)
        assert examples >= sites, f"{rule.name} gives a fix in {sites} places but has {examples} examples"


# -- the spec's shape ------------------------------------------------------------------------------

#: (preset, override, path, pydantic error kind): a misspelt key or choice, a value past an inclusive bound.
SHAPE_CASES = [
    ("tiny-cpu", "trainer.stpes=5", "trainer.stpes", "extra_forbidden"),
    ("tiny-cpu", "async_policy.correction=tiss", "async_policy.correction", "literal_error"),
    ("tiny-cpu", "algorithm.prompts_per_step=0", "algorithm.prompts_per_step", "greater_than_equal"),
    ("tiny-cpu", "roles.rollout.gpu_memory_utilization=1.5", "roles.rollout.gpu_memory_utilization",
     "less_than_equal"),
]


@pytest.mark.parametrize(("ref", "change", "path", "kind"), SHAPE_CASES, ids=[c[3] for c in SHAPE_CASES])
def test_a_shape_errors_fix_validates_when_applied(ref, change, path, kind) -> None:
    issues, _ = outcome(ref, [change])
    issue = next(i for i in issues if i.path == path)
    assert issue.fix, f"{issue} has no fix"
    assert_fix_works(ref, [change], issue)


def test_every_kind_of_shape_error_with_a_fix_has_a_case() -> None:
    assert {case[3] for case in SHAPE_CASES} == {"extra_forbidden", "literal_error", *BOUND_KINDS}


def test_a_plugins_options_keep_their_fix() -> None:
    """A plugin's ``Config`` is checked like the spec's shape (``Registry.validate_options``)."""
    issues, _ = outcome("tiny-cpu", ["data.train.options.size=0"])
    issue = next(i for i in issues if i.path == "data.train.options.size")
    assert issue.fix == ("data.train.options.size=1",) and "(plugin 'synthetic:arithmetic'" in issue.message
    assert_fix_works("tiny-cpu", ["data.train.options.size=0"], issue)


def test_a_name_merely_like_an_installed_one_is_mentioned_not_fixed() -> None:
    """length_penalty is a plugin of its own (examples/relax-reward-length), not a typo of overlong_penalty."""
    issues, _ = outcome("tiny-cpu", ["rewards.0.name=length_penalty"])
    issue = next(i for i in issues if i.path == "rewards[0].name")
    assert "did you mean 'overlong_penalty'?" in issue.remedy and issue.fix == ()


# -- the layout -----------------------------------------------------------------------------------

#: (preset, overrides, path): every place ``relax.plan.placement`` refuses a layout: a tensor-parallel
#: group wider than a node, roles that do not pack into the nodes, an evaluation worker with no GPU left.
LAYOUT_CASES = [
    ("qwen3-4b-grpo-async", ("cluster.gpus_per_node=2", "cluster.nodes=4", "roles.actor.backend=megatron",
                             "roles.actor.parallel.tp=4"), "roles.actor.parallel.tp"),
    ("qwen3-4b-grpo-async", ("cluster.gpus_per_node=4", "cluster.nodes=3", "roles.rollout.backend=vllm",
                             "roles.rollout.replicas=1", "roles.rollout.gpus_per_replica=8",
                             "roles.rollout.parallel.tp=8"), "roles.rollout.gpus_per_replica"),
    ("qwen3-4b-grpo-async", ("cluster.gpus_per_node=3", "cluster.nodes=2", "roles.rollout.backend=vllm",
                             "roles.rollout.replicas=2", "roles.rollout.gpus_per_replica=2",
                             "roles.rollout.parallel.tp=2", "roles.actor.backend=megatron", "roles.actor.gpus=2",
                             "roles.actor.parallel.tp=2"), "cluster"),
    ("qwen3-4b-grpo-async", ("+data.eval.source=data/math-sample.jsonl", "trainer.eval.host=own"), "trainer.eval.host"),
]


@pytest.mark.parametrize(("ref", "overrides", "path"), LAYOUT_CASES, ids=[c[2] for c in LAYOUT_CASES])
def test_a_layout_fix_validates_when_applied(ref, overrides, path) -> None:
    issues, _ = outcome(ref, overrides)
    issue = next(i for i in issues if i.path == path)
    assert issue.fix, f"{issue} has no fix"
    assert_fix_works(ref, overrides, issue)


# -- memory ---------------------------------------------------------------------------------------

#: (preset, overrides, the role's path, words its remedy names, words it must not name): a
#: rollout's KV cache (hf, vllm, colocated), a trained role's state and activations (torch, megatron).
MEMORY_CASES = [
    ("qwen3-4b-grpo-async", ("algorithm.prompts_per_step=128",), "roles.rollout",
     ("roles.rollout.replicas", "algorithm.prompts_per_step", "roles.rollout.sampling.max_new_tokens"),
     ("gradient_checkpointing", "micro_batch_size", "gpu_memory_utilization")),
    ("qwen3-4b-grpo-async", ("roles.rollout.backend=vllm", "algorithm.prompts_per_step=128"), "roles.rollout",
     ("roles.rollout.replicas", "algorithm.prompts_per_step", "roles.rollout.gpu_memory_utilization"),
     ("gradient_checkpointing", "micro_batch_size")),
    ("qwen3-4b-grpo-colocate", ("cluster.gpu_memory_gb=80",), "roles.rollout",
     ("algorithm.prompts_per_step", "roles.rollout.sampling.max_new_tokens"),
     ("roles.rollout.replicas", "gradient_checkpointing")),
    ("qwen3-4b-grpo-async", ("roles.actor.gradient_checkpointing=false", "roles.actor.micro_batch_size=16"),
     "roles.actor", ("roles.actor.gradient_checkpointing", "roles.actor.micro_batch_size", "splits the model (megatron)"),
     ("roles.rollout.replicas", "parallel.tp", "prompts_per_step", "roles.actor.gpus")),
    ("qwen3-4b-grpo-async",
     ("roles.actor.backend=megatron", "roles.actor.micro_batch_size=1", "cluster.gpu_memory_gb=60"), "roles.actor", ("roles.actor.parallel.tp", "roles.actor.gpus"), ("roles.rollout.replicas", "prompts_per_step")),
]


@pytest.mark.parametrize(("ref", "overrides", "path", "named", "not_named"), MEMORY_CASES,
                         ids=[f"{c[2]}:{' '.join(c[1])}" for c in MEMORY_CASES])
def test_a_memory_fix_fits_the_role_and_validates(ref, overrides, path, named, not_named) -> None:
    issues, _ = outcome(ref, overrides)
    issue = next(i for i in issues if i.path == path)
    assert "exceeds cluster.gpu_memory_gb" in issue.message
    for word in named:
        assert word in issue.remedy, f"{path}'s remedy does not name {word}: {issue.remedy}"
    for word in not_named:
        assert word not in issue.remedy, f"{path}'s remedy names {word}, which does not apply: {issue.remedy}"
    assert issue.fix, f"no fix found for {issue}"
    assert all(item.split("=")[0] in issue.remedy or item.startswith(path) for item in issue.fix)
    assert_fix_works(ref, overrides, issue)


# -- the plan's notes -----------------------------------------------------------------------------


@pytest.fixture
def two_cores(monkeypatch):
    from relax.plan import wiring

    monkeypatch.setattr(wiring, "available_cores", lambda: 2)


def test_the_cores_note_gives_the_whole_colocate_fix(two_cores) -> None:
    """The user's report: the note suggested placement.mode=colocate, which alone exits 2."""
    alone, _ = outcome("tiny-cpu", ["placement.mode=colocate"])
    assert [i.path for i in alone] == ["async_policy.max_staleness"]
    _, plan = outcome("tiny-cpu", [])
    hint = plan.cores_note
    assert hint is not None and hint.text in plan.notes
    assert hint.fix == ["placement.mode=colocate", "async_policy.max_staleness=0"]
    assert hint.text.endswith("run it with placement.mode=colocate async_policy.max_staleness=0")
    after, fixed = outcome("tiny-cpu", hint.fix)
    assert after == [] and fixed.mode == "colocate" and fixed.cores_note is None
    assert_no_way_back("tiny-cpu", hint.fix, SpecIssue("", hint.text), after, fixed)


def test_unused_gpus_are_noted_where_they_are_with_a_fix_that_uses_them() -> None:
    """A 2 x 8 cluster of which the roles use 8: the plan says so, in its table and its JSON."""
    from relax.plan import render

    _, plan = outcome("qwen3-4b-grpo-async", ["cluster.nodes=2"])
    hint = plan.unused_gpus
    assert hint is not None and (hint.count, hint.by_node) == (8, {"1": list(range(8))})
    assert hint.fix == ["roles.rollout.replicas=12"]
    assert f"Note: {hint.text}" in render(plan, "table") and "8 of the cluster's 16 GPUs are unused" in hint.text
    assert '"unused_gpus"' in render(plan, "json")
    after, fixed = outcome("qwen3-4b-grpo-async", ["cluster.nodes=2", *hint.fix])
    assert after == [] and fixed.unused_gpus is None and fixed.gpus_used == 16
    assert_no_way_back("qwen3-4b-grpo-async", ["cluster.nodes=2", *hint.fix], SpecIssue("", hint.text), after, fixed)


def test_the_run_banner_prints_the_unused_gpus_note_with_its_fix(tmp_path) -> None:
    from relax.runtime.driver.run_text import banner

    raw, base = load_spec_dict("qwen3-4b-grpo-async", ["cluster.nodes=2"])
    spec = validate_spec(raw, base_dir=base)
    plan = make_plan(spec, base_dir=base)
    assert banner(spec, plan, tmp_path).splitlines()[-1] == f"  note     {plan.unused_gpus.text}"
    assert plan.unused_gpus.text.endswith("roles.rollout.replicas=12 uses them")


@pytest.mark.parametrize(("ref", "overrides"), [
    ("qwen3-4b-grpo-async", ["cluster.gpus_per_node=10"]),      # two more rollout replicas
    ("qwen3-4b-grpo-hybrid", ["cluster.nodes=2"]),              # the rollout's replicas on the second node
    ("qwen3-4b-grpo-colocate", ["cluster.gpus_per_node=4"]),    # hf has no tp: a colocated engine stays on one GPU
])
def test_every_unused_gpu_fix_leaves_none_unused(ref, overrides) -> None:
    _, plan = outcome(ref, overrides)
    hint = plan.unused_gpus
    assert hint is not None and hint.fix, plan.notes
    after, fixed = outcome(ref, [*overrides, *hint.fix])
    assert after == [] and fixed.unused_gpus is None


def test_the_gpus_an_elastic_rollout_may_grow_into_are_not_unused() -> None:
    elastic = ["roles.rollout.replicas=2", "roles.rollout.max_replicas=4", "algorithm.prompts_per_step=32"]
    _, plan = outcome("qwen3-4b-grpo-async", elastic)
    assert plan.gpus_used == 6 and plan.unused_gpus is None
    _, plan = outcome("qwen3-4b-grpo-async", [*elastic[:1], "roles.rollout.max_replicas=3", *elastic[2:]])
    hint = plan.unused_gpus
    assert hint.count == 2 and "1 of them left for the elastic rollout" in hint.text
    assert hint.fix == ["roles.rollout.max_replicas=4"]
    after, fixed = outcome("qwen3-4b-grpo-async", [*elastic[:1], "roles.rollout.max_replicas=3", *elastic[2:], *hint.fix])
    assert after == [] and fixed.unused_gpus is None


def test_a_plan_using_every_gpu_has_no_unused_note() -> None:
    _, plan = outcome("qwen3-4b-grpo-async", [])
    assert plan.unused_gpus is None and plan.gpus_used == 16 // 2


# -- how a fix is shown ---------------------------------------------------------------------------


def test_the_command_line_shows_a_fix_as_the_command_to_run_and_that_command_passes(capsys) -> None:
    from relax.cli import main

    assert main(["validate", "tiny-cpu", "placement.mode=colocate"]) == 2
    err = capsys.readouterr().err
    line = next(line for line in err.splitlines() if line.strip().startswith("fix: "))
    command = line.strip().removeprefix("fix: ")
    assert command == "relax validate tiny-cpu placement.mode=colocate async_policy.max_staleness=0"
    assert main(command.split()[1:]) == 0


def test_a_misspelt_key_moves_to_the_key_meant(capsys) -> None:
    """The deletion comes after the user's override, so it removes the key wherever it was set."""
    from relax.cli import main

    assert main(["validate", "tiny-cpu", "trainer.stpes=5"]) == 2
    line = next(line for line in capsys.readouterr().err.splitlines() if line.strip().startswith("fix: "))
    assert line.strip() == "fix: relax validate tiny-cpu trainer.stpes=5 '~trainer.stpes' trainer.steps=5"
    assert main(["validate", "tiny-cpu", "trainer.stpes=5", "~trainer.stpes", "trainer.steps=5"]) == 0


def test_a_fix_replaces_the_overrides_of_the_keys_it_sets(capsys) -> None:
    from relax.cli import main

    assert main(["plan", "qwen3-4b-grpo-async", "algorithm.prompts_per_step=128"]) == 2
    line = next(line for line in capsys.readouterr().err.splitlines() if line.strip().startswith("fix: "))
    assert line.strip() == "fix: relax plan qwen3-4b-grpo-async algorithm.prompts_per_step=64"


def test_an_issue_shows_its_fix_as_overrides() -> None:
    issue = SpecIssue("async_policy.max_staleness", "1 is not possible", "set it to 0",
                      ("async_policy.max_staleness=0",))
    assert str(issue) == ("async_policy.max_staleness: 1 is not possible; set it to 0 "
                          "(fix: async_policy.max_staleness=0)")
    assert str(SpecIssue("a", "b", "c")) == "a: b; c"
