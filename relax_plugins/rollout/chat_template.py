"""A text prompt's token ids as the rollout generates from them (``data.chat_template``).

The rollout is the one place a prompt is rendered and tokenized: its ids travel on the bus with the
response (``relax.runtime.rows``), and every trainer role (actor, reference, actor_fwd, critic)
reads those ids, never the text, so the trainer trains on exactly the tokens the rollout sampled
after. ``hf`` and ``vllm`` both encode through ``PromptEncoder``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: A chat template file larger than this is not a template.
MAX_TEMPLATE_BYTES = 1024 * 1024


class PromptEncoder:
    """Renders and tokenizes text prompts for one tokenizer and one ``data.chat_template`` value
    (``auto``, ``none`` or a template file's absolute path)."""

    def __init__(self, tokenizer: Any, chat_template: str, max_prompt_tokens: int) -> None:
        self.tokenizer = tokenizer
        self.max_prompt_tokens = max_prompt_tokens
        self.template: str | None = None
        """The Jinja template rendered through, or None to tokenize raw."""
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
        return self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], chat_template=self.template,
                                                  tokenize=False, add_generation_prompt=True)

    def __call__(self, prompt: str) -> list[int]:
        """Token ids of a prompt, cut from the left to ``data.max_prompt_tokens``. A rendered prompt
        is tokenized without the tokenizer's special tokens (the template writes its own), as
        ``apply_chat_template(..., tokenize=True)`` does."""
        return self.encode_all([prompt])[0]

    def encode_all(self, prompts: list[str]) -> list[list[int]]:
        """``self(prompt)`` of every prompt, tokenized in one batch call (a step's prompts in one
        pass through the tokenizer instead of one call each)."""
        if not prompts:
            return []
        if self.template is None:
            encoded = self.tokenizer(list(prompts), add_special_tokens=True)["input_ids"]
        else:
            encoded = self.tokenizer([self.render(p) for p in prompts], add_special_tokens=False)["input_ids"]
        for prompt, ids in zip(prompts, encoded):
            if not ids:
                raise ValueError(f"prompt {prompt!r} encodes to no tokens; every prompt needs at least one")
        return [list(ids[-self.max_prompt_tokens:]) for ids in encoded]
