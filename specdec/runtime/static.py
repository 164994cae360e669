"""A transformers model on preallocated KV caches, its forwards compiled per shape (CUDA graphs on a GPU).

`HFModel` grows a DynamicCache per sequence and launches every kernel from Python: on a GPU a
one-token step then costs several times what reading the weights does. Here instead
- each sequence holds a *slot*: per layer, keys and values of `capacity + 1` entries allocated once,
  written in place (`index_copy_` at the entries' slot numbers) and rolled back by moving a count.
  Slots are pooled per model, so their addresses, and the graphs captured over them, are reused;
- a forward of n new entries is padded to the smallest bucket >= n (`BUCKETS`) and runs one
  compiled function per bucket: `torch.compile`, "reduce-overhead" (CUDA graphs) on a GPU. Padding
  entries write the slot's last cell (`capacity`, never attended to by a real entry) and see only
  it, so they stay finite and change nothing. Forwards of more entries (a prefill chunk) run eagerly
  on the same cache;
- the attention mask is built on the device from the cached entries' count, the tree part of the
  mask (a few rows the host knows) and, for sliding windows, each slot's position;
- inputs go up through pinned buffers without waiting; the logits stay on the device when the
  caller asks (`Feed.on_device`): the engine then reads one small tensor per iteration (the argmax
  path, or the sampling distribution) and nothing else waits for the device.

Invariant (as `HFSequence`): entry i of a sequence sits in cache slot i, with its own position.
"""

from __future__ import annotations

import time

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, CacheLayerMixin

from specdec.errors import SpecDecError
from specdec.runtime import base
from specdec.runtime.hf import HFModel, HFSequence

BUCKETS = (1, 4, 16, 64)  # new entries per compiled forward; verify trees and chains pad up to these
DEFAULT_CONTEXT = 4096  # slot capacity unless asked: every step attends over the whole slot
COMPILE_BACKENDS = ("inductor", "cudagraphs", "aot_eager", "eager")  # "eager": the static cache alone


class StaticHFModel(HFModel):
    """An HFModel whose sequences live in pooled static slots, with compiled forwards per bucket."""

    device_logits = True

    def __init__(self, model, tokenizer, path: str = "", context: int | None = None, backend: str = "inductor"):
        super().__init__(model, tokenizer, path)
        if backend not in COMPILE_BACKENDS:
            raise SpecDecError(f"unknown compile backend {backend!r}; choose one of {', '.join(COMPILE_BACKENDS)}")
        refusal = static_refusal(model.config)
        if refusal:
            raise SpecDecError(f"{path}: no static cache for this model ({refusal}); run it with compile off")
        self.capacity = min(self.max_length, context or DEFAULT_CONTEXT)
        self.max_length = self.capacity
        self.compile_backend = backend
        self._free: list[_Slot] = []
        self._layout = _cache_layout(self)
        self._runners: dict[int, object] = {}
        self.compile_seconds: dict[int, float] = {}  # bucket -> seconds its first (compiling) forward took
        self._constants = _Constants(self)

    def sequence(self) -> StaticSequence:
        return StaticSequence(self, self._free.pop() if self._free else _Slot(self._layout, self.capacity + 1, self.device))

    def describe(self) -> str:
        return f"{super().describe()[:-1]}, static cache of {self.capacity}, compiled with {self.compile_backend})"

    def forward_batch(self, feeds: list[base.Feed]) -> list[torch.Tensor]:
        """One row after another: each row replays its own graph (a batch over slots is later work)."""
        return base.forward_each(feeds)

    def verify_room(self, root_position: int) -> int:
        return max(0, self.max_length - 1 - root_position)

    def warm_up(self, buckets: tuple[int, ...] = BUCKETS) -> float:
        """Compile (capture) every bucket now rather than on first use; returns the seconds it took."""
        started = time.perf_counter()
        sequence = self.sequence()
        try:
            for bucket in buckets:
                for _ in range(3):  # CUDA graph trees record on the second or third call
                    sequence.forward([0] * bucket)
                    sequence.truncate(0)
        finally:
            sequence.release()
        synchronize(self.device)
        return time.perf_counter() - started

    def runner(self, bucket: int):
        """The compiled forward for `bucket` new entries (compiled on its first call)."""
        if bucket not in self._runners:
            self._runners[bucket] = self._compiled() if self.compile_backend != "eager" else self._forward_logits
        return self._runners[bucket]

    def _compiled(self):
        # one compiled entry per model and bucket share `_forward_logits`'s code: past dynamo's limit
        # (8 by default) a further model would silently run eagerly
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 16 * len(BUCKETS))
        cuda = self.device.type == "cuda"
        if self.compile_backend == "inductor":
            return torch.compile(self._forward_logits, mode="reduce-overhead" if cuda else None, dynamic=False, fullgraph=False)
        return torch.compile(self._forward_logits, backend=self.compile_backend, dynamic=False)

    def _forward_logits(self, tokens, positions, mask, cache):
        out = self.model(input_ids=tokens, position_ids=positions, attention_mask=mask, past_key_values=cache, use_cache=True)
        return out.logits


