"""Hugging Face checkpoints to Megatron-core ``GPTModel`` state dicts and back.

Three steps, each a pure function of tensors (torch only, imported inside the functions):

1. ``layout_from_hf_config`` reads the shape of the model from its ``config.json`` and refuses, with
   a message, any feature the mapping below would get wrong (scaled RoPE, sliding windows, biases
   outside the attention projections, shared experts, ...).
2. ``hf_to_megatron`` / ``megatron_to_hf`` rename and re-pack the *full* (unsharded) weights. The
   only re-packing is of two fused matrices: Megatron's ``linear_qkv`` holds, per query group, that
   group's query heads then its key head then its value head; ``linear_fc1`` holds the SwiGLU gate
   rows then the up rows. Both directions are exact (cat and split, no arithmetic).
3. ``shard`` / ``unshard`` split the full Megatron weights over tensor-parallel ranks the way
   Megatron's column- and row-parallel layers expect, and join them back. Vocabulary rows are
   padded with zeros up to a multiple of the TP size (Megatron needs equal vocabulary shards); the
   trainer keeps the padded logits out of every softmax.
4. ``global_name`` renames a weight of one pipeline stage / expert-parallel rank (whose layers and
   experts Megatron numbers from 0 locally) to its name in the full model, so the same mapping
   serves every stage.

Supported: Llama, Qwen2 (qkv bias), Qwen3 (q/k RMSNorm) dense models, and Qwen3-MoE and Mixtral
sparse models (a softmax top-k router, no shared experts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: HF ``model_type`` of each supported family, and whether it is a mixture of experts.
SUPPORTED_MODEL_TYPES = {"llama": False, "qwen2": False, "qwen3": False, "qwen3_moe": True, "mixtral": True}


class ConversionError(ValueError):
    """A checkpoint the Megatron mapping cannot represent exactly; the message says what to do."""


@dataclass(frozen=True)
class ModelLayout:
    """The numbers the mapping and ``GPTModel`` need, read from an HF ``config.json``."""

    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    tied_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    norm_eps: float
    rope_theta: float
    max_positions: int
    num_experts: int = 0
    """Routed experts per layer; 0 for a dense model."""
    moe_ffn_hidden_size: int = 0
    """Width of one expert's MLP."""
    moe_top_k: int = 0
    """Experts each token is routed to."""
    moe_renormalize: bool = True
    """Whether the top-k router weights are renormalised to sum to 1 (HF ``norm_topk_prob``)."""

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


def _rope_theta(config: dict[str, Any]) -> float:
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or {}
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if kind != "default":
        raise ConversionError(f"rope type '{kind}' is not mapped to Megatron yet; only plain RoPE "
                              "(rope_type default) converts exactly; use the torch trainer for this model")
    return float(params.get("rope_theta", config.get("rope_theta", 10000.0)))


def layout_from_hf_config(config: dict[str, Any]) -> ModelLayout:
    """The layout of an HF causal LM config (the parsed ``config.json``), or a ``ConversionError``."""
    model_type = config.get("model_type", "")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConversionError(f"model_type '{model_type}' has no Megatron mapping; supported: "
                              f"{', '.join(SUPPORTED_MODEL_TYPES)} (use the torch trainer for others)")
    problems = []
    if config.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {config['hidden_act']} (only silu/SwiGLU is mapped)")
    if config.get("mlp_bias"):
        problems.append("mlp_bias true (Megatron's SwiGLU MLP here has no bias)")
    if model_type == "llama" and config.get("attention_bias"):
        problems.append("attention_bias true on llama (the output projection bias is not mapped)")
    if config.get("use_sliding_window") and config.get("sliding_window"):
        problems.append("use_sliding_window true (sliding-window attention is not mapped)")
    if model_type == "qwen3" and config.get("attention_bias"):
        problems.append("attention_bias true on qwen3 (the output projection bias is not mapped)")
    if config.get("shared_expert_intermediate_size"):
        problems.append("shared experts (only routed experts are mapped)")
    if config.get("mlp_only_layers") or int(config.get("decoder_sparse_step", 1)) != 1:
        problems.append("dense layers between MoE layers (mlp_only_layers / decoder_sparse_step)")
    if problems:
        raise ConversionError(f"{model_type} checkpoint with " + "; ".join(problems)
                              + ": use the torch trainer for this model")
    heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    moe = SUPPORTED_MODEL_TYPES[model_type]
    experts = int(config.get("num_experts") or config.get("num_local_experts") or 0) if moe else 0
    return ModelLayout(
        model_type=model_type,
        num_layers=int(config["num_hidden_layers"]),
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or hidden // heads),
        ffn_hidden_size=int(config["intermediate_size"]),
        vocab_size=int(config["vocab_size"]),
        tied_embeddings=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2" or (model_type in ("qwen3", "qwen3_moe") and bool(config.get("attention_bias"))),
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta(config),
        max_positions=int(config.get("max_position_embeddings", 4096)),
        num_experts=experts,
        moe_ffn_hidden_size=int(config.get("moe_intermediate_size") or config["intermediate_size"]) if moe else 0,
        moe_top_k=int(config.get("num_experts_per_tok", 0)) if moe else 0,
        moe_renormalize=bool(config.get("norm_topk_prob", True)) if model_type == "qwen3_moe" else True,
    )


