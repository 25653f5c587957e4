"""sampling.c's entry points: the sampler's, scoring's and structured outputs' compiled calls on a CPU.

The methods of `SamplingCalls` are what cbrun/engine/sample/kernels.py's
`SamplingKernels` protocol asks of a backend; CpuKernels takes them in.
"""

from __future__ import annotations

import ctypes

import torch

from cbrun.engine.backends.cpu.kernels.abi import KernelError, SampleParams, ptr, threads


class SamplingCalls:
    """Per logits row: the draw and its normalizer, top-p's cut, and the token masks (one parallel pass each)."""

    _lib: ctypes.CDLL

    def sample(
        self, logits: torch.Tensor, inv_temp: torch.Tensor, uniform: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row of fp32 `logits` [N, V]: (token [N] int64, logsumexp(logits * inv_temp) [N] fp32).

        Rows with a negative `uniform` (float64) take the argmax; the others
        draw from softmax(logits * inv_temp) by inverting the CDF at their number.
        """
        rows, vocab = logits.shape
        count = threads()
        token = torch.empty(rows, dtype=torch.int64)
        normalizer = torch.empty(rows, dtype=torch.float32)
        scratch = torch.empty(count * vocab, dtype=torch.float32)
        params = SampleParams(
            logits=ptr(logits),
            inv_temp=ptr(inv_temp),
            uniform=ptr(uniform),
            token=ptr(token),
            normalizer=ptr(normalizer),
            scratch=ptr(scratch),
            N=rows,
            V=vocab,
            row_stride=logits.stride(0),
            threads=count,
        )
        self._lib.sample_rows_f32(ctypes.byref(params))
        return token, normalizer

    def apply_token_masks(self, logits: torch.Tensor, rows: torch.Tensor, masks: torch.Tensor) -> None:
        """In place: logits [N, V] fp32 (unit stride along V) get -inf at every token a row's packed mask
        (masks [r, W] int32, bit t % 32 of word t / 32) disallows, in rows [r] int64 only."""
        if (
            logits.dtype != torch.float32
            or logits.stride(1) != 1
            or masks.dtype != torch.int32
            or not masks.is_contiguous()
            or rows.dtype != torch.int64
            or masks.shape[0] != rows.numel()
        ):
            raise KernelError("apply_token_masks: fp32 logits with unit stride, int32 masks [r, W], int64 rows [r]")
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= logits.shape[0]):
            raise KernelError("apply_token_masks: a row index outside the logits")
        self._lib.apply_token_masks(
            ptr(logits),
            logits.stride(0),
            ptr(rows),
            ptr(masks),
            rows.numel(),
            masks.shape[1],
            logits.shape[1],
            threads(),
        )

    def top_p_counts(self, sorted_logprobs: torch.Tensor, ps: torch.Tensor) -> torch.Tensor:
        """Per row of fp32 log-probs sorted in descending order [n, V] (unit stride along V), and top_p `ps` [n]
        fp32: how many leading tokens top-p keeps [n] int64 (sampling.c: the same on every CPU)."""
        rows, vocab = sorted_logprobs.shape
        if sorted_logprobs.dtype != torch.float32 or sorted_logprobs.stride(1) != 1 or ps.shape != (rows,):
            raise KernelError("top_p_counts: fp32 log-probs [n, V] with unit stride and one fp32 p per row")
        ps = ps.to(torch.float32).contiguous()
        count = threads()
        out = torch.empty(rows, dtype=torch.int64)
        scratch = torch.empty(count * (vocab + 8), dtype=torch.float32)
        self._lib.top_p_counts_f32(
            ptr(sorted_logprobs), sorted_logprobs.stride(0), ptr(ps), ptr(out), rows, vocab, ptr(scratch), count
        )
        return out
