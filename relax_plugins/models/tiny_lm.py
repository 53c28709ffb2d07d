"""``builtin:tiny-lm``: a tiny Llama-style causal LM built locally from a seed (no download).

``materialize`` trains a character-level tokenizer with the ``tokenizers`` library, initialises a
small Llama, Qwen2 or Qwen3-MoE model at random from ``seed`` and gives it a short supervised warm-up on the
``synthetic:arithmetic`` task. The warm-up teaches the answers but, on purpose, to stop right
after the answer only ``warmup_stop_probability`` of the time (the other targets ramble on), so
that reinforcement learning with an exact-match reward starts from a weak policy (about 0.25
sampled accuracy) and has something quick and real to learn (reaching about 0.85 within a few
dozen GRPO steps). With ``task: calculator`` it is an agent instead: a chat template
(``CHAT_TEMPLATE``), tool-call tokens (``TOOL_TOKENS``) and a warm-up of whole trajectories on
``synthetic:products`` with the ``calculator`` environment, calling the tool a quarter of the time
(``presets/tiny-agent-cpu.yaml``: GRPO raises its reward from about 0.2 to about 0.8 in a few dozen
steps by teaching it to call). The result is a normal Hugging Face folder (``save_pretrained``, safetensors,
tokenizer), cached under ``<cache_dir>/tiny-lm-<hash of the config>`` and built once even when
several processes ask at the same time.

This module imports only pydantic and the standard library; the build (torch, transformers) lives
in ``relax_plugins.models.tiny_lm_build`` and is imported by ``materialize``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from relax_plugins.models.build_cache import recipe_fingerprint

#: Source files whose text is part of the cache key: editing the recipe rebuilds the model.
RECIPE_FILES = ("tiny_lm.py", "tiny_lm_build.py")

SPECIAL_TOKENS: tuple[str, ...] = ("<pad>", "<eos>", "<unk>")
"""Pad, end-of-sequence and unknown tokens, with ids 0, 1 and 2."""
CHARSET: tuple[str, ...] = ("\n", *(chr(code) for code in range(32, 127)))
"""Every character of the vocabulary: newline and printable ASCII (one token each)."""
VOCAB_SIZE = len(SPECIAL_TOKENS) + len(CHARSET)
JUDGE_TEMPLATE = "{prompt}{response}?"
"""The judge task's input (``genrm`` template fields): ``3+5=8?`` -> ``yes``, ``3+5=9?`` -> ``no``."""
CHAT_TEMPLATE = (
    "{%- macro text(content) -%}{%- if content is string -%}{{- content -}}{%- elif content -%}"
    "{%- for item in content -%}{%- if item['type'] == 'text' -%}{{- item['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}{%- endmacro -%}"
    "{%- if tools -%}{{- 'T:' -}}{%- for tool in tools -%}"
    "{{- (tool['function']['name'] if tool['function'] is defined else tool['name'])"
    " + (',' if not loop.last else '\\n') -}}{%- endfor -%}{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}{{- 'A:' + text(message['content']) -}}"
    "{%- for call in (message['tool_calls'] or []) if message['tool_calls'] is defined -%}"
    "{%- set f = call['function'] if call['function'] is defined else call -%}"
    "{{- '<tool_call>{\"name\":' + f['name'] | tojson + ',\"arguments\":' + (f['arguments'] if f['arguments']"
    " is string else f['arguments'] | tojson(separators=(',', ':'))) + '}</tool_call>' -}}"
    "{%- endfor -%}{{- '<eos>' -}}"
    "{%- elif message['role'] in ('user', 'tool', 'system') -%}"
    "{{- {'user': 'U:', 'tool': 'R:', 'system': 'S:'}[message['role']] + text(message['content']) + '\\n' -}}"
    "{%- else -%}{{- raise_exception('tiny-lm has no chat role ' + message['role']) -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- 'A:' -}}{%- endif -%}"
)
"""The chat template of ``task: calculator``: one or two characters per message boundary, so the
character-level model reads little besides the task. ``T:calc`` names the tools, then ``U:`` a user
message, ``R:`` a tool result and ``S:`` a system message, each ending with a newline; ``A:`` opens
an assistant turn, which ends with the eos token ``<eos>`` (tool calls are written in the turn's
text, hermes style with compact JSON). Each message only appends to the text of the ones before,
so a trajectory's tokens can be extended message by message (``relax.agents.chat``)."""
TOOL_CALL = '<tool_call>{{"name":"calc","arguments":{{"expr":"{expr}"}}}}</tool_call>'
"""The tool-call turn the calculator warm-up teaches (``expr`` is the problem without its ``=``)."""
TOOL_TOKENS: tuple[str, ...] = ("<tool_call>", "</tool_call>", '{"name":"calc","arguments":{"expr":"', '"}}')
"""Extra tokens of the ``calculator`` task's vocabulary (ordinary tokens, decoded as their text):
the hermes wrapper and the call's fixed JSON, one token each, as a real tokenizer would merge them.
A character-level model copies a number well from a few tokens back but not from fifty, so with
these the expression it copies into the call sits a dozen tokens after the problem."""


