"""A text prompt's token ids as the rollout generates from them (``data.chat_template``).

The rollout is the one place a prompt is rendered and tokenized: its ids travel on the bus with the
response (``relax.runtime.worker.rows``), and every trainer role (actor, reference, actor_fwd, critic)
reads those ids, never the text, so the trainer trains on exactly the tokens the rollout sampled
after. ``hf`` and ``vllm`` both encode through ``PromptEncoder``.

A prompt's text is cut to ``relax.contracts.prompt_char_limit`` characters (``data.max_prompt_tokens``
x 32) before it is rendered and tokenized, so a 10 MB prompt costs a few kilobytes of tokenizer
work, not gigabytes; ``data.on_long_prompt: refuse`` refuses it instead, and refuses a prompt
whose tokens pass ``data.max_prompt_tokens``. A batch tokenizes each distinct prompt once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from relax.contracts import LongPromptPolicy, cut_prompt

#: A chat template file larger than this is not a template.
MAX_TEMPLATE_BYTES = 1024 * 1024


class PromptEncoder:
    """Renders and tokenizes text prompts for one tokenizer and one ``data.chat_template`` value
    (``auto``, ``none`` or a template file's absolute path)."""

    def __init__(self, tokenizer: Any, chat_template: str, max_prompt_tokens: int,
                 on_long_prompt: LongPromptPolicy = "truncate") -> None:
        self.tokenizer = tokenizer
        self.max_prompt_tokens = max_prompt_tokens
        self.on_long_prompt = on_long_prompt
        self.template: str | None = None
        """The Jinja template rendered through, or None to tokenize raw."""
        self.source = "the tokenizer's own, data.chat_template: auto" if chat_template == "auto" else chat_template
        """Where the template comes from, for messages."""
        if chat_template == "auto":
            self.template = getattr(tokenizer, "chat_template", None) or None
        elif chat_template != "none":
            path = Path(chat_template)
            try:
                self.template = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise ValueError(f"data.chat_template {path} cannot be read ({exc}); give a UTF-8 Jinja "
                                 "file, or auto / none") from None

    def render(self, prompt: str) -> str | None:
        """The prompt as one user message through the template, with the generation prompt; None
        when prompts are tokenized raw."""
        if self.template is None:
            return None
        from relax.chat_templates import TemplateBoundError, render_chat

        source = self.tokenizer.get_chat_template(self.template) if hasattr(self.tokenizer, "get_chat_template") \
            else self.template
        try:  # within relax.chat_templates' bounds of nesting, output size and time
            return render_chat(source, [{"role": "user", "content": prompt}], self.tokenizer,
                               add_generation_prompt=True)
        except TemplateBoundError as exc:
            raise ValueError(f"the chat template ({self.source}) is refused while rendering a prompt: {exc}; "
                             "use a template that renders a prompt in well under a second (docs/security.md)") from None

    def __call__(self, prompt: str) -> list[int]:
        """Token ids of a prompt, cut from the left to ``data.max_prompt_tokens``. A rendered prompt
        is tokenized without the tokenizer's special tokens (the template writes its own), as
        ``apply_chat_template(..., tokenize=True)`` does."""
        return self.encode_all([prompt])[0]

    def encode_all(self, prompts: list[str]) -> list[list[int]]:
        """``self(prompt)`` of every prompt, tokenized in one batch call (a step's prompts in one
        pass through the tokenizer instead of one call each); a prompt drawn more than once in the
        batch is tokenized once."""
        if not prompts:
            return []
        distinct = list(dict.fromkeys(prompts))
        texts = [cut_prompt(p, self.max_prompt_tokens, self.on_long_prompt) for p in distinct]
        if self.template is None:
            encoded = self.tokenizer(texts, add_special_tokens=True)["input_ids"]
        else:
            encoded = self.tokenizer([self.render(t) for t in texts], add_special_tokens=False)["input_ids"]
        by_prompt: dict[str, list[int]] = {}
        for prompt, ids in zip(distinct, encoded):
            if not ids:
                raise ValueError(f"prompt {prompt[:200]!r} encodes to no tokens; every prompt needs at least one")
            if len(ids) > self.max_prompt_tokens and self.on_long_prompt == "refuse":
                raise ValueError(f"prompt {prompt[:60]!r}... encodes to {len(ids)} tokens, more than "
                                 f"data.max_prompt_tokens={self.max_prompt_tokens} (data.on_long_prompt: refuse); "
                                 "shorten it, raise data.max_prompt_tokens, or set data.on_long_prompt: truncate")
            by_prompt[prompt] = list(ids[-self.max_prompt_tokens:])
        return [list(by_prompt[p]) for p in prompts]
