"""The migration pages (docs/migrate-verl.md, docs/migrate-trl.md) and their converted examples
(examples/migrate/): every Relax key the pages' tables name exists in the run spec's schema (with
the value the cell gives, when it gives one), the converted specs pass ``relax validate``, and each
keeps the values of the source config (veRL keys, TRL ``GRPOConfig`` arguments) the tables map."""

from __future__ import annotations

import re
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel

from relax.cli import main
from relax.config import load_spec_dict
from relax.spec import RunSpec, validate_spec

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
EXAMPLES = ROOT / "examples" / "migrate"
PAGES = ["migrate-verl.md", "migrate-trl.md"]

_TOKEN = re.compile(r"`([^`]+)`")
_KEY = re.compile(r"^(?P<key>[a-z_][a-z0-9_]*(?:\[\])?(?:\.[a-z_][a-z0-9_]*(?:\[\])?)*)(?:\s*:\s*(?P<value>.+))?$")


# -- the tables --------------------------------------------------------------------------------------


def table_rows(text: str) -> list[tuple[list[str], list[str]]]:
    """(header cells, row cells) of every markdown table row of ``text``."""
    rows, header = [], None
    for line in text.splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if header is None:
            header = cells
        elif not all(set(cell) <= set("-: ") for cell in cells):
            rows.append((header, cells))
    return rows


def relax_cells(text: str) -> list[str]:
    """The cells of the Relax column (the first whose header names Relax) of every table."""
    cells = []
    for header, row in table_rows(text):
        column = next((i for i, name in enumerate(header) if "Relax" in name), None)
        if column is not None and column < len(row):
            cells.append(row[column])
    return cells


def named_keys(cell: str) -> list[tuple[str, str | None]]:
    """(dotted key, value or None) of each backticked spec key in a cell: a dotted path, or a
    top-level section name, optionally followed by ``: value``. ``relax.<kind>`` names a plugin
    group (an entry-point group), not a key."""
    found = []
    for token in _TOKEN.findall(cell):
        match = _KEY.match(token.strip())
        if match is None:
            continue
        key = match["key"]
        if key.startswith("relax."):  # a plugin group (relax.rewards), not a key: no section is called relax
            continue
        if "." in key or key.removesuffix("[]") in RunSpec.model_fields:
            found.append((key, match["value"]))
    return found


def _unwrap(annotation: Any) -> Any:
    """The section model (or dict / scalar type) behind Optional[...] and list[...]."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        models = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
        return models[0] if models else args[0]
    if origin is list:
        return _unwrap(args[0])
    return annotation


def resolve(key: str) -> str | None:
    """None when ``key`` names a field of RunSpec (through its sections), else what is wrong. A
    free-form map (plugin options, media keys) ends the check: its keys are the plugin's."""
    model: Any = RunSpec
    parts = key.split(".")
    for depth, part in enumerate(parts):
        name = part.removesuffix("[]")
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return f"{'.'.join(parts[:depth])} is not a section, so it has no '{name}'"
        if name not in model.model_fields:
            return f"{model.__name__} has no field '{name}' (in {key})"
        annotation = _unwrap(model.model_fields[name].annotation)
        if annotation is dict or typing.get_origin(annotation) is dict:
            return None
        model = annotation
    return None


def nest(key: str, value: Any) -> dict[str, Any]:
    """``a.b.c`` and a value as a nested dict (``rewards[]`` as a one-entry list)."""
    for part in reversed(key.split(".")):
        if part.endswith("[]"):
            value = {part[:-2]: [value]}
        else:
            value = {part: value}
    return value


def _merge(into: dict[str, Any], extra: dict[str, Any]) -> None:
    for name, value in extra.items():
        if isinstance(value, dict) and isinstance(into.get(name), dict):
            _merge(into[name], value)
        else:
            into[name] = value


def with_required(key: str, value: Any) -> dict[str, Any]:
    """A spec dict holding ``key: value`` (and the name every spec and agent block needs)."""
    raw: dict[str, Any] = {"name": "keys"}
    if key.startswith("roles.rollout.agent."):  # an agent block needs its driver
        _merge(raw, nest("roles.rollout.agent.environment", "calculator"))
    _merge(raw, nest(key, value))
    return raw


@pytest.mark.parametrize("page", PAGES)
def test_every_relax_key_of_the_tables_is_in_the_spec(page):
    keys = [found for cell in relax_cells((DOCS / page).read_text()) for found in named_keys(cell)]
    assert len({key for key, _ in keys}) >= 30, f"{page}: too few Relax keys found; did the tables change shape?"
    problems = [f"{key}: {why}" for key, _ in keys if (why := resolve(key)) is not None]
    assert not problems, f"{page} names keys the run spec does not have:\n" + "\n".join(problems)


