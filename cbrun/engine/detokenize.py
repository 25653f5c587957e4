"""Generated token ids -> text: final text, stop-string detection, stream deltas.

Stop strings are detected on the decoded tail of the sequence only (the last
few tokens, enough to contain the longest stop string), so the per-step cost
does not grow with the output length; the full text is decoded once, at the
end, and cut at the first stop string.
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
        tail = self.decode(request.generated_token_ids[-(longest + _TAIL_SLACK) :])
        return any(s in tail for s in stops)

    def final_text(self, request: Request) -> str:
        """The whole completion, cut before the first stop string if one occurred."""
        text = self.decode(request.generated_token_ids)
        cut = min((i for i in (text.find(s) for s in request.sampling.stop) if i >= 0), default=-1)
        return text[:cut] if cut >= 0 else text

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
