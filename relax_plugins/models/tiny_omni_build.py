"""Building ``builtin:tiny-omni``: tokenizer, processor, a random Qwen3-Omni thinker and its warm-up.

Imported by ``TinyOmni.materialize`` only (it needs torch, transformers, tokenizers, numpy, Pillow).
The numbers follow FACTS-omni section 1 (mrope_section must add up to head_dim / 2; the vision
tower's position table must be a perfect square; ``vision_start_token_id`` must be set although
the config does not declare it).
"""

from __future__ import annotations

import math
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from relax.algo.batch import token_logprobs
from relax.algo.losses import masked_mean
from relax.media import MediaSet
from relax_plugins.datasets.omni import omni_problem
from relax_plugins.models.omni_processor import FrameVideoProcessor, RelaxOmniProcessor
from relax_plugins.models.tiny_lm import CHARSET
from relax_plugins.models.tiny_omni import (
    IM_END,
    IM_START,
    MEDIA_TOKENS,
    PAD,
    SPECIAL_TOKENS,
    UNK,
    VOCAB_SIZE,
    TinyOmni,
)
from relax_plugins.processing import (
    SampleInputs,
    batch_media,
    encode_sample,
    mask_placeholders,
    placeholder_token_ids,
)

#: Characters of the rambling continuation some warm-up targets have after the answer.
RAMBLE = "abcdefghijklmnopqrstuvwxyz"
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif item['type'] == 'audio' -%}{{- '<|audio_start|><|audio_pad|><|audio_end|>' -}}"
    "{%- elif item['type'] == 'video' -%}{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- else -%}{{- item['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def train_tokenizer() -> Any:
    """A character-level tokenizer with the Qwen omni special tokens (one token each)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    size = VOCAB_SIZE
    core = Tokenizer(models.WordLevel(unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    trainer = trainers.WordLevelTrainer(vocab_size=size, min_frequency=1, special_tokens=list(SPECIAL_TOKENS))
    core.train_from_iterator(["".join(CHARSET)], trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, padding_side="left", truncation_side="left",
                                        pad_token=PAD, eos_token=IM_END, unk_token=UNK,
                                        extra_special_tokens=dict(MEDIA_TOKENS), model_max_length=4096)
    tokenizer.add_special_tokens({"additional_special_tokens": [IM_START]})
    if len(tokenizer) != size:
        raise RuntimeError(f"tiny-omni tokenizer has {len(tokenizer)} tokens, expected {size}")
    return tokenizer


def build_processor(tokenizer: Any) -> Any:
    """The processor: Pillow image processor, Whisper features, frame video processor, template."""
    from transformers import WhisperFeatureExtractor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    size = {"shortest_edge": 32 * 32, "longest_edge": 64 * 64 * 4}
    image = Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2, size=size,
                                     image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
    audio = WhisperFeatureExtractor(feature_size=128, sampling_rate=16000)
    video = FrameVideoProcessor(size=size)
    return RelaxOmniProcessor(image_processor=image, video_processor=video, feature_extractor=audio,
                              tokenizer=tokenizer, chat_template=CHAT_TEMPLATE)


def build_model(config: TinyOmni.Config, tokenizer: Any) -> Any:
    """The randomly initialised thinker (seeded by ``config.seed``)."""
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeThinkerConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        Qwen3OmniMoeThinkerForConditionalGeneration,
    )

    h = config.hidden_size
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in MEDIA_TOKENS.items()}
    text = dict(vocab_size=len(tokenizer), hidden_size=h, num_hidden_layers=config.num_layers,
                num_attention_heads=2, num_key_value_heads=1, head_dim=32, intermediate_size=2 * h,
                num_experts=config.num_experts, num_experts_per_tok=min(2, config.num_experts),
                moe_intermediate_size=h, mlp_only_layers=[], max_position_embeddings=4096,
                rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [6, 5, 5],
                                 "interleaved": True, "mrope_interleaved": True},
                pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
                tie_word_embeddings=False)
    vision = dict(depth=2, hidden_size=h, num_heads=2, intermediate_size=2 * h, patch_size=16,
                  spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=h, num_position_embeddings=256,
                  deepstack_visual_indexes=[0])
    audio = dict(num_mel_bins=128, encoder_layers=2, encoder_attention_heads=2, d_model=h, encoder_ffn_dim=2 * h,
                 output_dim=h, downsample_hidden_size=32, n_window=50, n_window_infer=800, conv_chunksize=500,
                 max_source_positions=1500)
    hf_config = Qwen3OmniMoeThinkerConfig(
        text_config=text, vision_config=vision, audio_config=audio, image_token_id=ids["image_token"],
        video_token_id=ids["video_token"], audio_token_id=ids["audio_token"],
        audio_start_token_id=ids["audio_bos_token"], position_id_per_seconds=13)
    hf_config.vision_start_token_id = ids["vision_bos_token"]  # required, though not a declared field
    hf_config.pad_token_id = tokenizer.pad_token_id
    hf_config.eos_token_id = tokenizer.eos_token_id
    torch.manual_seed(config.seed)
    return Qwen3OmniMoeThinkerForConditionalGeneration(hf_config).to(torch.float32)


def warmup_pool(config: TinyOmni.Config, processor: Any, folder: Path) -> list[tuple[SampleInputs, str]]:
    """``warmup_pool`` problems of every kind in turn, encoded once: (inputs, answer). The media go
    through the modality plugins and the shared encoder, exactly as in a run."""
    media = MediaSet({"image": "image", "audio": "audio", "video": "video"}, {}, spill_dir=folder)
    rng = random.Random(f"tiny-omni-warmup:{config.seed}")
    kinds = ("image", "audio", "video")
    pool = []
    for i in range(config.warmup_pool):
        problem = omni_problem(rng, kinds[i % 3])
        refs = media.refs({problem["kind"]: problem["media"]}, i)
        pool.append((encode_sample(processor, media, problem["prompt"], refs), problem["answer"]))
    return pool


def make_batch(examples: list[tuple[SampleInputs, list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Left-padded prompt + target rows with the media tensors and the target mask."""
    width = max(len(s.prompt_ids) + len(t) for s, t in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(examples), width), dtype=torch.long)
    target = torch.zeros((len(examples), width), dtype=torch.float32)
    for i, (sample, ids) in enumerate(examples):
        row = sample.prompt_ids + ids
        start = width - len(row)
        input_ids[i, start:] = torch.tensor(row)
        attention[i, start:] = 1
        target[i, width - len(ids):] = 1.0
    return {"input_ids": input_ids, "attention_mask": attention, "target": target,
            **batch_media([s for s, _ in examples])}