class StaticSequence(HFSequence):
    """One sequence in a static slot. The bookkeeping (positions, parents, trunk) is HFSequence's;
    the cache is the slot's, so rollback and compaction are device index operations."""

    def __init__(self, owner: StaticHFModel, slot: _Slot):
        super().__init__(owner)
        self._cache = None
        self.slot = slot

    def release(self) -> None:
        if self.slot is not None:
            self.owner._free.append(self.slot)
        self.slot = None

    @torch.inference_mode()
    def forward(self, tokens, parents=None, last: int | None = None, on_device: bool = False) -> torch.Tensor:
        """As `Sequence.forward`; on_device: the logits stay on the model's device."""
        owner, start = self.owner, self.cache_len
        tokens, positions, all_parents = self.place(tokens, parents)
        n = len(tokens)
        bucket = next((b for b in BUCKETS if b >= n), n)  # beyond the largest: eager, unpadded
        ancestry = self.attends(all_parents, start, n)
        inputs = self._inputs(tokens, positions, start, bucket, ancestry)
        mask = owner._constants.mask(self._trunk, start, n, bucket, inputs, self.slot.positions)
        if bucket in BUCKETS:
            first = bucket not in owner._runners
            began = time.perf_counter()
            logits = owner.runner(bucket)(inputs.tokens, inputs.positions, mask, self.slot.cache)
            if first:
                synchronize(owner.device)
                owner.compile_seconds[bucket] = time.perf_counter() - began
        else:
            logits = owner._forward_logits(inputs.tokens, inputs.positions, mask, self.slot.cache)
        self.commit(tokens, positions, all_parents)
        wanted = n if last is None else min(last, n)
        # a copy: a CUDA graph's output is overwritten by its next replay
        logits = logits[0, n - wanted : n, : owner.vocab_size]
        logits = logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32)
        return logits.clone() if on_device else logits.cpu()

    def _inputs(self, tokens: list[int], positions: list[int], start: int, bucket: int, ancestry: torch.Tensor | None) -> _Inputs:
        """Tokens, positions and cache slots of the padded forward, and the tree part of its mask
        (ancestry's columns from the trunk on; None for a chain), on the device in one upload; the
        slot's position table updated. Padding: token 0 at position 0 in the scratch slot."""
        pad = bucket - len(tokens)
        slots = list(range(start, start + len(tokens))) + [self.owner.capacity] * pad
        part = None if ancestry is None else ancestry[:, self._trunk :]
        rows = [tokens + [0] * pad, positions + [0] * pad, slots] + ([] if part is None else [part.reshape(-1).long().tolist()])
        uploaded = self.owner._constants.upload(rows)
        tree = None if part is None else uploaded[3].view(part.shape).bool()
        inputs = _Inputs(uploaded[0][None], uploaded[1][None], uploaded[2], tree)
        self.slot.cache.slots = inputs.slots
        self.slot.positions.index_copy_(0, inputs.slots, inputs.positions[0])
        return inputs

    @torch.inference_mode()
    def keep(self, start: int, indices: list[int]) -> None:
        indices = [int(i) for i in indices]
        base.check_kept_path(self._parents, start, indices, self.cache_len)
        if indices != list(range(start, start + len(indices))):  # a chain's path is already in place
            source = self.owner._constants.upload([indices])[0]
            self.slot.move(source, start)
        self._positions = self._positions[:start] + [self._positions[i] for i in indices]
        self._tokens = self._tokens[:start] + [self._tokens[i] for i in indices]
        self._parents = self._parents[:start] + base.chain_parents(start, len(indices))
        self._trunk = min(self._trunk, start)
        self._extend_trunk()

    @torch.inference_mode()
    def fork(self, length: int) -> StaticSequence:
        if not 0 <= length <= self._trunk:
            raise ValueError(f"cannot fork the first {length} of {self.cache_len} entries: they must be committed text")
        other = self.owner.sequence()
        other.slot.copy_from(self.slot, length)
        other._positions, other._tokens = self._positions[:length], self._tokens[:length]
        other._parents, other._trunk = base.chain_parents(0, length), length
        return other

    def crosses_rope_switch(self, positions) -> bool:
        return False  # longrope models are refused (`static_refusal`)

    def cache_tensors(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        n = self.cache_len
        return [(keys[:, :, :n], values[:, :, :n]) for keys, values in zip(self.slot.keys, self.slot.values)]


class _Inputs:
    def __init__(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, tree: torch.Tensor | None):
        self.tokens, self.positions, self.slots = tokens, positions, slots  # [1, b], [1, b], [b]
        self.tree = tree  # [n, start + n - trunk] bool, or None for a chain


class _Slot:
    """Keys and values of `cells` entries per layer, each entry's position, and the cache object
    the model writes through."""

    def __init__(self, layout: list[tuple[tuple[int, ...], tuple[int, ...], torch.dtype]], cells: int, device: torch.device):
        self.keys = [torch.zeros(k[0], k[1], cells, k[3], dtype=dtype, device=device) for k, _, dtype in layout]
        self.values = [torch.zeros(v[0], v[1], cells, v[3], dtype=dtype, device=device) for _, v, dtype in layout]
        self.positions = torch.zeros(cells, dtype=torch.long, device=device)
        for tensor in (*self.keys, *self.values, self.positions):
            torch._dynamo.mark_static_address(tensor)
        self.cache = SlotCache(self.keys, self.values)

    def move(self, source: torch.Tensor, start: int) -> None:
        """Entries at `source` (slot numbers) to slots start, start + 1, ..."""
        end = start + source.numel()
        for tensor in (*self.keys, *self.values):
            tensor[:, :, start:end] = tensor.index_select(2, source)
        self.positions[start:end] = self.positions.index_select(0, source)

    def copy_from(self, other: _Slot, length: int) -> None:
        for mine, theirs in zip((*self.keys, *self.values), (*other.keys, *other.values)):
            mine[:, :, :length] = theirs[:, :, :length]
        self.positions[:length] = other.positions[:length]


class SlotLayer(CacheLayerMixin):
    is_compileable = True
    supports_early_init = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        super().__init__()
        self.keys, self.values, self.is_initialized = keys, values, True

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        raise NotImplementedError  # SlotCache.update writes at its slots

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.keys.shape[2], 0

    def get_seq_length(self) -> int:
        return 0  # not used: positions and the 4-D mask are always given

    def get_max_length(self) -> int:
        return self.keys.shape[2]


class SlotCache(Cache):
    """The slot's layers as transformers sees them: `update` writes the new keys and values at
    `slots` (set before each forward) and returns the whole slot; the mask hides the rest."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor]):
        super().__init__(layers=[SlotLayer(k, v) for k, v in zip(keys, values)])
        self.slots: torch.Tensor | None = None

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        layer = self.layers[layer_idx]
        layer.keys.index_copy_(2, self.slots, key_states.to(layer.keys.dtype))
        layer.values.index_copy_(2, self.slots, value_states.to(layer.values.dtype))
        return layer.keys, layer.values


class _Constants:
    """Per-model device tensors reused every forward, and the uploads through pinned memory."""

    def __init__(self, owner: StaticHFModel):
        self.owner = owner
        device = owner.device
        cells = owner.capacity + 1
        self.cell_index = torch.arange(cells, device=device)
        self.pinned = device.type == "cuda"
        self._staging: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None

    def upload(self, rows: list[list[int]]) -> list[torch.Tensor]:
        """Integer rows to the device without waiting for it: through one pinned buffer, reused only
        once its previous copy is done."""
        flat = [value for row in rows for value in row]
        if not self.pinned:
            values = torch.tensor(flat, dtype=torch.long)
        else:
            if self._staging is None or self._staging.numel() < len(flat):
                self._staging = torch.empty(max(len(flat), 1024), dtype=torch.long, pin_memory=True)
            if self._copied is not None:
                self._copied.synchronize()
            self._staging[: len(flat)] = torch.tensor(flat, dtype=torch.long)
            values = self._staging[: len(flat)].to(self.owner.device, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
        return list(values.split([len(row) for row in rows]))

    def mask(self, trunk: int, start: int, n: int, bucket: int, inputs: _Inputs, key_positions: torch.Tensor):
        """The model's attention mask(s) for a forward, [1, 1, bucket, cells]: entry j (at slot
        start + j) sees the trunk (slots < trunk) and its ancestors at or above the trunk; padding
        rows see the scratch slot only."""
        cells = self.cell_index
        if inputs.tree is None:  # a chain after a chain: entry j sees slots <= start + j
            allowed = cells[None, :] <= (start + cells[:bucket, None])
        else:
            allowed = (cells[None, :] < trunk).expand(bucket, -1).clone()
            allowed[:n, trunk : start + n] = inputs.tree
        if bucket > n:
            allowed[n:] = cells[None, :] == self.owner.capacity
        return self._layer_masks(allowed, key_positions, inputs.positions[0])

    def _layer_masks(self, allowed: torch.Tensor, key_positions: torch.Tensor, positions: torch.Tensor):
        owner = self.owner
        window = owner.sliding_window
        if window is not None:
            windowed = allowed & (key_positions[None, :] > positions[:, None] - window)
            if "full_attention" in (getattr(owner.model.config, "layer_types", None) or []):
                return {"full_attention": self._additive(allowed), "sliding_attention": self._additive(windowed)}
            allowed = windowed
        return self._additive(allowed)

    def _additive(self, allowed: torch.Tensor) -> torch.Tensor:
        dtype = self.owner.torch_dtype
        zero = torch.zeros((), dtype=dtype, device=allowed.device)
        return torch.where(allowed, zero, torch.finfo(dtype).min)[None, None]


def static_refusal(config) -> str | None:
    """Why a model cannot run on static slots, or None."""
    from specdec.runtime.hf import _known_tree_refusal, _longrope_switch

    tree = _known_tree_refusal(config)
    if tree:
        return f"its masks are not exact ({tree})"
    if _longrope_switch(config) is not None:
        return "longrope recomputes the whole cache when the context passes its switch"
    if config.model_type in ("mamba", "mamba2", "jamba", "falcon_mamba", "zamba", "bamba", "recurrent_gemma", "lfm2", "qwen3_next"):
        return "its layers keep recurrent state, not keys and values"
    if getattr(config, "is_encoder_decoder", False):
        return "encoder-decoder"
    return None


def _cache_layout(model: HFModel) -> list:
    """Each layer's key and value shapes and dtype, from one eager forward of one token."""
    cache = DynamicCache()
    with torch.inference_mode():
        model.model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=model.device), past_key_values=cache, use_cache=True)
    layout = []
    for layer in cache.layers:
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if keys is None or keys.dim() != 4:
            raise SpecDecError(f"{model.path}: a cache layer of {type(layer).__name__} holds no keys and values")
        layout.append((tuple(keys.shape), tuple(values.shape), keys.dtype))
    return layout


def synchronize(device: torch.device) -> None:
    """Wait for the device (a no-op on the CPU): timings of forwards that return early need it."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
