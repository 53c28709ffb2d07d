"""The ``megatron`` trainer: HF <-> Megatron conversion, conformance with the ``torch`` trainer,
tensor, pipeline and expert parallelism over gloo ranks, MoE routing replay and the mismatch
metrics, a run through the real runtime, and its refusals.

Runs in the megatron lane (``nox -s megatron`` or ``pytest -m megatron``); megatron-core runs on CPU
here through the stand-ins of ``tests/backends/megatron_cpu.py``.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.backends.megatron_cpu import WORKER_SETUP, build_trainer, probe, routed_batch, sample_batch, trainer_spec

pytestmark = [pytest.mark.megatron, pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 99  # tiny-lm's vocabulary: odd, so tp=2 pads a row
SMALL = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, intermediate_size=96, max_position_embeddings=128)
#: Architectures built at random beside tiny-lm, with the options that exercise each mapping.
ARCHITECTURES = {
    "llama-tied": ("LlamaConfig", dict(tie_word_embeddings=True)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=False)),
    "qwen3": ("Qwen3Config", dict(tie_word_embeddings=False)),
    "qwen3-moe": ("Qwen3MoeConfig", dict(tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=32, norm_topk_prob=True)),
    "qwen3-moe-unnormalised": ("Qwen3MoeConfig", dict(tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2,
                                                      moe_intermediate_size=32, norm_topk_prob=False)),
    "mixtral": ("MixtralConfig", dict(tie_word_embeddings=False, num_local_experts=4, num_experts_per_tok=2)),
}


@pytest.fixture(scope="session", autouse=True)
def cpu_megatron():
    from tests.backends.megatron_cpu import install_cpu_shims

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    install_cpu_shims()
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_lm(tmp_path_factory) -> str:
    """builtin:tiny-lm (Llama, tied embeddings, one kv head), lightly warmed up."""
    from relax.contracts import PluginKind
    from relax.registry import get_registry

    cls = get_registry().load(PluginKind.models, "tiny-lm")
    return cls(cls.Config(warmup_steps=20)).materialize(str(tmp_path_factory.mktemp("relax-cache")))


@pytest.fixture(scope="session")
def models(tiny_lm, tmp_path_factory) -> dict[str, str]:
    """Folders of small random models of each architecture, with tiny-lm's tokenizer. Norm weights
    and biases are perturbed so a swapped or dropped one changes the outputs."""
    import transformers

    root = tmp_path_factory.mktemp("hf-models")
    folders = {"tiny-lm": tiny_lm}
    for name, (config_class, options) in ARCHITECTURES.items():
        torch.manual_seed(len(name))
        model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, config_class)(**SMALL, **options))
        with torch.no_grad():
            for key, param in model.named_parameters():
                if "norm" in key or key.endswith("bias"):
                    param.add_(torch.randn_like(param) * 0.1)
        model.save_pretrained(root / name)
        for file in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(Path(tiny_lm) / file, root / name / file)
        folders[name] = str(root / name)
    return folders


def _hf_config(path: str) -> dict:
    return json.loads((Path(path) / "config.json").read_text())


def _hf_state(path: str) -> dict[str, torch.Tensor]:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path).state_dict()


def _file_state(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(path) / "model.safetensors"))


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 0.0) -> None:
    assert sorted(a) == sorted(b)
    for key in a:
        assert a[key].shape == b[key].shape, key
        if atol == 0.0:
            assert torch.equal(a[key], b[key]), key
        else:
            assert torch.allclose(a[key], b[key], atol=atol, rtol=0), (key, (a[key] - b[key]).abs().max())


def _real_tokens(batch) -> torch.Tensor:
    """Token positions with a real context: attended and not the first token of the row."""
    mask = batch.attention_mask.bool().clone()
    mask[torch.arange(batch.batch_size), mask.int().argmax(dim=1)] = False
    return mask


# -- 1. conversion ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["tiny-lm", *ARCHITECTURES])
def test_hf_megatron_hf_round_trip_is_exact(models, name) -> None:
    from relax_plugins.trainer.megatron_weights import hf_to_megatron, layout_from_hf_config, megatron_to_hf

    layout = layout_from_hf_config(_hf_config(models[name]))
    in_memory = _hf_state(models[name])  # transformers 5's layout (fused experts), lm_head included
    _assert_same(megatron_to_hf(hf_to_megatron(in_memory, layout), layout), in_memory)
    on_disk = _file_state(models[name])  # save_pretrained's layout (one matrix per expert, no tied lm_head)
    back = megatron_to_hf(hf_to_megatron(on_disk, layout), layout, fused_experts=False)
    if layout.tied_embeddings:
        assert back.pop("lm_head.weight") is back["model.embed_tokens.weight"]
    _assert_same(back, on_disk)


@pytest.mark.parametrize("name", ["llama-tied", "qwen2", "qwen3-moe"])
def test_tensor_parallel_shards_join_back_exactly(models, name) -> None:
    from relax_plugins.trainer.megatron_weights import (hf_to_megatron, layout_from_hf_config, padded_vocab_size,
                                                        shard, unshard)

    layout = layout_from_hf_config(_hf_config(models[name]))
    full = hf_to_megatron(_file_state(models[name]), layout)
    shards = [shard(full, layout, rank, 2) for rank in range(2)]
    assert shards[0]["embedding.word_embeddings.weight"].shape[0] == padded_vocab_size(layout, 2) // 2 == 50
    assert torch.equal(shards[1]["embedding.word_embeddings.weight"][-1], torch.zeros(layout.hidden_size))
    # each rank's fc1 holds its own gate rows, then its own up rows
    gate, up = full["decoder.layers.0.mlp.linear_fc1.weight" if not layout.is_moe else
                    "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"].chunk(2)
    fc1 = shards[1]["decoder.layers.0.mlp.linear_fc1.weight" if not layout.is_moe else
                    "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"]
    assert torch.equal(fc1, torch.cat([gate.chunk(2)[1], up.chunk(2)[1]]))
    _assert_same(unshard(shards, layout), full)


def test_the_megatron_model_holds_exactly_the_checkpoint(models) -> None:
    from relax_plugins.trainer.megatron import MegatronTrainer

    path = models["qwen3-moe"]
    trainer = build_trainer(MegatronTrainer, trainer_spec(path), path)
    _assert_same(trainer.weights(), _hf_state(path))


# -- 2. conformance with the torch trainer ----------------------------------------------------------


@pytest.mark.parametrize(("name", "aggregation"), [
    ("tiny-lm", "token-mean"), ("tiny-lm", "seq-mean-token-mean"), ("qwen2", "token-mean"),
    ("qwen3", "token-mean"), ("qwen3-moe", "token-mean"), ("qwen3-moe-unnormalised", "token-mean"),
    ("mixtral", "token-mean")])
def test_megatron_and_torch_trainers_agree(models, name, aggregation) -> None:
    """Same log-probs, and per step the same loss, gradient norm and updated weights, with
    micro-batches weighted by token share (token-mean) or by row share (other aggregations)."""
    from relax_plugins.trainer.megatron import MegatronTrainer
    from relax_plugins.trainer.torch_trainer import TorchTrainer

    path = models[name]
    spec = trainer_spec(path, micro_batch_size=3,
                        extra={"algorithm.updates_per_step": 2, "algorithm.loss_aggregation": aggregation})
    megatron, reference = build_trainer(MegatronTrainer, spec, path), build_trainer(TorchTrainer, spec, path)
    batch = sample_batch()
    real = _real_tokens(batch)
    ours, theirs = megatron.compute_logprobs(batch), reference.compute_logprobs(batch)
    assert ours.dtype == torch.float32 and ours.shape == batch.input_ids.shape
    assert torch.all(ours[:, 0] == 0)
    assert torch.allclose(ours[real], theirs[real], atol=2e-5, rtol=0)
    got, want = megatron.train_step(batch), reference.train_step(batch)
    assert set(got) == set(want)
    assert got["updates"] == want["updates"] == 2 and got["version"] == 1.0
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=1e-7)
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
    assert got["grad_norm"] > 0
    _assert_same(megatron.weights(), reference.weights(), atol=1e-4)


def test_the_learning_rate_schedule_is_the_torch_trainers(models) -> None:
    """Both trainers set each step's rate from relax.algo.schedules (cosine over 3 steps after one
    warmup step: lr/2, lr, then the floor 0.1 lr), report it as ``lr``, and update alike."""
    from relax_plugins.trainer.megatron import MegatronTrainer
    from relax_plugins.trainer.torch_trainer import TorchTrainer

    path = models["tiny-lm"]
    spec = trainer_spec(path, extra={"trainer.steps": 3, "roles.actor.optimizer.lr_schedule": "cosine",
                                     "roles.actor.optimizer.warmup_steps": 1,
                                     "roles.actor.optimizer.min_lr_ratio": 0.1})
    megatron, reference = build_trainer(MegatronTrainer, spec, path), build_trainer(TorchTrainer, spec, path)
    batch = sample_batch()
    rates = []
    for _ in range(3):
        got, want = megatron.train_step(batch), reference.train_step(batch)
        assert got["lr"] == want["lr"] == megatron.optimizer.param_groups[0]["lr"]
        rates.append(got["lr"])
    assert rates == pytest.approx([5e-4, 1e-3, 1e-4], rel=1e-12)
    _assert_same(megatron.weights(), reference.weights(), atol=1e-4)


def test_an_entropy_loss_gets_the_entropy_of_the_same_distribution(models) -> None:
    """A loss with ``needs_entropy`` receives ``[B, T]`` entropies aligned like the log-probs."""
    import transformers

    from relax_plugins.trainer.megatron import MegatronTrainer

    class EntropyBonus:  # test double: its loss is the mean response-token entropy it is given
        aggregation = "token_mean"
        needs_entropy = True
        received: list[torch.Tensor] = []

        def compute(self, batch, logprobs, *, entropy):
            self.received.append(entropy.detach().clone())
            mask = batch.response_mask
            return (entropy * mask).sum() / mask.sum(), {}

    path = models["qwen2"]
    loss = EntropyBonus()
    trainer = build_trainer(MegatronTrainer, trainer_spec(path, micro_batch_size=16, temperature=0.7), path, loss)
    batch = sample_batch().trim()
    trainer.train_step(batch)
    (entropy,) = loss.received
    hf = transformers.AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        logits = hf(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                    position_ids=batch.position_ids).logits[:, :-1] / 0.7
    probs = logits.softmax(-1)
    want = torch.nn.functional.pad(-(probs * probs.log()).sum(-1), (1, 0))
    real = _real_tokens(batch)
    assert entropy.shape == batch.input_ids.shape
    assert torch.allclose(entropy[real], want[real], atol=1e-4, rtol=0)


def test_save_writes_an_hf_folder_and_load_restores_the_state(models, tmp_path) -> None:
    import transformers

    from relax_plugins.trainer.megatron import MegatronTrainer

    path = models["qwen3-moe"]
    spec = trainer_spec(path)
    trainer = build_trainer(MegatronTrainer, spec, path)
    batch = sample_batch()
    trainer.train_step(batch)
    trainer.save(str(tmp_path / "ckpt"))
    trainer.save(str(tmp_path / "ckpt"))  # over an existing checkpoint: replaced whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    saved = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
    _assert_same(saved.state_dict(), trainer.weights())
    resumed = build_trainer(MegatronTrainer, spec, path)
    resumed.load(str(tmp_path / "ckpt"))
    assert resumed.version == 1
    assert torch.equal(resumed.compute_logprobs(batch), trainer.compute_logprobs(batch))
    assert trainer.train_step(batch)["loss"] == pytest.approx(resumed.train_step(batch)["loss"], rel=1e-6)
    _assert_same(trainer.weights(), resumed.weights(), atol=1e-6)  # the Adam moments came back too


# -- tensor, pipeline and expert parallelism over gloo ranks ---------------------------------------


def _free_port() -> int:
    with socket.socket() as probe_socket:
        probe_socket.bind(("127.0.0.1", 0))
        return probe_socket.getsockname()[1]


def _run_ranks(path: str, out: Path, world: int, **sizes) -> dict:
    """Run ``tests.backends.megatron_cpu`` on ``world`` gloo ranks (``sizes``: tp, pp, ep, check)
    and return what rank 0 wrote."""
    env = {**os.environ, "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    args = [f"{k}={v}" for k, v in sizes.items()]
    ranks = [subprocess.Popen([sys.executable, "-m", "tests.backends.megatron_cpu", path, str(out), *args],
                              cwd=ROOT, env={**env, "RANK": str(rank)}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for rank in range(world)]
    logs = [rank.communicate(timeout=300)[0] for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0] * world, "".join(log[-3000:] for log in logs)
    return torch.load(out, weights_only=False)


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _assert_matches_one_process(many: dict, path: str, atol: float = 1e-5) -> None:
    """``many`` (a parallel ``probe``) agrees with a one-process trainer's probe of the same model."""
    from relax_plugins.trainer.megatron import MegatronTrainer

    one = probe(build_trainer(MegatronTrainer, trainer_spec(path), path))
    real = _real_tokens(sample_batch())
    print(f"max |diff|: logprobs {float((many['logprobs'] - one['logprobs'])[real].abs().max()):.2e}, "
          f"loss {abs(many['metrics']['loss'] - one['metrics']['loss']):.2e}, "
          f"grad_norm {abs(many['metrics']['grad_norm'] - one['metrics']['grad_norm']):.2e}, "
          f"weights {_max_diff(many['weights'], one['weights']):.2e}")
    assert many["logprobs"].shape == one["logprobs"].shape
    # Padding columns a data-parallel share trims differently from the whole batch hold other
    # (unused) values; real tokens must agree.
    assert torch.allclose(many["logprobs"][real], one["logprobs"][real], atol=atol, rtol=0)
    assert many["metrics"]["loss"] == pytest.approx(one["metrics"]["loss"], rel=1e-5)
    assert many["metrics"]["grad_norm"] == pytest.approx(one["metrics"]["grad_norm"], rel=1e-5)
    _assert_same(many["weights"], one["weights"], atol=atol)