def targets(tokenizer: Any, answer: str, rng: random.Random, stop_probability: float) -> list[int]:
    """The answer's ids then eos; with probability ``1 - stop_probability`` a rambling tail comes
    first (a space and one to three letters), which exact match scores as wrong."""
    text = answer
    if rng.random() >= stop_probability:
        text += " " + "".join(rng.choice(RAMBLE) for _ in range(rng.randint(1, 3)))
    return tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


def forward_logprobs(model: Any, batch: dict[str, torch.Tensor], masked: list[int]) -> torch.Tensor:
    inputs = {k: v for k, v in batch.items() if k != "target"}
    logits = mask_placeholders(model(**inputs, use_cache=False).logits, masked)
    return token_logprobs(logits, batch["input_ids"])


def warm_up(model: Any, tokenizer: Any, config: TinyOmni.Config,
            pool: list[tuple[SampleInputs, str]]) -> dict[str, float]:
    """Supervised steps (mean NLL of the target tokens), a linear ramp then a cosine decay."""
    rng = random.Random(f"tiny-omni-steps:{config.seed}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.warmup_lr, weight_decay=0.0)
    steps, ramp = config.warmup_steps, max(1, config.warmup_steps // 10)

    def factor(step: int) -> float:
        if step < ramp:
            return (step + 1) / ramp
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * (step - ramp) / max(1, steps - ramp)))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    masked = placeholder_token_ids(model.config)
    model.train()
    loss_value = float("nan")
    for _ in range(steps):
        chosen = rng.sample(pool, min(config.warmup_batch_size, len(pool)))
        batch = make_batch([(s, targets(tokenizer, a, rng, config.warmup_stop_probability)) for s, a in chosen],
                           tokenizer.pad_token_id)
        loss = -masked_mean(forward_logprobs(model, batch, masked), batch["target"])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        loss_value = float(loss.item())
    model.eval()
    return {"warmup_final_loss": loss_value}


def expected_accuracy(model: Any, tokenizer: Any, pool: list[tuple[SampleInputs, str]],
                      with_eos: bool = True) -> float:
    """Mean over the examples of ``p(answer [+ eos] | prompt)``: the expected exact-match accuracy
    of sampling at temperature 1 (the tokenization is unique)."""
    examples = [(s, tokenizer(a, add_special_tokens=False)["input_ids"] + ([tokenizer.eos_token_id] if with_eos
                                                                          else [])) for s, a in pool]
    batch = make_batch(examples, tokenizer.pad_token_id)
    with torch.no_grad():
        per_token = forward_logprobs(model, batch, placeholder_token_ids(model.config)) * batch["target"]
    return float(per_token.sum(dim=1).exp().mean())


def build_tiny_omni(config: TinyOmni.Config, folder: Path) -> dict[str, Any]:
    """Write the processor and the warmed-up model into ``folder``; return a small build report."""
    start = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tokenizer = train_tokenizer()
        processor = build_processor(tokenizer)
        model = build_model(config, tokenizer)
        with tempfile.TemporaryDirectory(prefix="tiny-omni-media-") as media_dir:
            pool = warmup_pool(config, processor, Path(media_dir))
            report = warm_up(model, tokenizer, config, pool)
            held_out = warmup_pool(config.model_copy(update={"seed": config.seed + 10_000, "warmup_pool": 60}),
                                   processor, Path(media_dir))
            report["expected_accuracy"] = expected_accuracy(model, tokenizer, held_out)
            report["expected_answer_accuracy"] = expected_accuracy(model, tokenizer, held_out, with_eos=False)
    finally:
        torch.set_num_threads(threads)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = None
    model.save_pretrained(folder, safe_serialization=True)
    processor.save_pretrained(folder)
    report["build_seconds"] = round(time.perf_counter() - start, 3)
    report["parameters"] = sum(p.numel() for p in model.parameters())
    return report