# -- full weights: HF names <-> Megatron names ---------------------------------------------------


def _mlp_pairs(hf: str, mg: str) -> list[tuple[str, str]]:
    """(hf gate, hf up, hf down) -> Megatron fc1 (gate then up) and fc2, for one MLP."""
    return [(f"{hf}.gate_proj.weight|{hf}.up_proj.weight", f"{mg}.linear_fc1.weight"),
            (f"{hf}.down_proj.weight", f"{mg}.linear_fc2.weight")]


def _layer_names(layout: ModelLayout, i: int) -> list[tuple[str, str]]:
    """(HF name, Megatron name) pairs of one decoder layer; fused tensors list their HF parts joined by ``|``."""
    hf, mg = f"model.layers.{i}", f"decoder.layers.{i}"
    pairs = [
        (f"{hf}.input_layernorm.weight", f"{mg}.input_layernorm.weight"),
        (f"{hf}.self_attn.q_proj.weight|{hf}.self_attn.k_proj.weight|{hf}.self_attn.v_proj.weight",
         f"{mg}.self_attention.linear_qkv.weight"),
        (f"{hf}.self_attn.o_proj.weight", f"{mg}.self_attention.linear_proj.weight"),
        (f"{hf}.post_attention_layernorm.weight", f"{mg}.pre_mlp_layernorm.weight"),
    ]
    if layout.qkv_bias:
        pairs.append((f"{hf}.self_attn.q_proj.bias|{hf}.self_attn.k_proj.bias|{hf}.self_attn.v_proj.bias",
                      f"{mg}.self_attention.linear_qkv.bias"))
    if layout.qk_norm:
        pairs += [(f"{hf}.self_attn.q_norm.weight", f"{mg}.self_attention.q_layernorm.weight"),
                  (f"{hf}.self_attn.k_norm.weight", f"{mg}.self_attention.k_layernorm.weight")]
    if not layout.is_moe:
        return pairs + _mlp_pairs(f"{hf}.mlp", f"{mg}.mlp")
    if layout.model_type == "mixtral":
        pairs.append((f"{hf}.block_sparse_moe.gate.weight", f"{mg}.mlp.router.weight"))
        for j in range(layout.num_experts):
            e = f"{hf}.block_sparse_moe.experts.{j}"
            pairs += [(f"{e}.w1.weight|{e}.w3.weight", f"{mg}.mlp.experts.local_experts.{j}.linear_fc1.weight"),
                      (f"{e}.w2.weight", f"{mg}.mlp.experts.local_experts.{j}.linear_fc2.weight")]
        return pairs
    pairs.append((f"{hf}.mlp.gate.weight", f"{mg}.mlp.router.weight"))
    for j in range(layout.num_experts):
        pairs += _mlp_pairs(f"{hf}.mlp.experts.{j}", f"{mg}.mlp.experts.local_experts.{j}")
    return pairs