@pytest.mark.parametrize("name", ["qwen2", "qwen3"])
def test_tensor_parallel_two_ranks_match_one(models, tmp_path, name) -> None:
    """Two kv heads split over two ranks, a vocabulary of 99 rows padded to 100, and Qwen2's qkv
    biases or Qwen3's q/k norms (whose gradients are summed over the ranks)."""
    path = models[name]
    two = _run_ranks(path, tmp_path / "tp2.pt", 2, tp=2)
    assert two["sizes"] == {"tp": 2, "pp": 1, "ep": 1, "dp": 1}
    _assert_matches_one_process(two, path)


@pytest.mark.parametrize("name", ["qwen3", "llama-tied", "mixtral"])
def test_pipeline_parallel_two_stages_match_one(models, tmp_path, name) -> None:
    """One layer per stage; the last stage computes the loss and log-probs and sends them back.
    ``llama-tied`` keeps the embedding on both end stages, its gradient summed over them;
    ``mixtral`` splits MoE layers."""
    path = models[name]
    two = _run_ranks(path, tmp_path / "pp2.pt", 2, pp=2)
    assert two["sizes"] == {"tp": 1, "pp": 2, "ep": 1, "dp": 1}
    _assert_matches_one_process(two, path)


@pytest.mark.parametrize("name", ["qwen3-moe", "mixtral"])
def test_moe_tensor_parallel_two_ranks_match_one(models, tmp_path, name) -> None:
    """MoE layers under tp=2 run with sequence parallelism: each rank normalises and routes half of
    every sequence (columns padded to a multiple of tp), the experts are split like dense MLPs, and
    the norms' and router's partial gradients are summed over the ranks."""
    path = models[name]
    two = _run_ranks(path, tmp_path / "tp2.pt", 2, tp=2)
    assert two["sizes"] == {"tp": 2, "pp": 1, "ep": 1, "dp": 1}
    _assert_matches_one_process(two, path)


