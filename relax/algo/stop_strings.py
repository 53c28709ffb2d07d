"""Stop strings (``roles.rollout.sampling.stop``): where a response that holds one ends, for the
rollout backends and for partial rollouts (which continue a response in pieces).

A response ends right after the token that completes the first stop string in its decoded text.
What is kept is what the model's own stop token gets: the tokens up to and including that one are
the response (trained on, with their behaviour log-probs, like a stop token), the tokens a backend
generated after it are cut, the generation is ``finished``, and its text ends before the stop
string (as it ends before the stop token), so rewards read the answer without it. The token that
completes a stop string may carry characters after it; they are dropped from the text with the
stop string, while the token stays in the response: a response's tokens are always whole tokens
the model chose.

Detection decodes a window of the last tokens of each live row after every token (the stop
strings' longest length in characters, times four for characters split over byte tokens, plus
two), so its cost does not grow with the response. A stop string is only looked for in what the
response generated, never in the prompt. Plain Python: it needs only the tokenizer's ``decode``
and ``batch_decode``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class StopStrings:
    """Finds where a response's decoded text first completes one of ``stops``."""

    def __init__(self, tokenizer: Any, stops: Sequence[str]) -> None:
        if any(not s for s in stops):
            raise ValueError("an empty stop string would end every response at once; remove it from sampling.stop")
        self.tokenizer = tokenizer
        self.stops = tuple(stops)
        self.window = 4 * max((len(s) for s in self.stops), default=0) + 2
        """Tokens of a row's tail decoded after each new token."""

    def __bool__(self) -> bool:
        return bool(self.stops)

    def _text(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def ended(self, tails: Sequence[Sequence[int]]) -> list[bool]:
        """Per row (its last ``window`` response tokens, the newest last), whether its text holds a
        stop string; asked after every token, the first True is where one completes."""
        texts = self.tokenizer.batch_decode([list(t) for t in tails], skip_special_tokens=True)
        return [any(s in text for s in self.stops) for text in texts]

    def end(self, response: Sequence[int], start: int = 0) -> int | None:
        """How many tokens of ``response`` to keep: up to the token that completes its first stop
        string (looked for from token ``start`` on: the tokens before were checked already, by an
        earlier call of a generation continued in pieces), or None when it holds none."""
        if not self.stops:
            return None
        for n in range(max(start, 0) + 1, len(response) + 1):
            if self.ended([response[max(0, n - self.window):n]])[0]:
                return n
        return None

    def text(self, response: Sequence[int]) -> str:
        """The decoded text of a response, ending before its first stop string (the whole text when
        it holds none)."""
        text = self._text(response)
        cuts = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        return text[:min(cuts)] if cuts else text


def response_text(tokenizer: Any, response: Sequence[int], finished: bool, stop_ids: Sequence[int],
                  stops: StopStrings | None) -> str:
    """A generation's text: decoded without its stop token when it ended on one, and ending before
    its first stop string (``StopStrings.text``)."""
    ids = list(response)
    if finished and ids and ids[-1] in set(stop_ids):
        ids = ids[:-1]
    if stops:
        return stops.text(ids)
    return tokenizer.decode(ids, skip_special_tokens=True)
