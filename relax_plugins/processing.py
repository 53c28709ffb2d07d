"""Model inputs of a multimodal sample: the ONE function both the rollout and the trainer use.

A sample is its prompt text plus references to its media (``relax.media.MediaRef``). To build its
model inputs a role decodes each reference through the run's modality plugin (the checksum is
verified first), renders a chat message with one content item per media item and the prompt text
(the model's own chat template places the media markers), and calls the model's own processor
(``transformers.AutoProcessor``) on it. The result, ``SampleInputs``, holds the prompt's token ids
with the media placeholders expanded, and the processor's media tensors (pixel values, grids,
audio features and masks).

The ``hf`` rollout generates from these inputs and the ``torch`` trainer recomputes log-probs from
them, so the two cannot drift apart: the trainer also checks that the token ids it rebuilt equal
the ones the rollout generated from, and fails loudly if not.

Generation must never sample a media placeholder (the recompute would then count a slot with no
media behind it), so the rollout suppresses ``placeholder_token_ids`` and the trainer masks the
same tokens out of its distribution: the behaviour and the recomputed log-probs are of one and the
same distribution.

torch and transformers are imported at module level: import this module inside methods.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from relax.media import MediaRef, MediaSet

#: Processor outputs that are per-sample token tensors rather than media tensors.
TOKEN_KEYS = ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids")
#: Media tensors whose last dimension is a per-sample length (padded with zeros when batched).
PADDED_KEYS = ("input_features", "feature_attention_mask")


@dataclass
class SampleInputs:
    """What the model reads for one sample's prompt."""

    prompt_ids: list[int]
    """Token ids of the rendered prompt, media placeholders expanded."""
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    """The processor's media tensors for this sample (``pixel_values``, ``image_grid_thw``, ...)."""


def load_processor(model_path: str) -> Any:
    """The model's own processor through ``AutoProcessor``. The built-in omni processor (which
    needs no torchvision) is registered with ``AutoProcessor`` first."""
    from transformers import AutoProcessor

    import relax_plugins.models.omni_processor  # noqa: F401  (registers RelaxOmniProcessor)

    return AutoProcessor.from_pretrained(model_path)


def load_policy_model(model_path: str, dtype: Any, multimodal: bool) -> Any:
    """The generating model: a causal LM for text, the multimodal LM class for media (a
    Qwen-Omni thinker is not an ``AutoModelForCausalLM``)."""
    if multimodal:
        from transformers import AutoModelForMultimodalLM

        return AutoModelForMultimodalLM.from_pretrained(model_path, dtype=dtype)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)


def placeholder_token_ids(model_config: Any) -> list[int]:
    """Ids of the media placeholder and media start tokens a model config names (image, video,
    audio and vision ``*_token_id`` entries, of the config or its ``thinker_config``)."""
    ids: set[int] = set()
    for config in (model_config, getattr(model_config, "thinker_config", None)):
        if config is None:
            continue
        for name, value in config.to_dict().items():
            if (name.endswith("_token_id") and isinstance(value, int) and not name.endswith("end_token_id")
                    and any(word in name for word in ("image", "video", "audio", "vision"))):
                ids.add(int(value))
    return sorted(ids)


#: The logit a masked placeholder token gets: far below any real logit, yet finite, so a log-prob at a
#: prompt position holding a placeholder stays finite (and vanishes under the response mask).
MASKED_LOGIT = -1.0e9


def mask_placeholders(logits: torch.Tensor, token_ids: list[int]) -> torch.Tensor:
    """``logits`` with the placeholder tokens masked out (the distribution generation samples from
    when it suppresses them)."""
    if not token_ids:
        return logits
    return logits.index_fill(-1, torch.tensor(token_ids, device=logits.device), MASKED_LOGIT)


def chat_text(processor: Any, prompt: str, refs: list[MediaRef]) -> str:
    """The prompt rendered by the model's chat template: one content item per media item (in the
    order of ``refs``) followed by the text, and the generation prompt."""
    content: list[dict[str, Any]] = [{"type": ref.modality} for ref in refs]
    content.append({"type": "text", "text": prompt})
    return processor.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)


def encode_sample(processor: Any, media: MediaSet, prompt: str, refs: list[MediaRef]) -> SampleInputs:
    """A sample's model inputs, built through its modality plugins and the model's processor."""
    return encode_text(processor, media, chat_text(processor, prompt, refs), refs)