@pytest.mark.parametrize(("name", "sizes"), [("qwen3", {"tp": 2, "pp": 2}), ("qwen3-moe", {"tp": 2, "pp": 2}),
                                             ("qwen3-moe", {"pp": 2, "ep": 2})])
def test_pipeline_parallel_with_tensor_or_expert_parallel_on_four_ranks(models, tmp_path, name, sizes) -> None:
    """Four ranks: two stages of two tensor-parallel ranks (q/k norm gradients summed over tp, the
    norm over tp x pp; for MoE, sequence-parallel halves sent between stages), or two stages of two
    data-parallel ranks that split the experts."""
    path = models[name]
    four = _run_ranks(path, tmp_path / "four.pt", 4, **sizes)
    assert four["sizes"] == {"tp": 1, "pp": 1, "ep": 1, **sizes, "dp": 4 // (sizes.get("tp", 1) * sizes["pp"])}
    _assert_matches_one_process(four, path)


@pytest.mark.parametrize("name", ["qwen3-moe", "mixtral"])
def test_expert_parallel_two_ranks_match_one(models, tmp_path, name) -> None:
    """Four experts, two per rank; the two ranks are also data parallel (each gets its own rows, so
    their micro-batches are padded to the same shapes for the token all-gather)."""
    path = models[name]
    two = _run_ranks(path, tmp_path / "ep2.pt", 2, ep=2)
    assert two["sizes"] == {"tp": 1, "pp": 1, "ep": 2, "dp": 2}
    _assert_matches_one_process(two, path)


def test_pipeline_parallel_save_and_load_round_trip(models, tmp_path) -> None:
    """Under pp=2 the first rank writes one HF folder of both stages (the tied embedding once) and
    the optimizer state of each stage; loading it on two fresh stages restores everything."""
    import transformers

    path = models["llama-tied"]
    out = tmp_path / "pp2.pt"
    result = _run_ranks(path, out, 2, pp=2, check="checkpoint")
    folder = Path(str(out) + ".ckpt")
    saved = transformers.AutoModelForCausalLM.from_pretrained(folder).state_dict()
    _assert_same(saved, result["saved"])
    assert torch.load(folder / "optimizer.pt", weights_only=True)["pipeline_parallel"] == 2
    assert result["version"] == 1
    assert torch.equal(*result["logprobs"])
    assert result["loss"][0] == pytest.approx(result["loss"][1], rel=1e-6)
    print(f"max |diff| after the next step: weights {_max_diff(*result['weights']):.2e}")
    _assert_same(*result["weights"], atol=1e-6)  # the Adam moments came back too


# -- routing replay (algorithm.router_replay) and the mismatch metrics --------------------------------


def test_replay_targets_follow_megatron_token_order() -> None:
    """The bus column maps onto the router's sequence-major ``[s * b, k]`` order (response tokens'
    predecessors replayed, every other position -1), sequence-parallel ranks take consecutive
    column chunks, and recorded choices map back into the bus column."""
    from relax_plugins.trainer.megatron_routing import OWN_CHOICE, column_from_records, micro_batch_targets

    response = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 0, 0]])
    routed = torch.arange(2 * 5 * 3 * 2).reshape(2, 5, 3, 2) * response[..., None, None]
    shape = (3, 6)  # padded by one row and one column
    whole = micro_batch_targets(routed, response, shape, range(1, 3))
    assert [t.shape for t in whole] == [(18, 2), (18, 2)]
    for layer, target in zip((1, 2), whole):
        for s in range(6):
            for b in range(3):
                replayed = b < 2 and s + 1 < 5 and response[b, s + 1] == 1
                want = routed[b, s + 1, layer] if replayed else torch.full((2,), OWN_CHOICE)
                assert torch.equal(target[s * 3 + b], want), (layer, s, b)
    halves = [micro_batch_targets(routed, response, shape, range(1, 3), rank, 2) for rank in range(2)]
    for layer in range(2):
        assert torch.equal(torch.cat([halves[0][layer], halves[1][layer]]), whole[layer])
    back = column_from_records(whole, shape, (2, 5))
    predecessor_of_response = response[:, 1:] == 1
    assert torch.equal(back[:, 1:][predecessor_of_response], routed[:, 1:, 1:][predecessor_of_response])
    with pytest.raises(ValueError, match="cover 3 MoE layers but the model has at least 4"):
        micro_batch_targets(routed, response, shape, range(2, 4))


