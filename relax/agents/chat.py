"""The chat template's tokens of a trajectory, appended message by message: token in, token out.

A trajectory's tokens are never rebuilt from decoded text. The prompt is rendered once with the
model's chat template (with the environment's tools); after each model turn only the new message
is rendered and tokenized, and appended to the tokens the model actually read and wrote. What a
new message adds is learned from the template itself: render a fixed conversation with and
without the message and keep the difference. A template that rewrites earlier messages when a new
one comes (it would make the text differ from the tokens) is refused with a clear error.

The assistant turn's closing text (``<|im_end|>\\n`` in ChatML) is split at the model's stop token:
the model wrote the stop token itself (a model token), the rest of the closing text (``\\n``) is the
template's and goes in front of the next message (not the model's: loss mask 0).

Media in a message (a tool that returns an image) go through the model's processor, which expands
each media marker into its placeholder tokens and gives the media tensors; the media themselves
travel as references (``relax.media``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from relax.contracts import Observation, ToolSpec, cut_prompt
from relax.media import MediaRef

#: The fixed conversation the template's message boundaries are learned from.
_PROBE_USER, _PROBE_ANSWER = "relax-probe-question", "relax-probe-answer"


class TemplateError(ValueError):
    """The model's chat template cannot be used for multi-turn token-in, token-out rollouts."""


@dataclass
class Rendered:
    """Tokens of rendered messages: ids (media placeholders expanded) and the media refs in them."""

    ids: list[int]
    media: list[MediaRef] = field(default_factory=list)


class ChatTokens:
    """Renders a trajectory's messages into tokens with the model's chat template (and processor,
    for media), one message at a time."""

    def __init__(self, tokenizer: Any, tools: list[ToolSpec],
                 encode_media: Callable[[str, list[MediaRef]], list[int]] | None = None,
                 max_prompt_tokens: int = 256) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise TemplateError(f"the tokenizer of the model has no chat template ({type(tokenizer).__name__}); "
                                "agentic rollouts render every message with it: give the model folder a "
                                "chat_template (tokenizer_config.json or chat_template.jinja)")
        self.tokenizer = tokenizer
        self.encode_media = encode_media
        """The rollout backend's ``encode_text`` (text with media markers -> ids with the placeholders
        expanded, through the model's processor); None when the backend reads text only."""
        self.tools = [t.to_openai() for t in tools] or None
        self.max_prompt_tokens = max_prompt_tokens
        probe = [{"role": "user", "content": _PROBE_USER}, {"role": "assistant", "content": _PROBE_ANSWER}]
        self._probe = probe
        closed = self.render(probe, generation_prompt=False)
        at = closed.rfind(_PROBE_ANSWER)
        if at < 0:
            raise TemplateError("the chat template drops an assistant message's content; it cannot render a "
                                "multi-turn trajectory")
        self.turn_end = closed[at + len(_PROBE_ANSWER):]
        """The template's text after an assistant message (``<|im_end|>\\n`` in ChatML)."""
        self._closed = closed

    def render(self, messages: list[dict[str, Any]], generation_prompt: bool) -> str:
        """The messages through the model's chat template, as ``apply_chat_template(...,
        tokenize=False)`` renders them, within ``relax.chat_templates``' bounds of nesting, output
        size and time (a template past one is a ``TemplateError`` naming it)."""
        from relax.chat_templates import TemplateBoundError, render_chat

        source = self.tokenizer.get_chat_template(None, self.tools) \
            if hasattr(self.tokenizer, "get_chat_template") else self.tokenizer.chat_template
        try:
            return render_chat(source, messages, self.tokenizer, tools=self.tools,
                               add_generation_prompt=generation_prompt)
        except TemplateBoundError as exc:
            raise TemplateError(f"the model's chat template is refused while rendering a conversation: {exc}; "
                                "use a template that renders in well under a second (docs/security.md)") from None

    def prompt(self, text: str, refs: list[MediaRef] | None = None) -> Rendered:
        """The first prompt: the data row's text (and media) as the user message, then the
        assistant header, with the tools declared."""
        refs = list(refs or [])
        text = cut_prompt(text, self.max_prompt_tokens)  # never render and tokenize a huge prompt whole
        content: str | list[dict[str, Any]] = text
        if refs:
            content = [{"type": r.modality} for r in refs] + [{"type": "text", "text": text}]
        rendered = self._encode(self.render([{"role": "user", "content": content}], generation_prompt=True), refs)
        if len(rendered.ids) > self.max_prompt_tokens:
            if refs:
                raise ValueError(f"a prompt with media encodes to {len(rendered.ids)} tokens, more than "
                                 f"data.max_prompt_tokens={self.max_prompt_tokens}; raise it or lower the media "
                                 "budgets")
            rendered.ids = rendered.ids[-self.max_prompt_tokens:]
        return rendered

    def message(self, observation: Observation, refs: list[MediaRef], model_stopped: str | None) -> Rendered:
        """The tokens that follow a model turn: the rest of the turn's closing text, the
        observation's message, and the assistant header of the next turn.

        ``model_stopped``: the decoded stop token the model ended its turn with (it is part of the
        closing text and already among the model's tokens); None when the turn was cut short."""
        content: str | list[dict[str, Any]] = observation.content
        if isinstance(content, list):  # media items as chat items; their data travel in ``refs``
            content = [item if item.get("type") == "text" else {"type": item["type"]} for item in content]
        message = {"role": observation.role, "content": content}
        if observation.role == "tool":
            message["name"] = observation.info.get("tool", "")
        return self.following([message], refs, model_stopped)

    def following(self, messages: list[dict[str, Any]], refs: list[MediaRef], model_stopped: str | None) -> Rendered:
        """The tokens that follow a model turn when ``messages`` (chat-template dicts, in order) come
        after it: the rest of the turn's closing text, every message, and the assistant header of the
        next turn (an agent program may send several messages at once, e.g. one per tool call).

        ``model_stopped`` as in ``message``."""
        whole = self.render([*self._probe, *messages], generation_prompt=True)
        if not whole.startswith(self._closed):
            roles = ", ".join(repr(m.get("role")) for m in messages) or "no"
            raise TemplateError(f"the chat template renders earlier messages differently once {roles} message(s) "
                                "follow; token-in, token-out rollouts need a template that only appends "
                                "(see docs/agents.md)")
        closing = self.turn_end
        if model_stopped and closing.startswith(model_stopped):
            closing = closing[len(model_stopped):]
        return self._encode(closing + whole[len(self._closed):], refs)

    def _encode(self, text: str, refs: list[MediaRef]) -> Rendered:
        if not refs:
            return Rendered(list(self.tokenizer(text, add_special_tokens=False)["input_ids"]))
        if self.encode_media is None:
            raise ValueError("a message carries media but the rollout backend reads text only (it has no "
                             "encode_text); list the modality under data.media_keys and model.modalities, "
                             "with a backend that reads it")
        return Rendered(list(self.encode_media(text, refs)), list(refs))
