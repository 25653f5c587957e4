"""Whether a request ends with the token it was just given, and why: "stop", "length" or not yet.

One function, called by the core after every appended token (vLLM's `check_stop` in
`v1/core/sched/utils.py`). The order of the checks is the rule:

1. a grammar that has completed ends the request ("stop");
2. from `min_tokens` generated tokens on: a stop token id, an EOS id (unless
   `ignore_eos`) or a stop string in the decoded tail ("stop");
3. `max_tokens` generated, or the model's context full ("length").
"""

from __future__ import annotations

from collections.abc import Collection

from cbrun.engine.detokenize import Detokenizer
from cbrun.engine.request import Request


def check_stop(
    request: Request, token: int, eos_token_ids: Collection[int], max_context: int, detok: Detokenizer
) -> str | None:
    """The finish reason that `token`, just appended to `request`, gives it ("stop", "length"), or None."""
    params = request.sampling
    if request.grammar is not None and request.grammar.complete:
        return "stop"
    if request.num_generated >= params.min_tokens and _stops(request, token, eos_token_ids, detok):
        return "stop"
    if request.num_generated >= params.max_tokens or request.num_tokens >= max_context:
        return "length"
    return None


def _stops(request: Request, token: int, eos_token_ids: Collection[int], detok: Detokenizer) -> bool:
    """Whether the token, or the text it completes, is one of the request's stops."""
    params = request.sampling
    if token in params.stop_token_ids:
        return True
    if not params.ignore_eos and token in eos_token_ids:
        return True
    return detok.stop_string_hit(request)
