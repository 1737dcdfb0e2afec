"""A bounded store of finished rows' KV, so later prompts that extend them skip that prefill.

Multi-turn rollouts send, at turn k+1, exactly the previous request's prompt plus its sampled
tokens plus a few new observation tokens. When a row of the PyTorch engine finishes, its keys and
values (prompt + generated tokens, except the last sampled token, which has none yet) are copied
out of the slot cache into one compact tensor `[layers, 2, kv_heads, length, head_dim]` and kept
here under (adapter, token ids). A new request whose prompt starts with a stored sequence (the
longest one) starts its rows from that KV and prefills only the rest of its prompt.

- Entries are copies: they pin nothing in the slot cache (slots still move freely as rows leave).
- Bounded in tokens (`max_tokens`), least recently used first out; an entry is "used" when it is
  stored or matched. A row that started from an entry supersedes it when it finishes (its own
  entry extends it), so that entry is dropped to leave room for the longer one.
- Keys include the adapter (None: the base weights); the engine drops every entry computed with
  weights that change (`clear` on a weight update, `drop_adapter` when an adapter is replaced or
  removed), so a stale KV is never used.
- A prompt identical to a stored sequence reuses all but its last token (whose logits are needed).

Only the engine loop thread touches a store.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class PrefixEntry:
    adapter: str | None
    tokens: tuple[int, ...]
    kv: torch.Tensor  # [layers, 2, kv_heads, len(tokens), head_dim]

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()


@dataclass
class PrefixMatch:
    entry: PrefixEntry
    length: int  # tokens of the prompt whose KV comes from the entry (< len(prompt))


class PrefixStore:
    """(adapter, token ids) -> KV, at most `max_tokens` tokens in all, LRU; see module docstring."""

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self._entries: OrderedDict[tuple[str | None, tuple[int, ...]], PrefixEntry] = OrderedDict()
        # adapter -> {stored length: number of entries of that length}, to try only those lengths
        self._lengths: dict[str | None, dict[int, int]] = {}
        self.tokens = 0  # tokens stored
        self.nbytes = 0  # bytes of stored KV

    def __len__(self) -> int:
        return len(self._entries)

    def __bool__(self) -> bool:
        return True  # an empty store is still a store (len() says whether it holds anything)

    def lookup(self, adapter: str | None, prompt: Sequence[int]) -> PrefixMatch | None:
        """The longest stored sequence of `adapter` that `prompt` starts with (a stored sequence
        equal to the whole prompt gives all but its last token), or None."""
        lengths = self._lengths.get(adapter)
        if not lengths or len(prompt) < 2:
            return None
        prompt = tuple(prompt)
        for length in sorted((n for n in lengths if n <= len(prompt)), reverse=True):
            entry = self._entries.get((adapter, prompt[:length]))
            if entry is not None:
                self._entries.move_to_end((adapter, entry.tokens))
                return PrefixMatch(entry, min(length, len(prompt) - 1))
        return None

    def put(self, adapter: str | None, tokens: tuple[int, ...], kv: torch.Tensor) -> bool:
        """Keep `kv` (a tensor this store may own) for `tokens`; False when it does not fit."""
        key = (adapter, tokens)
        if key in self._entries:
            self._entries.move_to_end(key)
            return True
        if not tokens or len(tokens) > self.max_tokens:
            return False
        while self.tokens + len(tokens) > self.max_tokens:
            self._pop(next(iter(self._entries)))
        entry = PrefixEntry(adapter, tokens, kv)
        self._entries[key] = entry
        counts = self._lengths.setdefault(adapter, {})
        counts[len(tokens)] = counts.get(len(tokens), 0) + 1
        self.tokens += len(tokens)
        self.nbytes += entry.nbytes
        return True

    def discard(self, entry: PrefixEntry) -> None:
        """Drop `entry` if it is still stored."""
        key = (entry.adapter, entry.tokens)
        if self._entries.get(key) is entry:
            self._pop(key)

    def drop_adapter(self, adapter: str | None) -> None:
        """Forget every entry computed with `adapter` (its weights changed or it is gone)."""
        for key in [k for k in self._entries if k[0] == adapter]:
            self._pop(key)

    def clear(self) -> None:
        """Forget everything (the base weights changed: every adapter's KV depends on them)."""
        self._entries.clear()
        self._lengths.clear()
        self.tokens = self.nbytes = 0

    def _pop(self, key: tuple[str | None, tuple[int, ...]]) -> None:
        entry = self._entries.pop(key)
        counts = self._lengths[entry.adapter]
        counts[len(entry.tokens)] -= 1
        if not counts[len(entry.tokens)]:
            del counts[len(entry.tokens)]
            if not counts:
                del self._lengths[entry.adapter]
        self.tokens -= len(entry.tokens)
        self.nbytes -= entry.nbytes