def _router_choices(trainer) -> tuple[list[torch.Tensor], list]:
    """A list that receives each Megatron TopKRouter call's expert sets (its ``routing_map``
    ``[tokens, experts]``, what the dispatcher sends tokens by), and the hooks' handles."""
    seen: list[torch.Tensor] = []
    routers = [m for m in trainer.model.modules() if type(m).__name__ == "TopKRouter"]
    handles = [r.register_forward_hook(lambda m, i, o: seen.append(o[1].detach().clone())) for r in routers]
    return seen, handles


@pytest.mark.parametrize("name", ["qwen3-moe", "qwen3-moe-unnormalised"])
def test_r3_routes_the_update_with_the_recorded_experts(models, name) -> None:
    """Every response token's predecessor is routed, in the update's forward, to exactly the
    recorded experts (read from the routing map Megatron dispatches by), the log-probs, loss,
    gradient and ``router_replay/changed`` are the torch trainer's replay's, and replay changes the
    log-probs (the recorded routing is not the router's own)."""
    from relax_plugins.trainer.megatron import MegatronTrainer
    from relax_plugins.trainer.torch_trainer import TorchTrainer

    path = models[name]
    plain_spec = trainer_spec(path, micro_batch_size=16)
    spec = trainer_spec(path, micro_batch_size=16, extra={"algorithm.router_replay": "r3"})
    megatron, reference = build_trainer(MegatronTrainer, spec, path), build_trainer(TorchTrainer, spec, path)
    batch = routed_batch().trim()
    real = _real_tokens(batch)
    ours, theirs = megatron.compute_logprobs(batch), reference.compute_logprobs(batch)
    assert torch.allclose(ours[real], theirs[real], atol=2e-5, rtol=0)
    plain = build_trainer(MegatronTrainer, plain_spec, path).compute_logprobs(batch)
    assert (plain[real] - ours[real]).abs().max() > 1e-3
    seen, handles = _router_choices(megatron)
    try:
        got = megatron.train_step(batch)
    finally:
        for handle in handles:
            handle.remove()
    want = reference.train_step(batch)
    assert set(got) == set(want)
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=1e-7)
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
    assert got["router_replay/changed"] == pytest.approx(want["router_replay/changed"])
    assert got["router_replay/changed"] > 0
    rows, cols = batch.input_ids.shape
    assert len(seen) == 2  # one micro-batch, two MoE layers
    predecessor = torch.zeros_like(batch.response_mask, dtype=torch.bool)
    predecessor[:, :-1] = batch.response_mask[:, 1:] > 0
    for layer, routing_map in enumerate(seen):
        chosen = routing_map.reshape(cols, rows, -1).transpose(0, 1)  # Megatron's tokens are sequence-major
        recorded = torch.zeros_like(chosen).scatter(-1, batch.routed_experts[..., layer, :].long(), True)
        assert torch.equal(chosen[:, :-1][predecessor[:, :-1]], recorded[:, 1:][predecessor[:, :-1]])
        assert int(chosen[predecessor].sum(-1).min()) == 2


