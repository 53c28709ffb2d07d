"""``hf``: a rollout backend on plain Hugging Face transformers models (CPU or one GPU).

The always-available rollout: no engine to start, all prompts x samples in one batch. Text models
are sampled by a lean loop over the model's forward (``relax_plugins.rollout.decode``: shared
prompts prefilled once, one inverse-CDF draw per row and token); media models, whose prefill takes
their media tensors, go through ``transformers``' ``generate``. Behaviour log-probs are those of
the distribution each token was actually sampled from: ``log softmax`` of the logits after
temperature scaling and top-k / top-p truncation. With temperature 1, top_p 1 and top_k 0 that is
the model's own distribution, which the trainer reproduces to float32 round-off. With temperature
T != 1 it is ``softmax(logits / T)``, which the ``torch`` trainer also uses (it divides by the
rollout's temperature); top-k / top-p truncation and the repetition penalty are not reproduced by
the trainer. Greedy decoding (temperature 0) reports the log-probs of the unscaled model.

Stop strings (``sampling.stop``) end a response at the token that completes the first of them
(``relax.algo.stop_strings``: that token is the response's last, trained on like a stop
token; the text ends before the string). The repetition penalty (``sampling.repetition_penalty``)
is CTRL's, as ``transformers`` applies it, on the prompt's and the response's tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from relax.contracts import Generation, RolloutContext


class HFRollout:
    """Samples responses with ``transformers``; seeded, so the same weights, prompts and seed give
    the same generations."""

    #: Inputs the backend accepts: media through the model's own Hugging Face processor
    #: (``relax_plugins.processing``, shared with the torch trainer).
    modalities: ClassVar[frozenset[str]] = frozenset({"text", "image", "audio", "video"})
    parallelism: ClassVar[frozenset[str]] = frozenset({"dp"})
    #: Ranks this backend takes in a weight group (``relax.weight_group``): one, this process.
    weight_group_ranks: ClassVar[int] = 1
    #: It records MoE routing for replay (Qwen2/Qwen3-MoE routers, ``relax_plugins.moe_routing``).
    router_replay: ClassVar[frozenset[str]] = frozenset({"r3"})
    #: ``generate_tokens`` honours ``pause``: partial rollouts (``roles.rollout.partial``) can stop
    #: it at a token boundary to swap weights, and continue from the tokens it returned.
    pausable: ClassVar[bool] = True
    #: Applies the actor's LoRA adapter: an adapter attached to its own base copy, whose tensors each
    #: weight sync replaces (relax_plugins.lora).
    lora_adapters: ClassVar[bool] = True
    #: Token prompts may carry a grammar (``TokenPrompt.grammar``): each step's logits are masked by
    #: an llguidance matcher (``relax_plugins.rollout.grammars``), on the lean loop and in ``generate``.
    constrained_decoding: ClassVar[frozenset[str]] = frozenset({"grammar"})
    #: And takes that adapter from a weight group too (``receive_weights`` copies it into the adapter).
    adapter_weight_group: ClassVar[bool] = True

    class Config(BaseModel):
        """Options of the Hugging Face rollout backend."""

        model_config = ConfigDict(extra="forbid")

        max_batch_size: int | None = Field(None, ge=1)
        """Sequences per ``generate`` call; null generates all prompts x samples in one call."""
        num_threads: int | None = Field(None, ge=1)
        """torch intra-op threads of this process; null leaves torch's setting alone."""

    def __init__(self, config: HFRollout.Config, context: RolloutContext) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.context = context
        self.device = torch.device(context.device)
        self.model_path = context.model.path
        self.max_prompt_tokens = int(context.max_prompt_tokens)
        from relax.media import MediaSet

        self.media = MediaSet.from_info(context.media)
        """The run's modality plugins (None for text runs): media come as references and are
        decoded here through the same plugins and processor as in the trainer."""
        self.encoder: Any = None
        self._items: Any = None
        """Media tensors per reference for token prompts (``generate_tokens``), built on first use."""
        self.suppressed: list[int] = []
        if self.media is not None:
            from relax_plugins.processing import SampleEncoder, load_processor

            processor = load_processor(self.model_path)
            self.tokenizer = processor.tokenizer
            self.encoder = SampleEncoder(processor, self.media, self.max_prompt_tokens)
        else:
            self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.eos_token_id, self.pad_token_id = end_and_pad_ids(self.tokenizer, self.model_path)
        from relax_plugins.rollout.chat_template import PromptEncoder

        self.prompts = PromptEncoder(self.tokenizer, context.chat_template, self.max_prompt_tokens,
                                     context.on_long_prompt)
        dtype = getattr(torch, context.model.dtype)
        if self.media is not None:
            from relax_plugins.processing import load_policy_model, placeholder_token_ids

            self.model = load_policy_model(self.model_path, dtype, multimodal=True)
            # Never sample a media placeholder: the trainer masks the same tokens (see processing).
            self.suppressed = placeholder_token_ids(self.model.config)
        else:
            self.model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=dtype)
        self.model.to(self.device).eval()
        self.adapter: Any = None
        """With the actor's LoRA (``context.lora``): the ``peft`` model around ``self.model``, whose
        adapter each weight sync replaces; the base weights never change."""
        if context.lora is not None:
            from relax_plugins.lora import attach

            self.adapter = attach(self.model, context.lora, trainable=False)
        # A response ends at the tokenizer's eos or at any end token of the model's generation
        # config (chat models often have several, e.g. <|im_end|> and <|endoftext|>).
        declared = self.model.generation_config.eos_token_id
        declared = declared if isinstance(declared, list) else [declared] if declared is not None else []
        self.stop_token_ids = [self.eos_token_id] + [int(t) for t in declared if int(t) != self.eos_token_id]
        from relax_plugins.rollout.decode import supports

        self.lean = self.media is None and supports(self.model)
        """Text generation runs on the lean sampling loop (``relax_plugins.rollout.decode``);
        media models and models without a standard key/value cache keep ``generate``."""
        self._grammar_tokenizer: Any = None
        """llguidance's view of the tokenizer, built on the first constrained prompt."""
        self.version = 0
        """The policy version of the weights held (0: the initial weights)."""
        self._recipient: Any = None
        """This rollout's end of a weight group, once joined (``roles.rollout.weight_sync: collective``)."""
        self.shares_model = False
        """Whether ``self.model`` is a trainer's (``adopt_model``): its weights are always current."""

    # -- generation ---------------------------------------------------------------------------

    def encode_prompt(self, prompt: str) -> list[int]:
        """Token ids of a prompt: rendered by ``data.chat_template`` and cut from the left to
        ``data.max_prompt_tokens`` (``relax_plugins.rollout.chat_template``)."""
        return self.prompts(prompt)

    def generate(self, prompts: list[str], n: int, sampling: Any, seed: int,
                 media: list[list[Any]] | None = None) -> list[Generation]:
        """``n`` samples of each prompt, prompt-major (``prompt_index`` = index into ``prompts``).

        ``media`` (multimodal runs) holds each prompt's media references (``relax.media.MediaRef``);
        the prompt is then rendered and encoded with its media by ``relax_plugins.processing``."""
        import torch

        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        samples: list[Any] | None = None
        if media is not None:
            if self.encoder is None:
                raise ValueError("generate got media, but the spec has no data.media_keys; list the media "
                                 "columns there so the rollout builds its modality plugins and processor")
            if len(media) != len(prompts):
                raise ValueError(f"media has {len(media)} entries for {len(prompts)} prompts; give one per prompt")
            samples = [self.encoder(p, refs) for p, refs in zip(prompts, media)]
            encoded = [s.prompt_ids for s in samples]
        else:
            encoded = self.prompts.encode_all(list(prompts))
        rows = [(index, ids) for index, ids in enumerate(encoded) for _ in range(n)]
        size = self.config.max_batch_size or max(1, len(rows))
        out: list[Generation] = []
        for part, start in enumerate(range(0, len(rows), size)):
            chunk = rows[start:start + size]
            with torch.no_grad():
                extra = {}
                if samples is not None:
                    from relax_plugins.processing import batch_media

                    extra = {k: v.to(self.device) for k, v in batch_media([samples[i] for i, _ in chunk]).items()}
                out += self._generate_rows(chunk, sampling, seed + part, extra)
        return out

    def generate_tokens(self, prompts: list[Any], sampling: Any, seed: int,
                        pause: Callable[[list[bool]], bool] | None = None) -> list[Generation]:
        """One response to each ``relax.contracts.TokenPrompt`` (a multi-turn trajectory's tokens so
        far, used as given: never re-tokenized or cut), in order, each within its own budget.

        All rows are sampled together, each stopping at its own budget. The media of each prompt are
        rebuilt from their references item by item (``processing.ItemEncoder``), as the trainer does.

        ``pause`` (partial rollouts) is asked after every generated token with each row's state
        (True once it ended or used its budget); when it answers True every row stops there and
        comes back as far as it got (``finished`` False and shorter than its budget when it was cut
        short), so the caller can continue it, with other weights, from its tokens."""
        import torch

        if not prompts:
            return []
        extra: dict[str, Any] = {}
        if any(p.media for p in prompts):
            if self.encoder is None:
                raise ValueError("a prompt carries media but the spec has no data.media_keys; list the media "
                                 "columns there so the rollout builds its modality plugins and processor")
            from relax_plugins.processing import ItemEncoder, batch_media

            if self._items is None:
                self._items = ItemEncoder(self.encoder.processor, self.media)
            extra = {k: v.to(self.device) for k, v in batch_media([self._items(p.media) for p in prompts]).items()}
        budgets = [int(p.max_new_tokens or sampling.max_new_tokens) for p in prompts]
        rows = [(index, list(p.ids)) for index, p in enumerate(prompts)]
        texts = [getattr(p, "grammar", None) for p in prompts]
        grammars = None
        if any(t is not None for t in texts):
            from relax_plugins.rollout.grammars import RowGrammars, grammar_tokenizer

            if self._grammar_tokenizer is None:
                self._grammar_tokenizer = grammar_tokenizer(self.tokenizer, self.stop_token_ids)
            grammars = RowGrammars(self._grammar_tokenizer, texts)
        with torch.no_grad():
            return self._generate_rows(rows, sampling, seed, extra, pause, budgets, grammars)

    def encode_text(self, text: str, refs: list[Any]) -> list[int]:
        """Rendered chat text with one media marker per reference, as the model reads it: ids with the
        placeholders expanded by the model's processor (agentic rollouts' media observations)."""
        if self.encoder is None:
            raise ValueError("text with media needs the model's processor; list the media columns under "
                             "data.media_keys")
        from relax_plugins.processing import encode_text

        return encode_text(self.encoder.processor, self.media, text, list(refs)).prompt_ids

    def _generation_config(self, sampling: Any) -> Any:
        from transformers import GenerationConfig

        common = dict(
            max_new_tokens=int(sampling.max_new_tokens),
            eos_token_id=list(self.stop_token_ids),
            pad_token_id=self.pad_token_id,
            bos_token_id=None,
            num_beams=1,
            use_cache=True,
            output_scores=True,
            return_dict_in_generate=True,
        )
        if self.suppressed:
            common["suppress_tokens"] = list(self.suppressed)
        if sampling.temperature <= 0:
            return GenerationConfig(do_sample=False, **common)
        return GenerationConfig(
            do_sample=True,
            temperature=float(sampling.temperature),
            top_p=float(sampling.top_p),
            top_k=int(sampling.top_k),  # 0 keeps every token (transformers' own default is 50)
            **common,
        )

    def _generate_rows(self, rows: list[tuple[int, list[int]]], sampling: Any, seed: int,
                       media_inputs: dict[str, Any] | None = None, pause: Any = None,
                       budgets: list[int] | None = None, grammars: Any = None) -> list[Generation]:
        """One response per ``(prompt_index, prompt ids)`` row, row i within ``budgets[i]`` new
        tokens (the sampling's ``max_new_tokens`` when not given), drawn from ``seed`` (a generator
        of its own: the process's global random state is left alone)."""
        import torch

        budgets = budgets or [int(sampling.max_new_tokens)] * len(rows)
        stops = self.stop_strings(sampling)
        if self.model.training:  # a trainer's model (``adopt_model``) it left in training mode
            self.model.eval()
        recorder = None
        if self.context.record_routing:
            from relax_plugins.moe_routing import GenerationRouting

            recorder = GenerationRouting(self.model, len(rows))
        with recorder if recorder is not None else nullcontext():
            if self.lean and not media_inputs:
                from relax_plugins.rollout.decode import sample

                sampled = sample(self.model, [ids for _, ids in rows], budgets,
                                 temperature=float(sampling.temperature), top_p=float(sampling.top_p),
                                 top_k=int(sampling.top_k), stop_ids=self.stop_token_ids, pad_id=self.pad_token_id,
                                 suppressed=self.suppressed, share_prompts=recorder is None, pause=pause,
                                 generator=torch.Generator(self.device).manual_seed(seed),
                                 repetition_penalty=float(getattr(sampling, "repetition_penalty", 1.0)),
                                 stop_strings=stops, grammars=grammars)
            else:
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(seed)
                    if self.device.type == "cuda":
                        torch.cuda.manual_seed(seed)
                    sampled = self._sample_with_generate(rows, sampling, budgets, media_inputs or {}, pause, stops,
                                                         grammars)
        routed = (recorder.per_row([len(t) for t in sampled.tokens]) if recorder is not None
                  else [None] * len(rows))
        from relax.algo.stop_strings import response_text

        generations = []
        for i, (prompt_index, ids) in enumerate(rows):
            response, finished = sampled.tokens[i], sampled.finished[i]
            generations.append(Generation(
                prompt_index=prompt_index,
                prompt_ids=list(ids),
                response_ids=response,
                logprobs=sampled.logprobs[i],
                text=response_text(self.tokenizer, response, finished, self.stop_token_ids, stops),
                finished=finished,
                routed_experts=routed[i],
            ))
        return generations

    def stop_strings(self, sampling: Any) -> Any:
        """The sampling's stop strings (``StopStrings``) for this tokenizer; None without any."""
        stop = tuple(getattr(sampling, "stop", ()) or ())
        if not stop:
            return None
        from relax.algo.stop_strings import StopStrings

        return StopStrings(self.tokenizer, stop)

    def _sample_with_generate(self, rows: list[tuple[int, list[int]]], sampling: Any, budgets: list[int],
                              media_inputs: dict[str, Any], pause: Any, stops: Any = None,
                              grammars: Any = None) -> Any:
        """``transformers``' own ``generate``, for what the lean loop does not drive: models with
        media inputs (their prefill takes the media tensors and model-specific positions) and
        models without a standard key/value cache. One call at the widest budget; each row is then
        cut to its own, and after the token that completes a stop string (a prefix of a sample is
        a sample with the same log-probs)."""
        import torch

        from relax_plugins.rollout.decode import Sampled

        width = max(len(ids) for _, ids in rows)
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, (_, ids) in enumerate(rows):
            input_ids[i, width - len(ids):] = torch.tensor(ids, dtype=torch.long)
            attention_mask[i, width - len(ids):] = 1
        widest = sampling.model_copy(update={"max_new_tokens": max(budgets)})
        stopping = {} if pause is None else {
            "stopping_criteria": _PauseAt(pause, self.stop_token_ids, budgets, stops).criteria(width)}
        penalty = float(getattr(sampling, "repetition_penalty", 1.0))
        if penalty != 1.0:  # on each row's own tokens: its left padding is no token of its prompt
            stopping["logits_processor"] = _row_repetition_penalty(penalty, [width - len(ids) for _, ids in rows])
        if grammars:  # after the penalty, as in the lean loop
            from transformers import LogitsProcessorList

            from relax_plugins.rollout.grammars import grammar_logits_processor

            stopping["logits_processor"] = LogitsProcessorList(
                [*stopping.get("logits_processor", []), grammar_logits_processor(grammars, self.stop_token_ids)])
        result = self.model.generate(
            input_ids=input_ids.to(self.device),
            attention_mask=attention_mask.to(self.device),
            generation_config=self._generation_config(widest),
            **stopping,
            **media_inputs,
        )
        new_tokens = result.sequences[:, width:].cpu()
        scores = torch.stack(result.scores, dim=1).float()  # [rows, new, vocab], as sampled from
        logprobs = torch.log_softmax(scores, dim=-1).gather(
            -1, new_tokens.to(scores.device).unsqueeze(-1)).squeeze(-1).cpu().tolist()
        ends = set(self.stop_token_ids)
        tokens, kept, finished = [], [], []
        for i, sequence in enumerate(new_tokens.tolist()):
            end = next((j for j, token in enumerate(sequence[:budgets[i]]) if token in ends), None)
            length = min(len(sequence), budgets[i]) if end is None else end + 1
            at = stops.end(sequence[:length]) if stops else None
            if at is not None and (end is None or at < length):
                length, end = at, at - 1
            tokens.append(sequence[:length])
            kept.append(logprobs[i][:length])
            finished.append(end is not None)
        return Sampled(tokens=tokens, logprobs=kept, finished=finished)

    # -- weights --------------------------------------------------------------------------------

    def load_weights(self, weights: dict[str, Any], version: int) -> None:
        """Replace the weights in place with a full HF ``state_dict`` (a tied ``lm_head.weight``
        may be absent) and record their policy ``version``. With the trainer's model adopted
        (``adopt_model``) the weights are already the trainer's: an empty dict only moves the
        version."""
        from relax_plugins.hf_weights import load_state

        if self.shares_model and not weights:
            self.version = int(version)
            return
        if self.adapter is not None:  # the adapter's tensors alone (PEFT names)
            from relax_plugins.lora import load_adapter

            load_adapter(self.model, weights)
        else:
            load_state(self.model, weights)
        self.version = int(version)

    def adopt_model(self, model: Any) -> bool:
        """Generate with ``model``, a trainer's model in this process, instead of this backend's
        own copy (colocate mode, ``relax.runtime.worker.weight_channels.share_policy_model``): no weight
        copy per step and one copy of the weights in memory instead of three (the trainer's, the
        handed-over snapshot, this backend's). Taken only when it is the same kind of model, of
        the same configuration, dtype and device; returns whether it was taken."""
        import torch

        own = self.model
        if model is own or type(model) is not type(own) or model.config.to_dict() != own.config.to_dict():
            return False
        first = next(model.parameters(), None)
        if first is None or first.dtype != next(own.parameters()).dtype or not same_device(first.device, self.device):
            return False
        if self.context.record_routing or self._recipient is not None:
            return False  # routing capture hooks this model per generation; a weight group fills its own
        self.model = model
        self.shares_model = True
        if self.device.type == "cuda":
            del own
            torch.cuda.empty_cache()
        return True

    def load_buckets(self, shapes: dict[str, Any], buckets: Any, version: int) -> int:
        """Take a trainer's weights in this process as its extractor yields them (colocation across
        ranks): ``shapes`` are every tensor's (dtype, shape), checked before any is copied, and
        ``buckets`` the ``(name, tensor)`` lists, copied into the model one bucket at a time, so no
        second full copy is ever held. Records ``version``; returns the bytes taken."""
        from relax_plugins.hf_weights import load_stream

        if self.adapter is not None:
            raise ValueError("an hf rollout with a LoRA adapter takes the adapter through load_weights; colocation "
                             "across ranks hands over full weights only")
        taken = 0

        def tensors() -> Any:
            nonlocal taken
            for bucket in buckets:
                for name, tensor in bucket:
                    taken += tensor.numel() * tensor.element_size()
                    yield name, tensor

        load_stream(self.model, {name: list(shape) for name, (_, shape) in shapes.items()}, tensors())
        self.version = int(version)
        return taken

    def sleep(self) -> None:
        """Free the device while the trainer beside it trains: on a GPU the model moves to host
        memory (the ``hf`` engine keeps no cache between calls); on CPU there is nothing to free."""
        import torch

        if self.device.type == "cuda" and not self.asleep:
            self.model.to("cpu")
            torch.cuda.empty_cache()
        self.asleep = True

    def wake(self) -> None:
        """Back on the device before the next weights or generation (``sleep``)."""
        if self.asleep and self.device.type == "cuda":
            self.model.to(self.device)
        self.asleep = False

    asleep: bool = False
    """Whether the model is off the device (``sleep``) until ``wake``."""

    def join_weight_group(self, address: dict[str, Any]) -> None:
        """Join a weight group as its rank 1 (the group forms once the sender sends its first round)."""
        from relax.weight_group import WeightRecipient

        self.close_weight_group()
        self._recipient = WeightRecipient(address, 1, who=f"hf rollout ({self.model_path})")

    def receive_weights(self) -> int:
        """Receive one round of the joined weight group straight into the model, bucket by bucket
        (no second full copy), and record its policy version. Returns the version. A round that does
        not fit the model is taken off the wire and refused before any of it is loaded."""
        from relax_plugins.hf_weights import load_stream

        recipient = self._recipient
        if recipient is None:
            raise RuntimeError("receive_weights before join_weight_group; join the sender's group first")
        version, tensors = recipient.receive()
        if self.adapter is not None:  # a LoRA adapter's tensors (a few MB): taken whole, checked, then copied
            from relax_plugins.lora import load_adapter

            load_adapter(self.model, {name: tensor.clone() for name, tensor in tensors})
        else:
            load_stream(self.model, recipient.shapes, tensors)
        self.version = int(version)
        return self.version

    def close_weight_group(self) -> None:
        """Leave the weight group, if joined (a later join opens a new one)."""
        recipient, self._recipient = self._recipient, None
        if recipient is not None:
            recipient.close()


