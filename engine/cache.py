"""The KV cache: preallocated, indexed by position.

Keys and values of layer i live in K[i], V[i] of shape [1, kv_heads, capacity, head_dim].
`length` is the number of committed positions. Writing a pass of T tokens at position p
fills [p, p+T); attention reads the prefix [0, p+T). Rolling back rejected draft tokens
or a re-rendered turn only moves `length`: nothing is copied. The cache grows by
reallocation (doubling) only when a conversation outgrows it, up to the model's limit.
"""
from __future__ import annotations

import contextlib

import torch

from .errors import ContextFull


class KVCache:
    # Positions past max_positions the cache may hold but never commits: the graph step's
    # padding rows (a fixed-width pass) land there at the end of the context.
    slack = 0

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, capacity: int = 1024, max_positions: int | None = None):
        self.layers, self.kv_heads, self.head_dim = layers, kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self.max_positions = max_positions or 1 << 30
        self.length = 0
        self.capacity = 0
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self._allocate(min(capacity, self.max_positions))

    def _allocate(self, capacity: int) -> None:
        shape = (1, self.kv_heads, capacity, self.head_dim)
        k = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.layers)]
        v = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.layers)]
        for old, new in zip(self.k + self.v, k + v):
            new[:, :, : self.length].copy_(old[:, :, : self.length])
        self.k, self.v, self.capacity = k, v, capacity

    def reserve(self, new_tokens: int) -> None:
        """Make room for a pass of `new_tokens` at the current length."""
        need = self.length + new_tokens
        if need > self.max_positions:
            raise ContextFull(f"the conversation needs {need} tokens but the model's context holds "
                              f"{self.max_positions}; start a new chat")
        self.grow_to(need)

    def grow_to(self, positions: int) -> None:
        """Hold at least `positions` (<= max_positions + slack), doubling the capacity as needed;
        a growth that reaches max_positions takes the slack with it."""
        if positions > self.capacity:
            cap = self.capacity
            while cap < positions:
                cap *= 2
            self._allocate(self.max_positions + self.slack if cap >= self.max_positions else cap)

    def write(self, layer: int, pos: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store a pass's keys/values at [pos, pos+T) and return the views [0, pos+T) to attend over."""
        n = k.shape[-2]
        kc, vc = self.k[layer], self.v[layer]
        kc.narrow(2, pos, n).copy_(k.view(kc.shape[0], kc.shape[1], n, kc.shape[3]))
        vc.narrow(2, pos, n).copy_(v.view(vc.shape[0], vc.shape[1], n, vc.shape[3]))
        return kc.narrow(2, 0, pos + n), vc.narrow(2, 0, pos + n)

    def rollback(self, length: int) -> None:
        """Forget everything from position `length` on (rejected drafts, a re-rendered turn)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"rollback to {length} outside [0, {self.length}]")
        self.length = length

    def restorable(self, length: int) -> int:
        """The longest prefix of at most `length` tokens this cache can go back to: any, for
        keys and values indexed by position (RecurrentCache is not so free)."""
        return min(length, self.length)

    def checkpoint(self) -> None:
        """A turn boundary was committed (nothing to keep for a position-indexed cache)."""

    def settle(self) -> None:
        """Make what a recording kept committed now (a position-indexed cache has nothing to do)."""

    verifying = False          # passes are being recorded (RecurrentCache.record)

    def record(self):
        """Around passes that may be taken back (a verify pass of drafted tokens, a
        drafter's own steps): a position-indexed cache needs nothing, a rollback moves its
        length."""
        return contextlib.nullcontext()

    def export(self) -> dict[str, torch.Tensor]:
        """What the cache holds, as host tensors a resume store can write: the keys and
        values of the committed positions."""
        self.settle()
        n = self.length
        out = {}
        for i, (k, v) in enumerate(zip(self.k, self.v)):
            out[f"k.{i}"] = k.narrow(2, 0, n).contiguous().cpu()
            out[f"v.{i}"] = v.narrow(2, 0, n).contiguous().cpu()
        return out

    @torch.inference_mode()          # the cache's tensors are inference tensors (the passes run in that mode)
    def load(self, tensors: dict[str, torch.Tensor], length: int) -> None:
        """Hold what `export()` gave (`length` positions) in place of the cache's contents.
        ValueError where it does not fit this cache's layout; the cache is then empty."""
        self.rollback(0)
        want = (1, self.kv_heads, length, self.head_dim)
        for i in range(self.layers):
            for name in (f"k.{i}", f"v.{i}"):
                t = tensors.get(name)
                if t is None or tuple(t.shape) != want or t.dtype != self.dtype:
                    raise ValueError(f"{name}: {None if t is None else (tuple(t.shape), t.dtype)}, the cache "
                                     f"holds {want} in {self.dtype}")
        if f"k.{self.layers}" in tensors:
            raise ValueError(f"more than the cache's {self.layers} layers")
        self.reserve(length)
        for i in range(self.layers):
            self.k[i].narrow(2, 0, length).copy_(tensors[f"k.{i}"])
            self.v[i].narrow(2, 0, length).copy_(tensors[f"v.{i}"])
        self.length = length

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * torch.finfo(self.dtype).bits // 8


class RecurrentCache(KVCache):
    """A hybrid model's cache: position-indexed keys and values for its attention layers (as
    KVCache, `layers` counts only those), plus, per linear-attention layer, a state of fixed
    size (a conv window and a recurrent state, float32 even in a bf16 model) that has seen
    every token so far and cannot be moved back to an earlier position.

    So a rollback can only go to where a copy of the state was kept: the last turn boundary
    (`checkpoint()`, one copy per layer, taken after a prompt is prefilled) or the start.
    `restorable(n)` says which: a next turn that shares less than the whole cached prefix
    restores the checkpoint if it still covers the shared part, else prefills from scratch.
    It never continues from a state that has seen tokens the conversation no longer holds.

    `states` are the linear layers' holders (engine/models/hf_forward.py): each can
    `snapshot()`, `restore(snap)` and `reset()`.

    Speculation: inside `record()` (a verify pass; a drafter's own steps) the recurrent
    layers leave their committed state alone and record what each position would add
    (engine/models/replay.py). A rollback to any length the recording covered is then
    allowed; the committed state advances by exactly the kept positions, replayed, when the
    cache is next used (`settle()`): two rollbacks in a row (rejected drafts, then an
    accepted stop token) replay once."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.states: list = []
        self.replays: list = []        # models.replay.LayerReplay per recurrent layer
        self.replay_capacity = 9       # positions a verify pass records: the engine's max_draft + 1
        self._checkpoint: tuple[int, list] | None = None
        self._pending: int | None = None     # where an unsettled recording started

    @contextlib.contextmanager
    def record(self):
        self.settle()
        start = self.length
        self.verifying = True
        try:
            yield
        finally:
            self.verifying = False
            self._pending = start if self.length > start else None

    def settle(self) -> None:
        """Advance the committed recurrent states by the positions of the last verify pass
        the cache still holds (the accepted ones), replayed from their recorded inputs."""
        if self._pending is None:
            return
        start, self._pending = self._pending, None
        for rep in self.replays:
            rep.commit(self.length - start)

    def reserve(self, new_tokens: int) -> None:
        self.settle()
        super().reserve(new_tokens)

    def restorable(self, length: int) -> int:
        if length >= self.length:
            return self.length
        if self._pending is not None and self._pending <= length:
            return length
        if self._checkpoint is not None and self._checkpoint[0] <= length:
            return self._checkpoint[0]
        return 0

    def rollback(self, length: int) -> None:
        if length == self.length:
            return
        if self._pending is not None and self._pending <= length < self.length:
            KVCache.rollback(self, length)       # settled (replayed) when the cache is next used
            return
        self.settle()
        if length == self.length:
            return
        if not 0 <= length < self.length:
            raise ValueError(f"rollback to {length} outside [0, {self.length}]")
        if self._checkpoint is not None and self._checkpoint[0] == length:
            for state, snap in zip(self.states, self._checkpoint[1]):
                state.restore(snap)
        elif length == 0:
            for state in self.states:
                state.reset()
            self._checkpoint = None
        else:
            raise ValueError(f"a recurrent state cannot go back to position {length} (it holds {self.length}; "
                             f"restorable: {self.restorable(length)})")
        super().rollback(length)

    def checkpoint(self) -> None:
        self.settle()
        self._checkpoint = (self.length, [state.snapshot() for state in self.states])

    def export(self) -> dict[str, torch.Tensor]:
        """The keys and values, plus each recurrent layer's state now and at the turn
        checkpoint (so a restored cache rolls back as this one would)."""
        out = super().export()          # settles first: the live states are the committed ones
        _put_states(out, "state", [state.snapshot() for state in self.states])
        if self._checkpoint is not None:
            out["checkpoint"] = torch.tensor([self._checkpoint[0]], dtype=torch.int64)
            _put_states(out, "checkpoint", self._checkpoint[1])
        return out

    @torch.inference_mode()
    def load(self, tensors: dict[str, torch.Tensor], length: int) -> None:
        self._pending = None
        self._checkpoint = None
        super().load(tensors, length)
        try:
            live = _get_states(tensors, "state", len(self.states), self.device)
            mark = tensors.get("checkpoint")
            if mark is not None:
                at = int(mark[0])
                if not 0 <= at <= length:
                    raise ValueError(f"a checkpoint at {at} outside [0, {length}]")
                self._checkpoint = (at, _get_states(tensors, "checkpoint", len(self.states), self.device))
            for state, snap in zip(self.states, live):
                state.restore(snap)
        except (ValueError, RuntimeError):
            KVCache.rollback(self, 0)
            self._checkpoint = None
            for state in self.states:
                state.reset()
            raise

    def state_bytes(self) -> int:
        """Bytes of the recurrent states and of the one checkpoint kept of them."""
        live = sum(state.nbytes() for state in self.states)
        return live * (2 if self._checkpoint is not None else 1)

    def replay_bytes(self) -> int:
        """Bytes of the replay buffers speculation has allocated (0 before its first pass)."""
        return sum(rep.nbytes() for rep in self.replays)

    def nbytes(self) -> int:
        return super().nbytes() + self.state_bytes() + self.replay_bytes()


def _put_states(out: dict, name: str, snaps: list) -> None:
    """Recurrent layers' snapshots (each None, or a tuple of tensors and Nones) as named tensors."""
    for i, snap in enumerate(snaps):
        for j, t in enumerate(snap or ()):
            if t is not None:
                out[f"{name}.{i}.{j}"] = t.contiguous().cpu()


def _get_states(tensors: dict, name: str, layers: int, device) -> list:
    if any(k.startswith(f"{name}.{layers}.") for k in tensors):
        raise ValueError(f"more than the cache's {layers} recurrent layers")
    snaps = []
    for i in range(layers):
        parts = [None if (t := tensors.get(f"{name}.{i}.{j}")) is None else t.to(device) for j in range(2)]
        snaps.append(None if all(p is None for p in parts) else tuple(parts))
    return snaps


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two sequences share: what a cache holding `a` can keep for `b`."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