def test_r3_refuses_a_batch_without_routing_and_a_dense_model(models) -> None:
    from relax_plugins.trainer.megatron import MegatronTrainer

    path = models["qwen3-moe"]
    trainer = build_trainer(MegatronTrainer, trainer_spec(path, extra={"algorithm.router_replay": "r3"}), path)
    with pytest.raises(ValueError, match="no routed experts"):
        trainer.train_step(sample_batch())
    dense = trainer_spec(models["qwen3"])
    dense.algorithm.router_replay = "r3"  # validate refuses it for a dense model; the trainer must too
    with pytest.raises(ValueError, match="dense qwen3 model.*router_replay: off"):
        build_trainer(MegatronTrainer, dense, models["qwen3"])


def test_r2_replays_the_routing_of_the_steps_start_like_torch(models) -> None:
    """``own_routing`` records what the torch trainer's records (the same experts at every real
    position), and an r2 step of two updates agrees with the torch trainer's in loss and gradient."""
    from relax_plugins.trainer.megatron import MegatronTrainer
    from relax_plugins.trainer.torch_trainer import TorchTrainer

    path = models["qwen3-moe"]
    spec = trainer_spec(path, micro_batch_size=3, extra={"algorithm.router_replay": "r2",
                                                         "algorithm.updates_per_step": 2})
    spec.roles.actor.optimizer.lr = 0.05  # the first update moves the routers
    megatron, reference = build_trainer(MegatronTrainer, spec, path), build_trainer(TorchTrainer, spec, path)
    batch = sample_batch()
    ours, theirs = megatron.own_routing(batch), reference.own_routing(batch)
    assert ours.shape == theirs.shape == (*batch.input_ids.shape, 2, 2)
    attended = batch.attention_mask.bool()
    both = torch.zeros_like(attended)
    both[:, 1:] = attended[:, 1:] & attended[:, :-1]  # entry t: the routing of column t - 1
    assert torch.equal(ours[both].sort(-1).values, theirs[both].long().sort(-1).values)
    got, want = megatron.train_step(batch), reference.train_step(batch)
    assert set(got) == set(want)
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=1e-7)
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
    # The second update replays routings the first update's router would now change.
    assert got["router_replay/changed"] == pytest.approx(want["router_replay/changed"]) and got["router_replay/changed"] > 0


