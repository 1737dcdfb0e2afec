"""A preallocated KV cache with one slot per generated row, for the PyTorch sampling engine.

All layers' keys and values live in one buffer `[layers, 2, slots, kv_heads, length, head_dim]`:

- rows occupy slots `0 .. num_rows-1`, each with its own length (`lens`), so rows of different
  prompt lengths, and rows that joined the batch at different steps, decode together; a decode
  step writes every row's new key/value at that row's own position (one `index_put_` per layer)
  and attends over `[:num_rows, :, :max_len]`, masking each row's positions `>= its length`;
- a finished row leaves at once: the last rows move into the freed slots (`remove_rows`), so the
  next step computes nothing for it and copies only the moved rows, not the whole cache;
- the buffer grows geometrically when more slots or positions are needed (rare, amortised), instead
  of Hugging Face's DynamicCache, which concatenates on every step (O(T^2) copying).

It is a `transformers` `Cache`: the model's attention layers call `update(key, value, layer_idx)` and
get back the keys/values to attend over. The engine passes the 4-D boolean masks built here
(`True` = attend) as `attention_mask`, which the model uses as they are. Prefill writes a forward
batch of distinct prompts (right-padded) into the slots of all their sample rows (`src`), so
`num_samples` rows of one prompt cost one prompt forward.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class _SlotLayer(CacheLayerMixin):
    """One model layer's view of a SlotKVCache (all state lives in the owner's buffer)."""

    def __init__(self, owner: SlotKVCache, layer_idx: int):
        super().__init__()
        self.owner = owner
        self.layer_idx = layer_idx
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        return self.owner.write(self.layer_idx, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.max_len + query_length, 0

    def get_seq_length(self) -> int:
        return self.owner.max_len

    def get_max_length(self) -> int:
        return -1


class SlotKVCache(Cache):
    """Keys/values of `num_rows` rows, each with its own length; see the module docstring."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
        max_len: int,
    ):
        super().__init__(layers=[_SlotLayer(self, i) for i in range(num_layers)])
        self.dims = (num_layers, num_kv_heads, head_dim)
        self.dtype, self.device, self.max_model_len = dtype, device, max_len
        self.buf: torch.Tensor | None = None
        self.lens = torch.zeros(0, dtype=torch.long, device=device)  # cached tokens per row
        self.num_rows = 0
        self.max_len = 0  # max(lens), kept as a Python int
        self._mode: str | None = None
        self._rows_arange = torch.arange(0, device=device)

    # -- capacity --------------------------------------------------------------------------

    @property
    def capacity(self) -> tuple[int, int]:
        return (0, 0) if self.buf is None else (self.buf.shape[2], self.buf.shape[4])

    def nbytes(self) -> int:
        return 0 if self.buf is None else self.buf.numel() * self.buf.element_size()

    def reserve(self, rows: int, length: int) -> None:
        """Make room for `rows` slots of `length` positions (grows by doubling, keeps contents)."""
        slots, cap = self.capacity
        if rows <= slots and length <= cap:
            return
        new_slots = slots if rows <= slots else max(rows, 2 * slots)
        new_len = cap if length <= cap else max(length, min(2 * cap, self.max_model_len))
        layers, heads, head_dim = self.dims
        buf = torch.zeros(
            (layers, 2, new_slots, heads, new_len, head_dim), dtype=self.dtype, device=self.device
        )
        if self.buf is not None and self.num_rows:
            n, used = self.num_rows, self.max_len
            buf[:, :, :n, :, :used] = self.buf[:, :, :n, :, :used]
        self.buf = buf
        self._rows_arange = torch.arange(new_slots, device=self.device)

    # -- one forward: prepare, (model calls write per layer), commit -------------------------

    def prepare_prefill(
        self, prompt_lens: torch.Tensor, src: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Before a prefill forward over right-padded prompts `[u, P]` of lengths `prompt_lens`:
        new rows `num_rows + i` take the keys/values of forward row `src[i]` (None: row i).
        Returns (position_ids [u, P], attention mask [u, 1, P, P])."""
        width = int(prompt_lens.max())
        new_rows = prompt_lens.shape[0] if src is None else src.shape[0]
        self.reserve(self.num_rows + new_rows, width + 1)
        self._mode, self._src, self._width, self._new = "prefill", src, width, new_rows
        pos = torch.arange(width, device=self.device)
        causal = pos[None, :] <= pos[:, None]  # [P(query), P(key)]
        valid = pos[None, :] < prompt_lens[:, None]  # [u, P(key)]
        mask = causal[None, None, :, :] & valid[:, None, None, :]
        self._new_lens = prompt_lens if src is None else prompt_lens[src]
        return pos.expand(prompt_lens.shape[0], width), mask

    def prepare_decode(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Before a one-token decode forward of all rows: returns (position_ids [n, 1],
        attention mask [n, 1, 1, max_len + 1])."""
        n, width = self.num_rows, self.max_len + 1
        self.reserve(n, width)
        self._mode, self._width = "decode", width
        self._pos = self.lens[:n]
        keys = torch.arange(width, device=self.device)
        mask = keys[None, :] <= self._pos[:, None]
        return self._pos[:, None], mask[:, None, None, :]

    def write(
        self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store a layer's new keys/values `[batch, kv_heads, q_len, head_dim]` and return the
        keys/values that layer attends over."""
        assert self.buf is not None
        kbuf, vbuf = self.buf[layer_idx, 0], self.buf[layer_idx, 1]
        if self._mode == "decode":
            n, rows = self.num_rows, self._rows_arange[: self.num_rows]
            kbuf[rows, :, self._pos] = keys[:, :, 0]
            vbuf[rows, :, self._pos] = values[:, :, 0]
            return kbuf[:n, :, : self._width], vbuf[:n, :, : self._width]
        if self._mode == "prefill":
            start, end, width = self.num_rows, self.num_rows + self._new, self._width
            src = self._src
            kbuf[start:end, :, :width] = keys if src is None else keys[src]
            vbuf[start:end, :, :width] = values if src is None else values[src]
            return keys, values  # new rows have no earlier tokens
        raise RuntimeError("SlotKVCache.write outside prepare_prefill/prepare_decode")

    def commit(self) -> None:
        """After the forward: the written tokens count as cached."""
        if self._mode == "decode":
            self.lens[: self.num_rows] += 1
            self.max_len += 1
        elif self._mode == "prefill":
            self.lens = torch.cat([self.lens[: self.num_rows], self._new_lens])
            self.num_rows += self._new
            self.max_len = int(self.lens.max()) if self.num_rows else 0
        self._mode = None

    def abort(self) -> None:
        """After a failed forward: forget the prepared write (cached rows stay valid only if it
        was a prefill; a failed decode leaves rows in an unknown state, so the caller drops them)."""
        self._mode = None

    # -- leaving rows -------------------------------------------------------------------------

    def remove_rows(self, done: Sequence[int]) -> list[int]:
        """Drop rows `done`; the highest surviving rows move into the freed low slots.
        Returns, for each new slot, the old index of the row now in it."""
        done_set = set(done)
        n = self.num_rows
        keep = n - len(done_set)
        order = list(range(keep))
        holes = [i for i in sorted(done_set) if i < keep]
        movers = [i for i in range(keep, n) if i not in done_set]
        for hole, mover in zip(holes, movers):
            order[hole] = mover
        if holes and self.buf is not None:
            dst = torch.tensor(holes, device=self.device)
            src = torch.tensor(movers, device=self.device)
            used = self.buf[..., : self.max_len, :]
            used[:, :, dst] = used[:, :, src]
        self.lens = self.lens[torch.tensor(order, dtype=torch.long, device=self.device)]
        self.num_rows = keep
        self.max_len = int(self.lens.max()) if keep else 0
        return order
