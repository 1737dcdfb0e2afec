"""The forward passes of the PyTorch sampling engine: prefill, decode steps, sampling.

A `RowGroup` is the running rows of one adapter with their `SlotKVCache` (slot i = rows[i]).
`BatchRunner.prefill` runs the prompts of newly admitted requests (right-padded, each prompt once
however many samples it has), scores prompts when asked, and samples every new row's first token;
`BatchRunner.decode` advances every row of a group by one token in one forward. Rows that finish
leave the group (and the cache) at once; a request completes when its last row finishes.
Only the engine loop thread calls these.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from skyrl_trainer.backend.sampling.kv_cache import SlotKVCache
from skyrl_trainer.backend.sampling.prefix_cache import PrefixMatch, PrefixStore
from skyrl_trainer.backend.sampling.row_sampling import SamplingSettings, sample_tokens
from skyrl_trainer.backend.sampling.torch_lora import AdapterSet
from skyrl_trainer.backend.sampling.torch_requests import Pending, Row

logger = logging.getLogger(__name__)

PROMPT_LOGPROB_CHUNK = 512  # prompt positions per lm_head call when scoring prompts


@dataclass
class EngineStats:
    """Counters of the engine's work (read them from any thread; only the loop writes them)."""

    requests_submitted: int = 0
    requests_completed: int = 0
    requests_failed: int = 0
    prefill_forwards: int = 0
    decode_forwards: int = 0
    # Prompt tokens of admitted requests, prefilled or taken from the prefix store.
    prompt_tokens: int = 0
    prefix_hit_tokens: int = 0  # of those, tokens whose KV came from the prefix store
    prefix_hit_requests: int = 0  # requests that started from a stored prefix
    generated_tokens: int = 0
    max_rows: int = 0  # most rows in one decode forward

    @property
    def forward_batches(self) -> int:
        return self.prefill_forwards + self.decode_forwards

    @property
    def prefilled_tokens(self) -> int:
        """Prompt tokens that went through a prefill forward."""
        return self.prompt_tokens - self.prefix_hit_tokens


@dataclass
class RowGroup:
    """The running rows of one adapter (None: base weights); slot i of the cache holds rows[i]."""

    adapter: str | None
    cache: SlotKVCache
    rows: list[Row] = field(default_factory=list)
    settings: SamplingSettings | None = None


def complete(pending: Pending, stats: EngineStats) -> None:
    if not pending.future.done():
        stats.requests_completed += 1
        pending.future.set_result(pending.result())


def fail(pending: Pending, exc: BaseException, stats: EngineStats) -> None:
    if pending.future.done():
        return
    stats.requests_failed += 1
    if pending.future.running() or pending.future.set_running_or_notify_cancel():
        pending.future.set_exception(exc)