@pytest.mark.parametrize("sizes", [{"tp": 2}, {"pp": 2}, {"ep": 2}])
def test_r3_under_tensor_pipeline_or_expert_parallelism_matches_one_process(models, tmp_path, sizes) -> None:
    """Replay under tp (each sequence-parallel rank replays its half of every sequence), pp (each
    stage its own layers) and ep (two data-parallel ranks with their own rows, padded to the same
    shapes) gives the one-process replayed log-probs, step, weights and mismatch figures (summed
    over the data-parallel ranks, taken from the last stage)."""
    from relax_plugins.trainer.megatron import MegatronTrainer

    path = models["qwen3-moe"]
    two = _run_ranks(path, tmp_path / "r3.pt", 2, check="r3", **sizes)
    one = probe(build_trainer(MegatronTrainer, trainer_spec(path, extra={"algorithm.router_replay": "r3"}), path),
                routed_batch())
    real = _real_tokens(sample_batch())
    assert torch.allclose(two["logprobs"][real], one["logprobs"][real], atol=1e-5, rtol=0)
    for key in ("loss", "grad_norm", "router_replay/changed", "mismatch/tokens", "mismatch/kl", "mismatch/max_abs",
                "mismatch/frac_over"):
        assert two["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-5), key
    assert one["metrics"]["router_replay/changed"] > 0
    _assert_same(two["weights"], one["weights"], atol=1e-5)


def test_mismatch_metrics_are_the_torch_trainers_and_vanish_on_the_same_log_probs(models) -> None:
    """On the dense tiny model: the ``mismatch/*`` figures of the first mini-batch equal the torch
    trainer's; with the rollout's log-probs equal to the trainer's they are ~0, rows of another
    policy version are left out, and a shift of 0.1 in every log-prob gives k3(-0.1)."""
    from relax_plugins.trainer.megatron import MegatronTrainer
    from relax_plugins.trainer.torch_trainer import TorchTrainer

    path = models["tiny-lm"]
    spec = trainer_spec(path, extra={"algorithm.updates_per_step": 2})
    batch = sample_batch()
    megatron, reference = build_trainer(MegatronTrainer, spec, path), build_trainer(TorchTrainer, spec, path)
    got, want = megatron.train_step(batch), reference.train_step(batch)
    for key in ("mismatch/tokens", "mismatch/kl", "mismatch/max_abs", "mismatch/frac_over"):
        assert got[key] == pytest.approx(want[key], rel=1e-4), key
    assert got["mismatch/kl"] > 0.1  # the sample batch's behaviour log-probs are random

    fresh = build_trainer(MegatronTrainer, spec, path)
    mask = batch.response_mask
    own = fresh.compute_logprobs(batch) * mask
    versions = torch.tensor([0, 0, 1, 0, 0, 1, 0])  # rows 2 and 5 are another version's: not counted
    same = batch.with_fields(rollout_logprobs=own, policy_version=versions)
    counted = float(mask[versions == 0].sum())
    metrics = fresh.train_step(same)  # first mini-batch: rows 0-3 (version 0 rows 0, 1, 3)
    assert metrics["mismatch/tokens"] == float(mask[[0, 1, 3]].sum())
    assert 0.0 <= metrics["mismatch/kl"] < 1e-9 and metrics["mismatch/max_abs"] < 1e-5
    assert metrics["mismatch/frac_over"] == 0.0
    shifted = build_trainer(MegatronTrainer, trainer_spec(path), path)  # one update: every row counted
    metrics = shifted.train_step(same.with_fields(rollout_logprobs=(own + 0.1) * mask))
    assert metrics["mismatch/tokens"] == counted
    assert metrics["mismatch/kl"] == pytest.approx(math.exp(-0.1) - 1 + 0.1, rel=1e-3)
    assert metrics["mismatch/max_abs"] == pytest.approx(0.1, abs=1e-5)


# -- 3. through the runtime --------------------------------------------------------------------------


def test_the_tiny_preset_trains_with_the_megatron_backend(tmp_path, monkeypatch) -> None:
    import io

    import ray
    import transformers

    from relax.config import load_spec_dict
    from relax.plan import make_plan
    from relax.runtime.driver.launch import WORKER_SETUP_ENV, run_spec
    from relax.spec import validate_spec

    monkeypatch.setenv(WORKER_SETUP_ENV, WORKER_SETUP)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.chdir(ROOT)  # Ray workers import the harness as tests.backends.megatron_cpu from here
    out = tmp_path / "run"
    raw, base = load_spec_dict("tiny-cpu", [f"trainer.output_dir={out}", "trainer.steps=3", "tracing.exporter=none",
                                            "roles.actor.backend=megatron", "trainer.checkpoint_every=3",
                                            "placement.mode=colocate", "async_policy.max_staleness=0"])
    spec = validate_spec(raw, base_dir=base)
    assert ray.is_initialized() is False
    code = run_spec(spec, make_plan(spec, base_dir=base), base_dir=base, stream=io.StringIO())
    assert code == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(math.isfinite(r["train/loss"]) and math.isfinite(r["train/grad_norm"]) for r in rows)
    assert any(r["train/grad_norm"] > 0 for r in rows)  # a step whose group rewards differed
    checkpoint = out / "checkpoints" / "step-3" / "trainer"
    assert json.loads((checkpoint / "trainer_state.json").read_text()) == {"version": 3, "backend": "megatron"}
    trained = transformers.AutoModelForCausalLM.from_pretrained(checkpoint).state_dict()
    from relax.runtime.model_files import materialize_model

    start = _hf_state(materialize_model(spec, base))
    assert any(not torch.equal(trained[k], start[k]) for k in start)  # the weights moved


# -- 4. refusals -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("model", "sizes", "message"), [
    ("qwen3-moe", {"cp": 2}, r"parallel\.cp=2: .*only in Transformer Engine's attention.*needs CUDA; set cp to 1"),
    ("qwen3", {"pp": 3}, r"parallel\.pp=3 does not divide num_hidden_layers=2.*use 1, 2"),
    ("qwen3", {"pp": 2}, r"parallel: tp x pp=2 does not divide the world size 1"),
    ("qwen3", {"ep": 2}, r"parallel\.ep=2: the qwen3 model has no experts; set ep to 1"),
    ("qwen3-moe", {"ep": 3}, r"parallel\.ep=3 does not divide num_experts=4; use 1, 2, 4"),
    ("qwen3-moe", {"ep": 2}, r"parallel\.ep=2 does not divide the data-parallel size 1.*carves the expert-parallel"),
])
def test_unsupported_parallelism_is_refused_by_name(models, model, sizes, message) -> None:
    from relax_plugins.trainer.megatron import MegatronTrainer

    spec = trainer_spec(models[model])
    for key, value in sizes.items():
        setattr(spec.roles.actor.parallel, key, value)
    with pytest.raises(ValueError, match=message):
        build_trainer(MegatronTrainer, spec, models[model])


