"""Generated token ids -> text: final text, stop-string detection, stream deltas.

Stop strings are detected on the decoded tail of the sequence only (the last
few tokens, enough to contain the longest stop string), so the per-step cost
does not grow with the output length; the full text is decoded once, at the
end, and cut at the first stop string.

With `min_tokens`, a stop string counts only where it ends in the text of
the `min_tokens`-th token or later (as vLLM checks only the text each new
token adds, from that token on); the engine asks only from then on.
"""

from __future__ import annotations

from cbrun.engine.model_spec import Tokenizer
from cbrun.engine.request import Request

_TAIL_SLACK = 8  # extra tokens decoded beyond the longest stop string


class Detokenizer:
    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer

    def decode(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def stop_string_hit(self, request: Request) -> bool:
        """True if the generated text now contains one of the request's stop strings."""
        stops = request.sampling.stop
        if not stops:
            return False
        longest = max(len(s) for s in stops)
        ids = request.generated_token_ids
        start = max(0, len(ids) - (longest + _TAIL_SLACK))
        return self._first_stop(ids[start:], stops, request.sampling.min_tokens - 1 - start) >= 0

    def final_text(self, request: Request) -> str:
        """The whole completion, cut before the first stop string if one occurred."""
        ids = request.generated_token_ids
        text = self.decode(ids)
        cut = self._first_stop(ids, request.sampling.stop, request.sampling.min_tokens - 1, text)
        return text[:cut] if cut >= 0 else text

    def _first_stop(self, ids: list[int], stops: tuple[str, ...], held: int, text: str | None = None) -> int:
        """Where the first stop string in the text of `ids` starts (-1: none), counting only
        those that end past the text of the first `held` ids (tokens before min_tokens')."""
        text = self.decode(ids) if text is None else text
        free = len(self.decode(ids[:held])) if held > 0 else 0  # characters no stop string may end in
        found = (text.find(s, max(0, free - len(s) + 1)) for s in stops)
        return min((i for i in found if i >= 0), default=-1)

    def stream_delta(self, request: Request) -> str:
        """New text since the last call for this request (held back while bytes are incomplete)."""
        text = self.decode(request.generated_token_ids)
        if text.endswith("\ufffd"):
            return ""
        if not text.startswith(request.stream_text):
            return ""  # a re-tokenized boundary changed earlier text; send the rest at the end
        delta = text[len(request.stream_text) :]
        request.stream_text = text
        return delta