def name_pairs(layout: ModelLayout) -> list[tuple[str, str]]:
    """Every (HF name, Megatron name) pair of the model, fused HF parts joined by ``|``."""
    pairs = [("model.embed_tokens.weight", "embedding.word_embeddings.weight")]
    for i in range(layout.num_layers):
        pairs += _layer_names(layout, i)
    pairs.append(("model.norm.weight", "decoder.final_layernorm.weight"))
    if not layout.tied_embeddings:
        pairs.append(("lm_head.weight", "output_layer.weight"))
    return pairs


def _pack_qkv(layout: ModelLayout, q: Any, k: Any, v: Any) -> Any:
    """HF q, k, v (weights ``[heads*d, h]`` or biases ``[heads*d]``) to Megatron's per-group layout."""
    import torch

    groups, d = layout.num_kv_heads, layout.head_dim
    per_group = layout.num_heads // groups
    tail = q.shape[1:]
    parts = (q.reshape(groups, per_group * d, *tail), k.reshape(groups, d, *tail), v.reshape(groups, d, *tail))
    return torch.cat(parts, dim=1).reshape(-1, *tail)


def _unpack_qkv(layout: ModelLayout, qkv: Any) -> tuple[Any, Any, Any]:
    groups, d = layout.num_kv_heads, layout.head_dim
    per_group = layout.num_heads // groups
    tail = qkv.shape[1:]
    q, k, v = qkv.reshape(groups, (per_group + 2) * d, *tail).split([per_group * d, d, d], dim=1)
    return q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)


def _moe_prefix(layout: ModelLayout, i: int) -> str:
    """Where a layer's routed experts live in the checkpoint (file) layout."""
    block = "block_sparse_moe" if layout.model_type == "mixtral" else "mlp"
    return f"model.layers.{i}.{block}"


def _expert_names(layout: ModelLayout, i: int, j: int) -> tuple[str, str, str]:
    """(gate, up, down) weight names of expert ``j`` of layer ``i`` in the checkpoint layout."""
    e = f"{_moe_prefix(layout, i)}.experts.{j}"
    if layout.model_type == "mixtral":
        return f"{e}.w1.weight", f"{e}.w3.weight", f"{e}.w2.weight"
    return f"{e}.gate_proj.weight", f"{e}.up_proj.weight", f"{e}.down_proj.weight"


def split_experts(hf: dict[str, Any], layout: ModelLayout) -> dict[str, Any]:
    """transformers 5's in-memory MoE layout (``model.layers.i.mlp.experts.gate_up_proj [E, 2f, h]``,
    ``experts.down_proj [E, h, f]``, the router at ``mlp.gate.weight``) to the checkpoint layout
    (one gate/up/down matrix per expert, Mixtral's under ``block_sparse_moe``). Other keys pass."""
    out = dict(hf)
    for i in range(layout.num_layers):
        fused = f"model.layers.{i}.mlp.experts"
        if f"{fused}.gate_up_proj" not in out:
            continue
        gate_up, down = out.pop(f"{fused}.gate_up_proj"), out.pop(f"{fused}.down_proj")
        router = out.pop(f"model.layers.{i}.mlp.gate.weight")
        out[f"{_moe_prefix(layout, i)}.gate.weight"] = router
        for j in range(layout.num_experts):
            gate_name, up_name, down_name = _expert_names(layout, i, j)
            out[gate_name], out[up_name] = gate_up[j].chunk(2, dim=0)
            out[down_name] = down[j]
    return out


def fuse_experts(hf: dict[str, Any], layout: ModelLayout) -> dict[str, Any]:
    """The inverse of ``split_experts``: the layout ``model.state_dict()`` has in transformers 5."""
    import torch

    out = dict(hf)
    for i in range(layout.num_layers):
        gate_name, _, _ = _expert_names(layout, i, 0)
        if gate_name not in out:
            continue
        gate_up, down = [], []
        for j in range(layout.num_experts):
            gate_name, up_name, down_name = _expert_names(layout, i, j)
            gate_up.append(torch.cat([out.pop(gate_name), out.pop(up_name)], dim=0))
            down.append(out.pop(down_name))
        fused = f"model.layers.{i}.mlp.experts"
        out[f"{fused}.gate_up_proj"], out[f"{fused}.down_proj"] = torch.stack(gate_up), torch.stack(down)
        out[f"model.layers.{i}.mlp.gate.weight"] = out.pop(f"{_moe_prefix(layout, i)}.gate.weight")
    return out