def test_tensor_parallel_sizes_that_cannot_work_are_refused(models) -> None:
    from relax_plugins.trainer.megatron import MegatronTrainer
    from relax_plugins.trainer.megatron_weights import ConversionError

    with pytest.raises(ConversionError, match="tp=2 does not divide num_key_value_heads=1.*use 1"):
        build_trainer(MegatronTrainer, trainer_spec(models["tiny-lm"], tp=2), models["tiny-lm"])
    with pytest.raises(ValueError, match="tp=2 does not divide the world size 1"):
        build_trainer(MegatronTrainer, trainer_spec(models["qwen2"], tp=2), models["qwen2"])


def test_roles_it_cannot_run_here_are_refused(models) -> None:
    from relax_plugins.trainer.megatron import MegatronTrainer

    path = models["tiny-lm"]
    with pytest.raises(ValueError, match="gradient_checkpointing.*needs a GPU; set it to false on CPU"):
        build_trainer(MegatronTrainer, trainer_spec(path, extra={"roles.actor.gradient_checkpointing": True}), path)
    from relax.contracts import ModelInfo, TrainerContext

    context = TrainerContext(role="critic", model=ModelInfo(path=path))
    with pytest.raises(ValueError, match="roles.critic.backend: torch"):
        MegatronTrainer(MegatronTrainer.Config(), context)


