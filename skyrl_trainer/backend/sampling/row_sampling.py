"""Per-row token sampling and stop-string checks for the PyTorch sampling engine.

Every row samples with its own settings (temperature, top-k, top-p) in one vectorised pass over the
batch's logits. Randomness is one uniform number per row per step from the row's own generator,
turned into a token by inverse-CDF sampling over the (filtered, tempered) distribution; a seeded
row's generator depends only on (seed, sample index), so a seeded request draws the same numbers
whatever else shares its batch. Log-probs are those of the raw model distribution (float32
log-softmax of the logits, before temperature and filtering), like vLLM's default.

Same numbers give the same tokens only if the logits are the same. In float32 a seeded request's
tokens are identical alone or batched (logits differ by ~1e-6). In bfloat16 the logits themselves
change with the batch's shape (matmul blocking; measured on SmolLM2: mean |d logprob| 0.03, max
0.24, the size of the bf16-vs-fp32 gap), so a seeded request batched differently keeps the same
tokens only for its first few (0-30 measured); with the same batch it repeats exactly.
"""

from __future__ import annotations

import os
import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from skyrl_trainer.backend.sampling.engine import GenerationParams

# u <= 1 - 2**-23 keeps u * total strictly below total in float32, so the inverse-CDF search never
# runs past the last token with non-zero probability.
_MAX_UNIFORM = 1.0 - 2.0**-23


def row_rng(seed: int | None, sample_index: int) -> random.Random:
    """The random stream of one row: fixed by (seed, sample index), or fresh when unseeded."""
    if seed is None:
        return random.Random(int.from_bytes(os.urandom(16), "little"))
    return random.Random(f"skyrl-sample:{seed}:{sample_index}")  # str seeds hash stably (sha512)


@dataclass
class SamplingSettings:
    """The sampling settings of a list of rows, as tensors."""

    temperature: torch.Tensor  # [n] float32; rows with 0 are greedy and use 1 here
    greedy: torch.Tensor  # [n] bool
    top_k: torch.Tensor  # [n] long; vocab size where top-k is off
    top_p: torch.Tensor  # [n] float32
    all_greedy: bool
    any_greedy: bool
    all_plain: bool  # every row samples at temperature 1 without top-k/top-p (or is greedy)
    filter_rows: torch.Tensor | None  # rows needing top-k/top-p filtering, or None

    @classmethod
    def build(
        cls, params: Sequence[GenerationParams], vocab_size: int, device: torch.device
    ) -> SamplingSettings:
        temps = [p.temperature for p in params]
        greedy = [t == 0 for t in temps]
        top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        filtered = [
            i
            for i, p in enumerate(params)
            if not greedy[i] and (top_k[i] < vocab_size or p.top_p < 1.0)
        ]
        return cls(
            temperature=torch.tensor([t if t > 0 else 1.0 for t in temps], device=device),
            greedy=torch.tensor(greedy, device=device),
            top_k=torch.tensor(top_k, dtype=torch.long, device=device),
            top_p=torch.tensor([p.top_p for p in params], device=device),
            all_greedy=all(greedy),
            any_greedy=any(greedy),
            all_plain=not filtered and all(t in (0, 1) for t in temps),
            filter_rows=torch.tensor(filtered, device=device) if filtered else None,
        )


def sample_tokens(
    logits: torch.Tensor, settings: SamplingSettings, uniforms: Sequence[float]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of `logits` ([n, vocab], float32).

    Returns (tokens [n] long, log-probs [n] float32 of those tokens under the raw distribution).
    `uniforms` are the rows' random numbers in [0, 1) (ignored for greedy rows).
    """
    peak = logits.max(dim=-1, keepdim=True).values
    if settings.all_greedy:
        tokens = logits.argmax(dim=-1)
        log_norm = peak.squeeze(1) + (logits - peak).exp_().sum(dim=-1).log_()
    else:
        weights = (logits - peak).exp_()  # the raw distribution, unnormalised
        log_norm = peak.squeeze(1) + weights.sum(dim=-1).log_()
        if not settings.all_plain:  # temperature != 1, or top-k / top-p somewhere
            scaled = logits / settings.temperature[:, None]
            if settings.filter_rows is not None:
                rows = settings.filter_rows
                scaled[rows] = _top_k_top_p(
                    scaled[rows], settings.top_k[rows], settings.top_p[rows]
                )
            weights = torch.sub(scaled, scaled.max(dim=-1, keepdim=True).values, out=scaled).exp_()
        cdf = weights.cumsum_(dim=-1)  # any token order is a valid inverse CDF
        u = torch.tensor([min(x, _MAX_UNIFORM) for x in uniforms], device=logits.device)
        target = (u * cdf[:, -1])[:, None]
        tokens = torch.searchsorted(cdf, target, right=True).squeeze(1)
        tokens.clamp_(max=logits.shape[-1] - 1)
        if settings.any_greedy:
            tokens = torch.where(settings.greedy, logits.argmax(dim=-1), tokens)
    logprobs = logits.gather(1, tokens[:, None]).squeeze(1) - log_norm
    return tokens, logprobs


def _top_k_top_p(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf the logits outside each row's top-k, then outside its top-p nucleus (the
    smallest set of most likely tokens whose probability reaches top_p; never empty)."""
    values, order = scaled.sort(dim=-1, descending=True)
    ranks = torch.arange(scaled.shape[-1], device=scaled.device)
    remove = ranks[None, :] >= top_k[:, None]
    values = values.masked_fill(remove, float("-inf"))
    probs = values.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    remove |= mass_before >= top_p[:, None]
    remove[:, 0] = False
    values = values.masked_fill(remove, float("-inf"))
    return torch.empty_like(scaled).scatter_(1, order, values)


class StopStrings:
    """Detects stop strings in a row's generated text, decoding only its tail.

    A match new at this step must end in the text of the last token, so decoding the last
    `window` tokens (enough for the longest stop string even if several tokens make one
    character) finds it; a hit there is confirmed on the full text, since a window cut through
    a multi-token character can differ from the full decode at its start.
    """

    def __init__(self, tokenizer, stop_strings: Sequence[str]):
        self.tokenizer = tokenizer
        self.stop_strings = tuple(s for s in stop_strings if s)
        self.window = 4 * max((len(s) for s in self.stop_strings), default=0) + 4

    def __bool__(self) -> bool:
        return bool(self.stop_strings)

    def hit(self, tokens: Sequence[int]) -> bool:
        if not self._found(tokens[-self.window :]):
            return False
        return len(tokens) <= self.window or self._found(tokens)

    def _found(self, tokens: Sequence[int]) -> bool:
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        return any(s in text for s in self.stop_strings)