class _PauseAt:
    """Asks a partial rollout's ``pause`` after each generated token whether to stop the whole
    batch there (a ``transformers`` stopping criterion that stops every row or none)."""

    def __init__(self, pause: Callable[[list[bool]], bool], stop_token_ids: list[int], budgets: list[int],
                 stop_strings: Any = None) -> None:
        self.pause, self.stops, self.budgets = pause, set(stop_token_ids), budgets
        self.stop_strings = stop_strings
        self.done = [False] * len(budgets)

    def criteria(self, width: int) -> Any:
        import torch
        from transformers import StoppingCriteria, StoppingCriteriaList

        outer = self

        class Criterion(StoppingCriteria):
            def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
                made = input_ids.shape[1] - width
                for i, token in enumerate(input_ids[:, -1].tolist()):
                    if not outer.done[i] and (token in outer.stops or made >= outer.budgets[i]):
                        outer.done[i] = True
                texts = outer.stop_strings
                if texts:  # rows whose response now completes a stop string are done too
                    rows = [i for i, done in enumerate(outer.done) if not done]
                    tails = input_ids[rows, max(width, input_ids.shape[1] - texts.window):].tolist()
                    for i, ended in zip(rows, texts.ended(tails) if rows else []):
                        outer.done[i] = outer.done[i] or ended
                stop = bool(outer.pause(list(outer.done)))
                return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)

        return StoppingCriteriaList([Criterion()])