def hf_to_megatron(hf: dict[str, Any], layout: ModelLayout) -> dict[str, Any]:
    """Full Megatron ``GPTModel`` weights from a full HF ``state_dict``, in the checkpoint layout or
    in transformers 5's in-memory one (fused experts); ``lm_head.weight`` may be absent when the
    embeddings are tied. Unused or missing HF keys are errors naming them."""
    import torch

    if layout.is_moe:
        hf = split_experts(hf, layout)
    out: dict[str, Any] = {}
    used: set[str] = set()
    missing: list[str] = []
    for hf_names, mg_name in name_pairs(layout):
        names = hf_names.split("|")
        absent = [n for n in names if n not in hf]
        if absent:
            missing += absent
            continue
        used.update(names)
        parts = [hf[n] for n in names]
        if mg_name.endswith("linear_qkv.weight") or mg_name.endswith("linear_qkv.bias"):
            out[mg_name] = _pack_qkv(layout, *parts)
        elif len(parts) == 2:  # SwiGLU: gate rows, then up rows
            out[mg_name] = torch.cat(parts, dim=0)
        else:
            out[mg_name] = parts[0]
    ignorable = {"lm_head.weight"} if layout.tied_embeddings else set()
    extra = sorted(k for k in hf if k not in used and k not in ignorable and not k.endswith("rotary_emb.inv_freq"))
    if missing or extra:
        raise ConversionError(f"the {layout.model_type} checkpoint does not match its config: missing "
                              f"{missing[:5]}, unexpected {extra[:5]}; give the full state_dict of that model")
    return out


def megatron_to_hf(mg: dict[str, Any], layout: ModelLayout, *, fused_experts: bool = True) -> dict[str, Any]:
    """The full HF ``state_dict`` from full Megatron weights; ``lm_head.weight`` is included even
    when tied (the embedding tensor), as HF ``state_dict()`` lists it. MoE experts come in
    transformers 5's in-memory layout (what ``model.state_dict()`` gives and ``load_state_dict``
    takes) unless ``fused_experts`` is False, which gives the checkpoint (file) layout."""
    out: dict[str, Any] = {}
    for hf_names, mg_name in name_pairs(layout):
        names = hf_names.split("|")
        tensor = mg[mg_name]
        if mg_name.endswith("linear_qkv.weight") or mg_name.endswith("linear_qkv.bias"):
            out.update(zip(names, _unpack_qkv(layout, tensor)))
        elif len(names) == 2:
            out.update(zip(names, tensor.chunk(2, dim=0)))
        else:
            out[names[0]] = tensor
    if layout.tied_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return fuse_experts(out, layout) if layout.is_moe and fused_experts else out


# -- tensor-parallel shards -------------------------------------------------------------------------

#: How each Megatron weight is split over tensor-parallel ranks: by rows ("column" parallel
#: layers, whose output is split), by columns ("row" parallel layers), "vocab" rows (padded first),
#: "gated" (gate and up split separately, each rank holding its gate rows then its up rows), or
#: replicated (norms, the router).
def _split_kind(name: str) -> str:
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return "vocab"
    if name.endswith("linear_qkv.weight") or name.endswith("linear_qkv.bias"):
        return "rows"
    if name.endswith("linear_fc1.weight"):
        return "gated"
    if name.endswith("linear_proj.weight") or name.endswith("linear_fc2.weight"):
        return "columns"
    return "replicated"


def is_split(name: str) -> bool:
    """Whether the Megatron weight ``name`` is split over tensor-parallel ranks (else every rank
    holds the same copy)."""
    return _split_kind(name) != "replicated"


def grad_summed_over_tensor_parallel(name: str) -> bool:
    """Whether each tensor-parallel rank computes only part of the gradient of the replicated weight
    ``name``, so the parts must be summed over the group: the q/k norms, as each rank normalises
    only its own heads (without sequence parallelism the other replicated weights see the same
    inputs and gradients on every rank; with it, the trainer also sums the weights Megatron marks
    ``sequence_parallel``). Megatron's ``finalize_model_grads`` applies the same rule."""
    return name.endswith(("q_layernorm.weight", "k_layernorm.weight"))