def vocab_size(task: str) -> int:
    """Tokens of the vocabulary of a tiny-lm built for ``task``."""
    return VOCAB_SIZE + (len(TOOL_TOKENS) if task == "calculator" else 0)


class TinyLM:
    """A tiny decoder-only LM for CPU tests and demos (about 100k parameters by default)."""

    class Config(BaseModel):
        """Sizes, task and warm-up of the built-in tiny model."""

        model_config = ConfigDict(extra="forbid")

        architecture: Literal["llama", "qwen2", "qwen3_moe"] = "llama"
        """Hugging Face architecture of the model (each loads in transformers and vLLM).
        ``qwen3_moe`` is a mixture of experts: every layer's MLP is ``num_experts`` SwiGLU experts
        of width ``moe_intermediate_size`` with a top-``experts_per_token`` router (the model for
        rollout routing replay, ``algorithm.router_replay``)."""
        num_layers: int = Field(2, ge=1, le=32)
        """Decoder layers."""
        hidden_size: int = Field(64, ge=8)
        """Model width (num_attention_heads x head_dim need not equal it)."""
        num_attention_heads: int = Field(2, ge=1)
        """Query heads."""
        num_kv_heads: int = Field(1, ge=1)
        """Key/value heads; must divide num_attention_heads."""
        head_dim: int = Field(32, ge=32)
        """Width of one head; at least 32 (vLLM's CPU attention rejects 16)."""
        intermediate_size: int = Field(256, ge=1)
        """Width of the SwiGLU MLP (dense architectures)."""
        num_experts: int = Field(4, ge=2, le=256)
        """``qwen3_moe`` only: routed experts per layer."""
        experts_per_token: int = Field(2, ge=1)
        """``qwen3_moe`` only: experts each token is routed to (top-k)."""
        moe_intermediate_size: int = Field(64, ge=1)
        """``qwen3_moe`` only: width of one expert's SwiGLU MLP."""
        router_aux_loss_coef: float = Field(0.01, ge=0.0)
        """``qwen3_moe`` only: weight of the load-balancing loss in the warm-up, so that the
        router spreads tokens over every expert (its choices then matter, and can flip)."""
        max_position_embeddings: int = Field(512, ge=16)
        """Longest sequence (prompt plus response) in tokens."""
        tie_embeddings: bool = True
        """Share the input embedding with the output head."""
        task: Literal["arithmetic", "judge", "calculator", "long_tail"] = "arithmetic"
        """Task of the warm-up: ``arithmetic`` teaches the default ``synthetic:arithmetic`` format;
        ``judge`` makes a grader of it: given ``JUDGE_TEMPLATE`` filled with a problem and a candidate
        response it answers ``yes`` (the response is exactly the answer) or ``no`` (for the ``genrm``
        reward's tests and demos); ``calculator`` teaches the ``synthetic:products`` task as an agent
        of the ``calculator`` environment, through ``CHAT_TEMPLATE`` (saved with the tokenizer): a
        tool call, the tool's result, then the answer copied from it, or, more often, a direct
        answer that is usually wrong (``warmup_tool_probability``); ``long_tail`` is arithmetic with
        response lengths that vary widely: most responses stop after the answer, a few
        (``long_tail_probability``) ramble on for up to ``long_tail_tokens`` tokens, the long tail
        that partial rollouts are for (``presets/tiny-longtail-cpu.yaml``)."""
        long_tail_probability: float = Field(0.1, ge=0.0, le=1.0)
        """``task: long_tail`` only: share of warm-up targets that ramble on after the answer."""
        long_tail_tokens: int = Field(48, ge=2)
        """``task: long_tail`` only: a rambling target adds between half this and this many tokens."""
        warmup_tool_probability: float = Field(0.25, ge=0.0, le=1.0)
        """``task: calculator`` only: share of warm-up trajectories that call the tool (and copy its
        result); the others answer directly with a plausible but usually wrong number. The model
        learns to call and copy well but to call only about this often, so its sampled exact-match
        reward starts near this value and RL can raise it by teaching it to call the tool."""
        warmup_steps: int = Field(600, ge=0)
        """Supervised warm-up steps on the task (0 leaves the random initialisation)."""
        warmup_batch_size: int = Field(64, ge=1)
        """Problems per warm-up step."""
        warmup_lr: float = Field(3e-3, gt=0.0)
        """AdamW learning rate of the warm-up."""
        warmup_stop_probability: float = Field(0.3, ge=0.0, le=1.0)
        """Share of warm-up targets that stop right after the answer; the others ramble on (a space
        and a few random characters) before stopping. The model learns the answers well but to stop
        only this often, so its sampled exact-match accuracy starts near this value and RL can raise
        it by teaching it to stop. 1.0 teaches clean answers only."""
        seed: int = Field(0, ge=0)
        """Seed of the initial weights and of the warm-up problems."""

    def __init__(self, config: TinyLM.Config) -> None:
        if config.num_attention_heads % config.num_kv_heads:
            raise ValueError(f"tiny-lm: num_kv_heads {config.num_kv_heads} must divide "
                             f"num_attention_heads {config.num_attention_heads}")
        if config.experts_per_token > config.num_experts:
            raise ValueError(f"tiny-lm: experts_per_token {config.experts_per_token} exceeds "
                             f"num_experts {config.num_experts}")
        self.config = config

    @property
    def is_moe(self) -> bool:
        return self.config.architecture == "qwen3_moe"

    def architecture(self) -> dict[str, Any]:
        """The numbers of ``relax.spec.architecture.ModelArchitecture``, without building anything."""
        c = self.config
        return {
            "name": "builtin:tiny-lm",
            "num_layers": c.num_layers,
            "hidden_size": c.hidden_size,
            "num_attention_heads": c.num_attention_heads,
            "num_kv_heads": c.num_kv_heads,
            "head_dim": c.head_dim,
            "intermediate_size": c.intermediate_size,
            "vocab_size": vocab_size(c.task),
            "tie_embeddings": c.tie_embeddings,
            "num_experts": c.num_experts if self.is_moe else 0,
            "experts_per_token": c.experts_per_token if self.is_moe else 0,
            "moe_intermediate_size": c.moe_intermediate_size if self.is_moe else 0,
            "modalities": ["text"],
        }

    def fingerprint(self) -> str:
        """A short hash of the config and of the recipe's source: the name of the cached folder."""
        here = Path(__file__).parent
        return recipe_fingerprint(self.config.model_dump(), (here / name for name in RECIPE_FILES))

    def materialize(self, cache_dir: str) -> str:
        """The folder of the built model, building it first unless it is already cached."""
        from relax_plugins.models.build_cache import cached_build

        def build(staging: Path) -> dict[str, Any]:
            from relax_plugins.models.tiny_lm_build import build_tiny_lm

            return build_tiny_lm(self.config, staging)

        return cached_build(cache_dir, "tiny-lm", self.fingerprint(), self.config.model_dump(), build)
