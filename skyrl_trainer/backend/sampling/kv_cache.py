"""A preallocated KV cache with one slot per generated row, for the PyTorch sampling engine.

All layers' keys and values live in one buffer `[layers, 2, slots, kv_heads, length, head_dim]`:

- rows occupy slots `0 .. num_rows-1`, each with its own length (`lens`), so rows of different
  prompt lengths, and rows that joined the batch at different steps, decode together; a decode
  step writes every row's new key/value at that row's own position (one `index_put_` per layer)
  and attends over the contiguous block `[:num_rows]` (all positions, masking each row's
  positions `> its length`): `slot_attention` does that as two batched matmuls, several times
  faster on CPU than SDPA, which is also slow on strided views of the buffer;
- a finished row leaves at once: the last rows move into the freed slots (`remove_rows`), so the
  next step computes nothing for it and copies only the moved rows, not the whole cache;
- the buffer grows when more slots or positions are needed (positions by `max(32, 1/8)` of the
  length, so attention reads little past the longest row and copies rarely), instead of Hugging
  Face's DynamicCache, which concatenates on every step (O(T^2) copying).

It is a `transformers` `Cache`: the model's attention layers call `update(key, value, layer_idx)` and
get back the keys/values to attend over. The engine passes the 4-D masks built here as
`attention_mask` (the model uses a 4-D mask as it is) and runs the model with the `slot_attention`
implementation (`SLOT_ATTENTION`). Prefill writes a forward
batch of distinct prompts (right-padded) into the slots of all their sample rows (`src`), so
`num_samples` rows of one prompt cost one prompt forward. A prefill can also continue stored KV
(`prepare_extend`, for the engine's prefix store): the prefix is copied into the new rows' slots,
the suffix's keys/values are written after it and the suffix attends over those slots; `row_kv`
copies a row's KV out (a compact tensor, so a stored entry pins nothing here).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward

SLOT_ATTENTION = "skyrl_slot_attention"


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

    # -- capacity --------------------------------------------------------------------------

    @property
    def capacity(self) -> tuple[int, int]:
        return (0, 0) if self.buf is None else (self.buf.shape[2], self.buf.shape[4])

    def nbytes(self) -> int:
        return 0 if self.buf is None else self.buf.numel() * self.buf.element_size()

    def reserve(self, rows: int, length: int) -> None:
        """Make room for `rows` slots of `length` positions, keeping the contents (slots grow by
        doubling, positions by max(32, length / 8) beyond what is asked)."""
        slots, cap = self.capacity
        if rows <= slots and length <= cap:
            return
        new_slots = slots if rows <= slots else max(rows, 2 * slots)
        new_len = cap if length <= cap else min(length + max(32, length // 8), self.max_model_len)
        new_len = max(new_len, length)
        layers, heads, head_dim = self.dims
        buf = torch.empty(
            (layers, 2, new_slots, heads, new_len, head_dim), dtype=self.dtype, device=self.device
        )
        # Attention reads every position (masked ones too), so all of it must hold finite values.
        n, used = self.num_rows, self.max_len
        if self.buf is not None and n:
            buf[:, :, :n, :, :used] = self.buf[:, :, :n, :, :used]
            buf[:, :, :n, :, used:].zero_()
            buf[:, :, n:].zero_()
        else:
            buf.zero_()
        self.buf = buf

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

    def prepare_extend(
        self,
        prefixes: Sequence[torch.Tensor],
        prefix_lens: torch.Tensor,
        suffix_lens: torch.Tensor,
        src: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Before a prefill forward of prompts that start with cached keys/values: forward row u
        continues `prefixes[u]` (`[layers, 2, kv_heads, >= prefix_lens[u], head_dim]`) with its
        right-padded suffix of `suffix_lens[u]` tokens. New rows `num_rows + i` take forward row
        `src[i]` (None: row i): the prefix is copied into their slots now, the suffix's keys and
        values are written after it by the forward. Returns (position_ids [u, S], attention mask
        [u, 1, S, max prefix + S] over the slot positions)."""
        width = int(suffix_lens.max())
        u = prefix_lens.shape[0]
        rows = torch.arange(u, device=self.device) if src is None else src
        new_rows = rows.shape[0]
        longest = int(prefix_lens.max()) + width
        self.reserve(self.num_rows + new_rows, longest + 1)
        assert self.buf is not None
        start = self.num_rows
        m = prefix_lens.tolist()
        for i, row in enumerate(rows.tolist()):
            self.buf[:, :, start + i, :, : m[row]] = prefixes[row][:, :, :, : m[row]]
        heads, cap = self.dims[1], self.capacity[1]
        slots = torch.arange(start, start + new_rows, device=self.device)
        offsets = (slots[:, None] * heads + torch.arange(heads, device=self.device)) * cap
        pos = torch.arange(width, device=self.device)
        first = prefix_lens[rows]  # [new_rows]: where each new row's suffix starts
        flat = offsets[:, :, None] + first[:, None, None] + pos[None, None, :]
        self._flat_pos = flat.view(-1)
        # Attention reads the slots of each forward row's first new row.
        first_slot = torch.full((u,), -1, dtype=torch.long, device=self.device)
        first_slot.scatter_reduce_(0, rows, slots, reduce="amin", include_self=False)
        self._attend_slots = None if src is None else first_slot
        self._mode, self._src, self._width, self._new = "extend", src, width, new_rows
        self._key_len = longest
        position_ids = prefix_lens[:, None] + pos[None, :]  # [u, S]
        keys = torch.arange(longest, device=self.device)
        mask = (keys[None, None, :] <= position_ids[:, :, None]) & (
            keys[None, None, :] < (prefix_lens + suffix_lens)[:, None, None]
        )
        self._new_lens = (prefix_lens + suffix_lens)[rows]
        return position_ids, mask[:, None]

    def row_kv(self, slot: int, length: int) -> torch.Tensor:
        """A compact copy of the first `length` cached positions of `slot`:
        `[layers, 2, kv_heads, length, head_dim]`."""
        assert self.buf is not None
        return self.buf[:, :, slot, :, :length].clone(memory_format=torch.contiguous_format)

    def prepare_decode(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Before a one-token decode forward of all rows: returns (position_ids [n, 1], additive
        attention mask [n, 1, 1, capacity] in the cache dtype: 0 up to each row's new token, -inf
        after)."""
        n = self.num_rows
        self.reserve(n, self.max_len + 1)
        self._mode = "decode"
        pos = self.lens[:n]
        # Row r, head h writes at flat row (r * heads + h) * capacity + pos[r] of a layer's keys.
        heads, cap = self.dims[1], self.capacity[1]
        rows_heads = torch.arange(n * heads, device=self.device).view(n, heads)
        self._flat_pos = (rows_heads * cap + pos[:, None]).view(-1)
        keys = torch.arange(cap, device=self.device)
        mask = torch.zeros((n, cap), dtype=self.dtype, device=self.device)
        mask.masked_fill_(keys[None, :] > pos[:, None], float("-inf"))
        return pos[:, None], mask[:, None, None, :]

    def write(
        self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store a layer's new keys/values `[batch, kv_heads, q_len, head_dim]` and return the
        keys/values that layer attends over."""
        assert self.buf is not None
        kbuf, vbuf = self.buf[layer_idx, 0], self.buf[layer_idx, 1]
        if self._mode == "decode":
            n, head_dim = self.num_rows, self.dims[2]
            kbuf.view(-1, head_dim).index_copy_(0, self._flat_pos, keys.reshape(-1, head_dim))
            vbuf.view(-1, head_dim).index_copy_(0, self._flat_pos, values.reshape(-1, head_dim))
            return kbuf[:n], vbuf[:n]
        if self._mode == "prefill":
            start, end, width = self.num_rows, self.num_rows + self._new, self._width
            src = self._src
            kbuf[start:end, :, :width] = keys if src is None else keys[src]
            vbuf[start:end, :, :width] = values if src is None else values[src]
            return keys, values  # new rows have no earlier tokens
        if self._mode == "extend":
            head_dim, src = self.dims[2], self._src
            new_k = keys if src is None else keys[src]
            new_v = values if src is None else values[src]
            kbuf.view(-1, head_dim).index_copy_(0, self._flat_pos, new_k.reshape(-1, head_dim))
            vbuf.view(-1, head_dim).index_copy_(0, self._flat_pos, new_v.reshape(-1, head_dim))
            length = self._key_len
            if self._attend_slots is None:
                start, end = self.num_rows, self.num_rows + self._new
                return kbuf[start:end, :, :length], vbuf[start:end, :, :length]
            slots = self._attend_slots
            return kbuf[slots, :, :length], vbuf[slots, :, :length]
        raise RuntimeError("SlotKVCache.write outside prepare_prefill/prepare_decode")

    def commit(self) -> None:
        """After the forward: the written tokens count as cached."""
        if self._mode == "decode":
            self.lens[: self.num_rows] += 1
            self.max_len += 1
        elif self._mode in ("prefill", "extend"):
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


def slot_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention for models running on a SlotKVCache (registered as `SLOT_ATTENTION`).

    A decode step (one query per row) over the contiguous cache block is two batched matmuls: the
    query heads sharing a key/value head form the rows of one small matmul (GQA without copying
    keys/values), softmax in float32 with the additive mask. The scores are rounded to the model
    dtype before the softmax, as in transformers' eager attention (SDPA keeps them in float32).
    Everything else (prefill, extra features such as softcapping) goes to transformers' SDPA path.
    """
    batch, heads, q_len, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    plain = all(kwargs.get(k) is None for k in ("softcap", "s_aux", "sliding_window"))
    if q_len != 1 or not plain or not (key.is_contiguous() and value.is_contiguous()):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    groups = heads // kv_heads
    scale = scaling if scaling is not None else dim**-0.5
    q = query.reshape(batch * kv_heads, groups, dim)
    scores = torch.bmm(q, key.view(batch * kv_heads, length, dim).transpose(1, 2))
    scores = scores.view(batch, heads, length).float().mul_(scale)
    if attention_mask is not None:
        scores.add_(attention_mask.view(batch, 1, length))
    probs = scores.softmax(dim=-1).to(value.dtype)
    out = torch.bmm(probs.view(batch * kv_heads, groups, length), value.view(-1, length, dim))
    return out.view(batch, 1, heads, dim), None


AttentionInterface.register(SLOT_ATTENTION, slot_attention)