def is_expert(name: str) -> bool:
    """Whether the Megatron weight ``name`` belongs to a routed expert (split over expert-parallel
    ranks, its gradient summed over the expert-data-parallel group, not the data-parallel one)."""
    return ".mlp.experts." in name


def global_name(name: str, layer_offset: int, expert_offset: int) -> str:
    """The full model's name of a weight that a pipeline stage or expert-parallel rank holds under
    its local name: Megatron numbers a stage's layers (``decoder.layers.i``) and a rank's experts
    (``local_experts.j``) from 0; the stage's first layer is global layer ``layer_offset`` and the
    rank's first expert is global expert ``expert_offset``."""
    import re

    if layer_offset:
        name = re.sub(r"^decoder\.layers\.(\d+)\.", lambda m: f"decoder.layers.{int(m[1]) + layer_offset}.", name)
    if expert_offset:
        name = re.sub(r"\.local_experts\.(\d+)\.", lambda m: f".local_experts.{int(m[1]) + expert_offset}.", name)
    return name


def padded_vocab_size(layout: ModelLayout, tp: int) -> int:
    """The vocabulary rounded up to a multiple of the TP size (equal shards)."""
    return -(-layout.vocab_size // tp) * tp


def check_tensor_parallel(layout: ModelLayout, tp: int) -> None:
    """Raise a ``ConversionError`` if the model's heads or MLP widths do not split over ``tp`` ranks."""
    problems = []
    if layout.num_kv_heads % tp:
        ok = [d for d in range(1, layout.num_kv_heads + 1) if layout.num_kv_heads % d == 0]
        problems.append(f"tp={tp} does not divide num_key_value_heads={layout.num_kv_heads} "
                        f"(Megatron splits whole query groups); use {', '.join(map(str, ok))}")
    widths = [("intermediate_size", layout.ffn_hidden_size)]
    if layout.is_moe:
        widths.append(("moe_intermediate_size", layout.moe_ffn_hidden_size))
    for name, width in widths:
        if width % tp:
            problems.append(f"tp={tp} does not divide {name}={width}")
    if problems:
        raise ConversionError("; ".join(problems))


def shard(full: dict[str, Any], layout: ModelLayout, rank: int, size: int) -> dict[str, Any]:
    """The weights tensor-parallel rank ``rank`` of ``size`` holds (views where possible)."""
    import torch

    check_tensor_parallel(layout, size)
    out = {}
    for name, tensor in full.items():
        kind = _split_kind(name)
        if size == 1 or kind == "replicated":
            out[name] = tensor
        elif kind == "vocab":
            pad = padded_vocab_size(layout, size) - tensor.shape[0]
            if pad:
                tensor = torch.cat([tensor, tensor.new_zeros(pad, *tensor.shape[1:])])
            out[name] = tensor.chunk(size, dim=0)[rank]
        elif kind == "rows":
            out[name] = tensor.chunk(size, dim=0)[rank]
        elif kind == "columns":
            out[name] = tensor.chunk(size, dim=1)[rank]
        else:  # gated
            gate, up = tensor.chunk(2, dim=0)
            out[name] = torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]])
    return out


def unshard(shards: list[dict[str, Any]], layout: ModelLayout) -> dict[str, Any]:
    """The full weights from every tensor-parallel rank's shard, in rank order (inverse of ``shard``)."""
    import torch

    size = len(shards)
    out = {}
    for name, tensor in shards[0].items():
        kind = _split_kind(name)
        parts = [s[name] for s in shards]
        if size == 1 or kind == "replicated":
            out[name] = tensor
        elif kind == "vocab":
            out[name] = torch.cat(parts, dim=0)[:layout.vocab_size]
        elif kind == "rows":
            out[name] = torch.cat(parts, dim=0)
        elif kind == "columns":
            out[name] = torch.cat(parts, dim=1)
        else:
            gates, ups = zip(*(p.chunk(2, dim=0) for p in parts))
            out[name] = torch.cat([*gates, *ups], dim=0)
    return out