class BatchRunner:
    """Runs groups' forwards on the engine's model (see the module docstring)."""

    def __init__(
        self,
        adapters: AdapterSet,
        *,
        dtype: torch.dtype,
        device: torch.device,
        max_model_len: int,
        stats: EngineStats,
        prefix_store: PrefixStore | None = None,
    ):
        self.adapters = adapters
        self.prefix_store = prefix_store
        self.dtype, self.device, self.max_model_len = dtype, device, max_model_len
        self.stats = stats
        config = adapters.model.config.get_text_config()
        self.vocab_size = adapters.model.get_output_embeddings().weight.shape[0]
        self.cache_dims = (
            config.num_hidden_layers,
            getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
        )
        self.softcap = getattr(config, "final_logit_softcapping", None)

    @property
    def model(self) -> torch.nn.Module:
        return self.adapters.model

    def new_group(self, adapter: str | None) -> RowGroup:
        layers, heads, head_dim = self.cache_dims
        cache = SlotKVCache(
            layers,
            heads,
            head_dim,
            dtype=self.dtype,
            device=self.device,
            max_len=self.max_model_len,
        )
        return RowGroup(adapter, cache)

    def _forward(self, group: RowGroup, ids: torch.Tensor, position_ids, mask) -> torch.Tensor:
        self.adapters.activate(group.adapter)
        try:
            out = self.model.get_decoder()(
                input_ids=ids,
                attention_mask=mask,
                position_ids=position_ids,
                past_key_values=group.cache,
                use_cache=True,
            )
        except BaseException:
            group.cache.abort()
            raise
        group.cache.commit()
        return out.last_hidden_state

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.model.get_output_embeddings()(hidden).float()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def prefill(
        self, group: RowGroup, chunk: list[Pending], matches: list[PrefixMatch] | None = None
    ) -> None:
        """Prefill the prompts of `chunk` and sample their rows' first tokens. With `matches`
        (one per request, from the prefix store), each prompt's first `matches[i].length` tokens
        take their KV from the store and only the rest is computed (no prompt scoring then)."""
        started = time.perf_counter()
        skip = [m.length for m in matches] if matches else [0] * len(chunk)
        lens = [p.prompt_len - k for p, k in zip(chunk, skip)]  # tokens to compute
        width = max(lens)
        ids = torch.zeros((len(chunk), width), dtype=torch.long)
        for i, pending in enumerate(chunk):
            ids[i, : lens[i]] = torch.tensor(pending.request.prompt_ids[skip[i] :])
        ids = ids.to(self.device)
        src = [i for i, p in enumerate(chunk) for _ in range(p.num_rows)]
        src_t = None
        if src != list(range(len(chunk))):
            src_t = torch.tensor(src, dtype=torch.long, device=self.device)
        prompt_lens = torch.tensor(lens, device=self.device)
        if matches:
            assert not any(p.wants_prompt_logprobs for p in chunk)
            position_ids, mask = group.cache.prepare_extend(
                [m.entry.kv for m in matches],
                torch.tensor(skip, device=self.device),
                prompt_lens,
                src_t,
            )
        else:
            position_ids, mask = group.cache.prepare_prefill(prompt_lens, src_t)
        hidden = self._forward(group, ids, position_ids, mask)
        self.stats.prefill_forwards += 1
        self.stats.prompt_tokens += sum(lens) + sum(skip)
        self.stats.prefix_hit_tokens += sum(skip)
        self.stats.prefix_hit_requests += sum(1 for k in skip if k)
        new_rows = [Row(p, k) for p in chunk for k in range(p.num_rows)]
        if matches:
            for i, row in enumerate(new_rows):
                row.prefix = matches[src[i]].entry
        first = len(group.rows)
        group.rows.extend(new_rows)
        group.settings = None
        for i, pending in enumerate(chunk):
            if pending.wants_prompt_logprobs:
                try:
                    self._score_prompt(pending, hidden[i, : lens[i] - 1], ids[i, 1 : lens[i]])
                except Exception as exc:  # fails this request only; its rows are dropped
                    logger.exception("scoring the prompt of a request failed")
                    fail(pending, exc, self.stats)
            if pending.num_rows == 0:  # max_tokens == 0: nothing to generate
                pending.finish_empty()
                complete(pending, self.stats)
        if new_rows:
            last = hidden[torch.arange(len(chunk), device=self.device), prompt_lens - 1]
            logits = self._logits(last)
            self._advance(group, logits if src_t is None else logits[src_t], first)
        logger.debug(
            "prefill: %d requests, %d rows, %d prompt tokens (%d padded, %d from stored KV) "
            "in %.3f s",
            len(chunk),
            len(new_rows),
            sum(lens),
            len(chunk) * width,
            sum(skip),
            time.perf_counter() - started,
        )

    def _keep_prefixes(self, group: RowGroup, done: list[int]) -> None:
        """Copy the KV of finished rows `done` (slots of `group`) into the prefix store: the
        prompt and every generated token but the last (not computed yet)."""
        store = self.prefix_store
        lens = group.cache.lens[done].tolist()
        for slot, length in zip(done, lens):
            row = group.rows[slot]
            if row.stop_reason is None or length < 1:
                continue  # cancelled or failed: nothing worth keeping
            tokens = tuple(row.pending.request.prompt_ids) + tuple(row.tokens[:-1])
            if len(tokens) != length:  # never expected: keep nothing rather than a wrong KV
                logger.warning("row KV length %d != its %d tokens: not kept", length, len(tokens))
                continue
            if length >= self.max_model_len - 1:
                continue  # no longer prompt can extend it
            if row.prefix is not None:
                store.discard(row.prefix)  # superseded by this row's longer entry
            store.put(group.adapter, tokens, group.cache.row_kv(slot, length))

    def _score_prompt(self, pending: Pending, hidden: torch.Tensor, targets: torch.Tensor) -> None:
        """What the request asks about its prompt, from the prefill's states (row i of `hidden`
        predicts prompt position i + 1, whose token is `targets[i]`):
        - log p(prompt[i] | prompt[:i]) and the top-k, for i >= 1, or only for the last
          `prompt_logprobs_last_n` positions (earlier ones None);
        - `target_prompt_logprobs`: the log-probs of the named ids (0.0 where -1);
        - `prompt_alt_tokens_k` draws per position at the request's temperature, with their
          raw (temperature 1) log-probs.
        Rows no output needs are not projected onto the vocabulary."""
        request = pending.request
        n_rows = hidden.shape[0]
        k = request.topk_prompt_logprobs
        wants_lp = request.prompt_logprobs or k > 0
        first_lp_row = request.first_scored_position() - 1 if wants_lp else n_rows
        ids = request.target_prompt_logprobs
        first_target_row, ids_t, target_out = n_rows, None, None
        if ids is not None:
            named = np.flatnonzero((ids >= 0).any(axis=1))
            first_target_row = int(named[0]) if named.size else n_rows
            ids_t = torch.from_numpy(np.maximum(ids, 0).astype(np.int64)).to(self.device)
            target_out = np.zeros(ids.shape, dtype=np.float32)
        alt_k = request.prompt_alt_tokens_k
        alt_tokens, alt_logprobs = [], []
        generator = self._alt_generator(request.params.seed) if alt_k else None
        start = 0 if alt_k else min(first_lp_row, first_target_row)
        logprobs: list[float | None] = [None] * (first_lp_row + 1)
        topk: list[list[tuple[int, float]] | None] = [None] * (first_lp_row + 1)
        for lo in range(start, n_rows, PROMPT_LOGPROB_CHUNK):
            hi = min(lo + PROMPT_LOGPROB_CHUNK, n_rows)
            logits = self._logits(hidden[lo:hi])
            logp = torch.log_softmax(logits, dim=-1)
            if wants_lp and hi > first_lp_row:
                a = max(lo, first_lp_row) - lo
                part = logp[a:]
                logprobs.extend(part.gather(1, targets[lo + a : hi, None]).squeeze(1).tolist())
                if k:
                    values, indices = part.topk(k, dim=-1)
                    topk.extend(
                        [list(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())]
                    )
            if ids_t is not None and hi > first_target_row:
                target_out[lo:hi] = logp.gather(1, ids_t[lo:hi]).cpu().numpy()
            if alt_k:
                draws = _draw(logits, request.params.temperature, alt_k, generator)
                alt_tokens.append(draws.cpu())
                alt_logprobs.append(logp.gather(1, draws).cpu())
        pending.prompt_logprobs = logprobs if request.prompt_logprobs else None
        pending.topk_prompt_logprobs = topk if k else None
        if target_out is not None:
            target_out[ids < 0] = 0.0
            pending.target_prompt_logprobs = target_out
        if alt_k:
            empty = torch.zeros((0, alt_k))
            pending.prompt_alt_tokens = (
                torch.cat(alt_tokens or [empty.long()]).numpy().astype(np.int64),
                torch.cat(alt_logprobs or [empty.float()]).numpy().astype(np.float32),
            )

    def _alt_generator(self, seed: int | None) -> torch.Generator:
        """The random stream of a request's alternative draws: fixed by its seed, else fresh."""
        generator = torch.Generator(device=self.device)
        if seed is None:
            generator.seed()
        else:
            digest = hashlib.sha256(f"skyrl-prompt-alt:{seed}".encode()).digest()
            generator.manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
        return generator

    def decode(self, group: RowGroup) -> None:
        cache = group.cache
        ids = torch.tensor([row.tokens[-1] for row in group.rows], device=self.device)
        position_ids, mask = cache.prepare_decode()
        hidden = self._forward(group, ids[:, None], position_ids, mask)
        self.stats.decode_forwards += 1
        self.stats.max_rows = max(self.stats.max_rows, len(group.rows))
        self._advance(group, self._logits(hidden[:, -1]), 0)

    def _advance(self, group: RowGroup, logits: torch.Tensor, first: int) -> None:
        """Sample the next token of rows[first:] from `logits`, and retire finished rows."""
        rows = group.rows[first:]
        if first == 0:
            if group.settings is None:
                group.settings = SamplingSettings.build(
                    [r.params for r in rows], self.vocab_size, self.device
                )
            settings = group.settings
        else:
            settings = SamplingSettings.build(
                [r.params for r in rows], self.vocab_size, self.device
            )
        topk = _topk_rows(logits, [r.pending.topk_sample for r in rows])
        tokens, logprobs = sample_tokens(logits, settings, [r.rng.random() for r in rows])
        self.stats.generated_tokens += len(rows)
        done = []
        for i, (row, token, logprob, cell) in enumerate(
            zip(rows, tokens.tolist(), logprobs.tolist(), topk), start=first
        ):
            if row.append(token, logprob, cell) or row.pending.future.done():
                done.append(i)
        if done:
            if self.prefix_store is not None:  # before the results: a next turn may follow
                self._keep_prefixes(group, done)
            for i in done:
                row = group.rows[i]
                if row.pending.record(row):
                    complete(row.pending, self.stats)
            order = group.cache.remove_rows(done)
            group.rows = [group.rows[j] for j in order]
            group.settings = None


def _topk_rows(logits: torch.Tensor, ks: list[int]) -> list[list[tuple[int, float]] | None]:
    """Each row's top-`ks[i]` (token, raw log-prob), most likely first; None where k is 0."""
    k_max = max(ks, default=0)
    if k_max == 0:
        return [None] * len(ks)
    values, indices = torch.log_softmax(logits, dim=-1).topk(k_max, dim=-1)
    return [
        list(zip(i[:k], v[:k])) if k else None
        for i, v, k in zip(indices.tolist(), values.tolist(), ks)
    ]


def _draw(
    logits: torch.Tensor, temperature: float, k: int, generator: torch.Generator
) -> torch.Tensor:
    """`k` independent draws (with replacement) per row from softmax(logits / temperature);
    temperature 0: the argmax, k times."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True).expand(-1, k).contiguous()
    probs = torch.softmax(logits / temperature, dim=-1)
    return torch.multinomial(probs, k, replacement=True, generator=generator)