def test_checkpoints_the_mapping_would_get_wrong_are_refused() -> None:
    from relax_plugins.trainer.megatron_weights import ConversionError, layout_from_hf_config

    llama = dict(model_type="llama", num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                 intermediate_size=96, vocab_size=99)
    with pytest.raises(ConversionError, match="model_type 'gpt2' has no Megatron mapping"):
        layout_from_hf_config({**llama, "model_type": "gpt2"})
    with pytest.raises(ConversionError, match="rope type 'llama3' is not mapped"):
        layout_from_hf_config({**llama, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}})
    with pytest.raises(ConversionError, match="shared experts"):
        layout_from_hf_config({**llama, "model_type": "qwen3_moe", "shared_expert_intermediate_size": 8})


def test_without_cpu_stand_ins_the_error_says_what_to_do(models) -> None:
    script = ("from tests.backends.megatron_cpu import build_trainer, trainer_spec\n"
              "from relax_plugins.trainer.megatron import MegatronTrainer\n"
              f"build_trainer(MegatronTrainer, trainer_spec({models['tiny-lm']!r}), {models['tiny-lm']!r})\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "megatron-core needs CUDA" in done.stderr and "RELAX_WORKER_SETUP=" in done.stderr


def test_validate_reads_the_backend_without_importing_heavy_modules() -> None:
    script = ("import sys\n"
              "from relax.config import load_spec_dict\n"
              "from relax.spec import validate_spec\n"
              "raw, base = load_spec_dict('tiny-cpu', ['roles.actor.backend=megatron',"
              " 'roles.actor.options={logprob_temperature: 0.5}'])\n"
              "spec = validate_spec(raw, base_dir=base)\n"
              "assert spec.roles.actor.backend == 'megatron'\n"
              "heavy = sorted(m for m in ('torch', 'megatron', 'transformers', 'ray') if m in sys.modules)\n"
              "print('heavy:', heavy)\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "heavy: []" in done.stdout
    bad = subprocess.run([sys.executable, "-m", "relax.cli", "validate", "tiny-cpu",
                          "roles.actor.backend=megatron", "roles.actor.options={tp_overlap: true}"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "tp_overlap" in bad.stdout + bad.stderr