def encode_text(processor: Any, media: MediaSet, text: str, refs: list[MediaRef]) -> SampleInputs:
    """Rendered text with one media marker per item of ``refs`` (in order) through the model's
    processor: the ids with the placeholders expanded, and the items' media tensors."""
    arguments: dict[str, list[Any]] = {}
    kwargs: dict[str, Any] = {}
    for ref in refs:
        plugin = media.plugins[ref.modality]
        arguments.setdefault(plugin.processor_argument, []).append(media.load(ref).data)
        for group, values in plugin.processor_kwargs().items():
            kwargs.setdefault(group, {}).update(values)
    out = processor(text=[text], return_tensors="pt", **arguments, **kwargs)
    ids = [int(t) for t in out["input_ids"][0].tolist()]
    tensors = {k: torch.as_tensor(v) for k, v in out.items() if k not in TOKEN_KEYS}
    return SampleInputs(prompt_ids=ids, tensors=tensors)


class ItemEncoder:
    """The media tensors of a token sequence's media items, one item at a time (its modality's
    marker alone through the processor), cached by checksum: what a multi-turn trajectory needs,
    whose tokens are given and never re-rendered. ``prompt_ids`` of the result are the items'
    expanded placeholder ids, concatenated (a caller checks the sequence has as many)."""

    def __init__(self, processor: Any, media: MediaSet, capacity: int = 1024) -> None:
        self.processor, self.media, self.capacity = processor, media, capacity
        self._cache: OrderedDict[str, SampleInputs] = OrderedDict()

    def item(self, ref: MediaRef) -> SampleInputs:
        key = f"{ref.modality}:{ref.sha256}:{json.dumps(ref.meta, sort_keys=True)}"
        found = self._cache.get(key)
        if found is not None:
            self._cache.move_to_end(key)
            return found
        marker = getattr(self.processor, f"{ref.modality}_token", None)
        if not marker:
            raise ValueError(f"the model's processor ({type(self.processor).__name__}) names no {ref.modality}_token; "
                             f"it cannot place a {ref.modality} given as tokens")
        sample = encode_text(self.processor, self.media, marker, [ref])
        self._cache[key] = sample
        if len(self._cache) > self.capacity:
            self._cache.popitem(last=False)
        return sample

    def __call__(self, refs: list[MediaRef]) -> SampleInputs:
        items = [self.item(ref) for ref in refs]
        tensors = batch_media(items) if items else {}
        return SampleInputs(prompt_ids=[t for s in items for t in s.prompt_ids], tensors=tensors)


def pad_token_ids(processor: Any) -> list[int]:
    """Ids of the processor's media pad tokens (``image_token``, ``audio_token``, ``video_token``):
    the tokens a media item expands to, one per embedding."""
    markers = [getattr(processor, f"{m}_token", None) for m in ("image", "audio", "video")]
    return sorted({int(processor.tokenizer.convert_tokens_to_ids(m)) for m in markers if m})


def placeholder_count(ids: list[int], placeholders: list[int]) -> int:
    """How many of ``ids`` are among ``placeholders``."""
    wanted = set(placeholders)
    return sum(1 for t in ids if t in wanted)


def batch_media(samples: list[SampleInputs]) -> dict[str, torch.Tensor]:
    """The media tensors of several samples (one per row, repeats allowed) as one batch: media
    items are concatenated in row order; per-item lengths (audio frames) are zero-padded."""
    keys: list[str] = []
    for sample in samples:
        keys += [k for k in sample.tensors if k not in keys]
    out: dict[str, torch.Tensor] = {}
    for key in keys:
        parts = [s.tensors[key] for s in samples if key in s.tensors]
        if key in PADDED_KEYS:
            width = max(p.shape[-1] for p in parts)
            parts = [torch.nn.functional.pad(p, (0, width - p.shape[-1])) for p in parts]
        out[key] = torch.cat(parts, dim=0)
    return out


class SampleEncoder:
    """``encode_sample`` with a small cache: the samples of one prompt share its inputs, and a
    trainer reads the same rows for log-probs and the update."""

    def __init__(self, processor: Any, media: MediaSet, max_prompt_tokens: int, capacity: int = 1024) -> None:
        self.processor, self.media = processor, media
        self.max_prompt_tokens = max_prompt_tokens
        self.capacity = capacity
        self._cache: OrderedDict[str, SampleInputs] = OrderedDict()

    def __call__(self, prompt: str, refs: list[MediaRef]) -> SampleInputs:
        key = json.dumps([prompt, [r.to_dict() for r in refs]], sort_keys=True)
        found = self._cache.get(key)
        if found is not None:
            self._cache.move_to_end(key)
            return found
        sample = encode_sample(self.processor, self.media, prompt, refs)
        if len(sample.prompt_ids) > self.max_prompt_tokens:
            raise ValueError(f"a prompt with media encodes to {len(sample.prompt_ids)} tokens, more than "
                             f"data.max_prompt_tokens={self.max_prompt_tokens}; a prompt with media placeholders "
                             "cannot be cut, so raise data.max_prompt_tokens or lower the media budgets")
        self._cache[key] = sample
        if len(self._cache) > self.capacity:
            self._cache.popitem(last=False)
        return sample