@pytest.mark.parametrize("page", PAGES)
def test_the_values_the_tables_give_are_valid(page):
    checked = 0
    for cell in relax_cells((DOCS / page).read_text()):
        for key, value in named_keys(cell):
            if value is None:
                continue
            parsed = yaml.safe_load(value)
            RunSpec.model_validate(with_required(key, parsed))  # raises on a value the key refuses
            checked += 1
    assert checked >= 5


def test_the_key_check_catches_a_wrong_key():
    assert resolve("roles.actor.optimizer.lr") is None
    assert resolve("algorithm.clip.c") is None
    assert resolve("rewards[].weight") is None
    assert resolve("roles.actor.options.pack_sequences") is None  # plugin options: the plugin's keys
    assert resolve("roles.actor.optimizer.learning_rate") is not None
    assert resolve("algorithm.clip.c.d") is not None
    assert resolve("trainer.epochs_total") is not None
    cells = relax_cells("| veRL | Relax | notes |\n| --- | --- | --- |\n"
                        "| `a.b` | `algorithm.kl_in: loss` and `seed` | `not.checked` |\n")
    assert [found for cell in cells for found in named_keys(cell)] == [("algorithm.kl_in", "loss"), ("seed", None)]


# -- the converted examples --------------------------------------------------------------------------


def converted(name: str) -> RunSpec:
    raw, base = load_spec_dict(EXAMPLES / name)
    return validate_spec(raw, base_dir=base)


def source(name: str) -> dict[str, Any]:
    return yaml.safe_load((EXAMPLES / name).read_text())