def _row_repetition_penalty(penalty: float, starts: list[int]) -> Any:
    """``generate``'s logits processor for the repetition penalty of the lean loop
    (``relax_plugins.rollout.decode.penalize_repetition``): on the tokens of row ``i`` from column
    ``starts[i]`` on (transformers' own processor would also penalize the pad token of left-padded
    rows). Run before temperature and top-k / top-p, as transformers' own is."""
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    from relax_plugins.rollout.decode import penalize_repetition

    class RowPenalty(LogitsProcessor):
        def __call__(self, input_ids: Any, scores: Any) -> Any:
            first = torch.tensor(starts, device=input_ids.device)
            held = (torch.arange(input_ids.shape[1], device=input_ids.device)[None, :] >= first[:, None]).int()
            seen = torch.zeros(scores.shape, dtype=torch.int32, device=scores.device).scatter_add_(1, input_ids, held)
            return penalize_repetition(scores, seen > 0, penalty)

    return LogitsProcessorList([RowPenalty()])


def same_device(held: Any, wanted: Any) -> bool:
    """Whether a tensor on ``held`` is on device ``wanted``; a device without an index (``cuda``)
    stands for the current one (``cuda:0`` by default)."""
    import torch

    if held.type != wanted.type:
        return False
    if wanted.index is None and wanted.type == "cuda":
        return held.index == torch.cuda.current_device()
    return wanted.index is None or held.index == wanted.index


def end_and_pad_ids(tokenizer: Any, model_path: str) -> tuple[int, int]:
    """The tokenizer's end-of-sequence id and its pad id (the eos when it has no pad token), for
    every rollout backend; a tokenizer without eos is refused: its responses could never stop."""
    if tokenizer.eos_token_id is None:
        raise ValueError(f"the tokenizer of {model_path} has no eos token; responses could never stop")
    eos = int(tokenizer.eos_token_id)
    pad = tokenizer.pad_token_id
    return eos, int(pad) if pad is not None else eos