def get(tree: dict[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        tree = tree[part]
    return tree


def leaves(tree: dict[str, Any], prefix: str = "") -> set[str]:
    out = set()
    for name, value in tree.items():
        path = f"{prefix}{name}"
        out |= leaves(value, path + ".") if isinstance(value, dict) else {path}
    return out


@pytest.mark.parametrize("name", ["from-verl.yaml", "from-trl.yaml"])
def test_converted_specs_pass_relax_validate(name, capsys):
    assert main(["validate", str(EXAMPLES / name)]) == 0, capsys.readouterr().err
    spec = converted(name)
    assert spec.model.path == "builtin:tiny-lm" and spec.cluster.gpus_per_node == 0  # runs on a CPU
    assert [r.name for r in spec.rewards] == ["exact_match"]


VERL_KL = {"low_var_kl": "k3", "k3": "k3", "kl": "k1", "k1": "k1", "mse": "k2", "k2": "k2"}

#: veRL keys of the source the converted spec swaps for the CPU run, or that have no Relax key of
#: their own (each explained in docs/migrate-verl.md); every other key must be compared below.
VERL_NOT_COMPARED = {
    "data.train_files": "swapped: the synthetic arithmetic set",
    "actor_rollout_ref.model.path": "swapped: builtin:tiny-lm",
    "actor_rollout_ref.rollout.name": "swapped: the hf rollout on CPU",
    "actor_rollout_ref.actor.strategy": "swapped: the torch trainer on CPU",
    "trainer.n_gpus_per_node": "swapped: CPU",
    "data.truncation": "Relax truncates from the left; the tiny prompts are never truncated",
    "actor_rollout_ref.model.use_remove_padding": "the torch trainer packs rows by default",
    "trainer.test_freq": "no evaluation data in the example",
    "trainer.val_before_train": "no evaluation data in the example",
    "trainer.project_name": "a logger option; console logging only",
    "trainer.experiment_name": "the run's name",
    "trainer.logger": "console only: Relax always prints progress",
    "trainer.default_local_dir": "the output folder",
}


def test_from_verl_keeps_the_veRL_values():
    src, spec = source("verl-grpo-tiny.yaml"), converted("from-verl.yaml")
    algo, actor, sampling = spec.algorithm, spec.roles.actor, spec.roles.rollout.sampling
    a = "actor_rollout_ref.actor."
    compared = {
        "algorithm.adv_estimator": (get(src, "algorithm.adv_estimator"), algo.name),
        "algorithm.norm_adv_by_std_in_grpo": (get(src, "algorithm.norm_adv_by_std_in_grpo"),
                                              algo.advantage_options.get("normalize_std", True)),
        "algorithm.use_kl_in_reward": (get(src, "algorithm.use_kl_in_reward"), algo.kl_in == "reward"),
        "data.prompt_key": (get(src, "data.prompt_key"), spec.data.prompt_key),
        "data.train_batch_size": (get(src, "data.train_batch_size"), algo.prompts_per_step),
        "data.max_prompt_length": (get(src, "data.max_prompt_length"), spec.data.max_prompt_tokens),
        "data.max_response_length": (get(src, "data.max_response_length"), sampling.max_new_tokens),
        "data.shuffle": (get(src, "data.shuffle"), spec.data.shuffle),
        "actor_rollout_ref.hybrid_engine": (get(src, "actor_rollout_ref.hybrid_engine"),
                                            spec.placement.mode == "colocate"
                                            and spec.async_policy.max_staleness == 0),
        "actor_rollout_ref.model.enable_gradient_checkpointing": (
            get(src, "actor_rollout_ref.model.enable_gradient_checkpointing"), actor.gradient_checkpointing),
        a + "optim.lr": (get(src, a + "optim.lr"), actor.optimizer.lr),
        a + "optim.weight_decay": (get(src, a + "optim.weight_decay"), actor.optimizer.weight_decay),
        a + "optim.betas": (tuple(get(src, a + "optim.betas")), tuple(actor.optimizer.betas)),
        a + "optim.clip_grad": (get(src, a + "optim.clip_grad"), actor.optimizer.grad_clip),
        a + "ppo_mini_batch_size": (get(src, "data.train_batch_size") // get(src, a + "ppo_mini_batch_size"),
                                    algo.updates_per_step),
        a + "ppo_micro_batch_size_per_gpu": (get(src, a + "ppo_micro_batch_size_per_gpu"), actor.micro_batch_size),
        a + "ppo_epochs": (get(src, a + "ppo_epochs"), 1),  # Relax trains each sample once a step
        a + "use_kl_loss": (get(src, a + "use_kl_loss"),
                            algo.kl_in == "loss" and algo.kl_coef > 0 and spec.roles.reference is not None),
        a + "kl_loss_coef": (get(src, a + "kl_loss_coef"), algo.kl_coef),
        a + "kl_loss_type": (VERL_KL[get(src, a + "kl_loss_type")], algo.kl_estimator),
        a + "entropy_coeff": (get(src, a + "entropy_coeff"), algo.entropy_coef),
        a + "clip_ratio_low": (get(src, a + "clip_ratio_low"), algo.clip.low),
        a + "clip_ratio_high": (get(src, a + "clip_ratio_high"), algo.clip.high),
        a + "clip_ratio_c": (get(src, a + "clip_ratio_c"), algo.clip.c),
        a + "loss_agg_mode": (get(src, a + "loss_agg_mode"), algo.loss_aggregation),
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": (
            get(src, "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu"), spec.roles.reference.micro_batch_size),
        "actor_rollout_ref.rollout.n": (get(src, "actor_rollout_ref.rollout.n"), algo.samples_per_prompt),
        "actor_rollout_ref.rollout.temperature": (get(src, "actor_rollout_ref.rollout.temperature"),
                                                  sampling.temperature),
        "actor_rollout_ref.rollout.top_p": (get(src, "actor_rollout_ref.rollout.top_p"), sampling.top_p),
        "actor_rollout_ref.rollout.top_k": (max(get(src, "actor_rollout_ref.rollout.top_k"), 0), sampling.top_k),
        "trainer.total_training_steps": (get(src, "trainer.total_training_steps"), spec.trainer.steps),
        "trainer.save_freq": (get(src, "trainer.save_freq"), spec.trainer.checkpoint_every),
        "trainer.max_actor_ckpt_to_keep": (get(src, "trainer.max_actor_ckpt_to_keep"), spec.trainer.keep_checkpoints),
        "trainer.nnodes": (get(src, "trainer.nnodes"), spec.cluster.nodes),
    }
    compared[a + "optim.lr_scheduler_type"] = (get(src, a + "optim.lr_scheduler_type"), actor.optimizer.lr_schedule)
    differ = {key: pair for key, pair in compared.items() if pair[0] != pair[1]}
    assert not differ, f"from-verl.yaml does not keep these veRL values (source, Relax): {differ}"
    assert leaves(src) == set(compared) | set(VERL_NOT_COMPARED), \
        "every key of verl-grpo-tiny.yaml is compared or listed in VERL_NOT_COMPARED"
    page = (DOCS / "migrate-verl.md").read_text()
    missing = [key for key in compared if f"`{key}" not in page]
    assert not missing, f"docs/migrate-verl.md does not map {missing}"


#: TRL arguments of the source the converted spec swaps or that have no Relax key of their own.
TRL_NOT_COMPARED = {
    "logging_steps": "Relax writes a metrics row every step",
    "report_to": "none: metrics.jsonl only",
    "output_dir": "the output folder",
}


def test_from_trl_keeps_the_TRL_values():
    src, spec = source("trl-grpo-tiny.yaml"), converted("from-trl.yaml")
    algo, actor, sampling = spec.algorithm, spec.roles.actor, spec.roles.rollout.sampling
    completions = src["per_device_train_batch_size"] * src["gradient_accumulation_steps"]  # one process
    steps_per_generation = src.get("steps_per_generation", src["gradient_accumulation_steps"])
    aggregation = {"dapo": "token-mean", "bnpo": "token-mean", "grpo": "seq-mean-token-mean",
                   "dr_grpo": "seq-mean-token-sum-norm"}
    compared = {
        "seed": (src["seed"], spec.seed),
        "max_steps": (src["max_steps"], spec.trainer.steps),
        "learning_rate": (src["learning_rate"], actor.optimizer.lr),
        "weight_decay": (src["weight_decay"], actor.optimizer.weight_decay),
        "adam_beta1": (src["adam_beta1"], actor.optimizer.betas[0]),
        "adam_beta2": (src["adam_beta2"], actor.optimizer.betas[1]),
        "adam_epsilon": (src["adam_epsilon"], actor.optimizer.eps),
        "max_grad_norm": (src["max_grad_norm"], actor.optimizer.grad_clip),
        "per_device_train_batch_size": (src["per_device_train_batch_size"], actor.micro_batch_size),
        "gradient_accumulation_steps": (completions // src["num_generations"], algo.prompts_per_step),
        "num_generations": (src["num_generations"], algo.samples_per_prompt),
        "max_completion_length": (src["max_completion_length"], sampling.max_new_tokens),
        "temperature": (src["temperature"], sampling.temperature),
        "top_p": (src["top_p"], sampling.top_p),
        "top_k": (src["top_k"], sampling.top_k),
        "beta": (src["beta"], algo.kl_coef),
        "num_iterations": (src["num_iterations"], 1),  # Relax trains each sample once a step
        "epsilon": (src["epsilon"], algo.clip.low),
        "epsilon_high": (src["epsilon_high"], algo.clip.high),
        "loss_type": (aggregation[src["loss_type"]], algo.loss_aggregation),
        "scale_rewards": (src["scale_rewards"] in ("group", True), algo.advantage_options.get("normalize_std", True)),
        "mask_truncated_completions": (src["mask_truncated_completions"], False),  # not built in
        "use_vllm": ("vllm" if src["use_vllm"] else "hf", spec.roles.rollout.backend),
        "bf16": ("bfloat16" if src["bf16"] else "float32", spec.model.dtype),
        "gradient_checkpointing": (src["gradient_checkpointing"], actor.gradient_checkpointing),
        "shuffle_dataset": (src["shuffle_dataset"], spec.data.shuffle),
        "save_steps": (src["save_steps"], spec.trainer.checkpoint_every),
        "save_total_limit": (src["save_total_limit"], spec.trainer.keep_checkpoints),
    }
    compared["updates_per_step"] = (steps_per_generation // src["gradient_accumulation_steps"], algo.updates_per_step)
    # TRL alternates generation and training: on-policy, the rollout's log-probs are the trainer's.
    compared["on-policy"] = (src["num_iterations"] == 1,
                             spec.placement.mode == "colocate" and spec.async_policy.max_staleness == 0)
    compared["group std epsilon"] = (1e-4, algo.advantage_options.get("eps"))  # fixed in TRL's trainer
    compared["lr_scheduler_type"] = (src["lr_scheduler_type"], actor.optimizer.lr_schedule)
    compared["repetition_penalty"] = (src["repetition_penalty"], sampling.repetition_penalty)
    differ = {key: pair for key, pair in compared.items() if pair[0] != pair[1]}
    assert not differ, f"from-trl.yaml does not keep these TRL values (source, Relax): {differ}"
    assert set(src) <= set(compared) | set(TRL_NOT_COMPARED), \
        f"arguments of trl-grpo-tiny.yaml neither compared nor listed: {set(src) - set(compared) - set(TRL_NOT_COMPARED)}"
    page = (DOCS / "migrate-trl.md").read_text()
    missing = [key for key in set(src) & set(compared) if f"`{key}`" not in page]
    assert not missing, f"docs/migrate-trl.md does not map {missing}"
