"""A local Hugging Face causal LM behind the runtime protocol (`specdec.runtime.base`).

Each `HFSequence` owns a DynamicCache; entries carry explicit positions and parents, and a token
tree is fed under an attention mask built from those parents.

Exactness across architectures (each point is a way a well-known implementation went wrong):
- A tree mask is handed to the model as an additive float mask (0 where a token may attend, the
  dtype's minimum elsewhere): eager attention adds the mask to the scores, so a boolean mask there
  would mask nothing; sdpa and flex attention read the additive form the same way.
- Whether trees are exact on a model is checked once, on first use, by `tree_refusal`: known
  position schemes that trees cannot follow are refused by name (`named_tree_refusal`), then
  `base.tree_check` must pass.
- The target's states (`keep_states`) are what its output layer multiplies, taken at that layer's
  input by a hook: whatever an architecture does around it (a final norm, a projection, soft-capping
  or scaling of the logits after it), they are exactly the rows that gave the returned logits.
- RoPE that depends on the sequence length: "longrope" (Phi-3) switches every position to its long
  factors once the sequence passes `original_max_position_embeddings`, and Hugging Face recomputes
  the whole cache at that moment; so does `forward`, and `verify_room` keeps one forward from
  straddling the switch. "dynamic" NTK scaling depends on how tokens are grouped into forwards, so
  the context is capped at the original length instead.
"""

from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from specdec import tree
from specdec.errors import SpecDecError
from specdec.runtime import base
from specdec.runtime.base import check_state_layers
from specdec.runtime.entries import SequenceEntries


class HFModel(base.CheckedTrees):
    """A transformers model and its tokenizer; logits are restricted to the tokenizer's real
    vocabulary (padding rows dropped)."""

    backend = "transformers"
    peer_kind = "transformers.generate"  # Hugging Face generate() on the same model (`bench.peers`)
    spare_cells = None  # caches grow as they are filled
    spare_sequences = None  # each kept sequence holds a cache of its own
    device_logits = False  # forward returns logits on the CPU
    max_sequence_ids = None  # sequences are objects, as many as memory holds
    batch_invariant = False  # a row's logits may move with the batch's shape
    threads = None  # torch's threads (`load_model` sets them for the process)
    output_layer = None  # the model's own output layer computes the logits
    compile_backend = None  # eager forwards, nothing compiled
    columns = None  # logits over the whole vocabulary
    reads_target_states = False  # its sequences take no states from another model
    times_ops = False  # no per-op breakdown (that is llama.cpp's, `runtime.op_times`)

    def __init__(self, model, tokenizer, path: str = ""):
        self.model = model.eval()
        # the forward's name for the cache: `cache` since transformers 5.2x (which warns at the old
        # name on every call), `past_key_values` before
        self.cache_keyword = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self.tokenizer = tokenizer
        self.path = path
        self.vocab_size = len(tokenizer)
        rows = model.get_output_embeddings().weight.shape[0]
        if rows < self.vocab_size:
            raise SpecDecError(
                f"{path}: the model has {rows} output rows but its tokenizer has {self.vocab_size} tokens"
            )
        self.max_length = _context_length(model.config)
        self.rope_switch = longrope_switch(model.config)  # None, or the first position that runs long factors
        self.torch_device = model.device  # fixed: the model is moved before it is wrapped (HF's property is slow)
        self.device, self.on_gpu = str(self.torch_device), self.torch_device.type == "cuda"
        self.compile_seconds: dict[tuple[int, ...], float] = {}  # nothing compiled (`StaticHFModel` fills its own)
        if self.on_gpu:
            avoid_cudnn_attention()
        self.torch_dtype = model.dtype
        self.dtype = str(model.dtype).removeprefix("torch.")
        self.parameters = sum(p.numel() for p in model.parameters())
        self.weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        self.tree_tolerance = TREE_CHECK_TOLERANCE[self.torch_dtype]
        self.stop_token_ids = _stop_token_ids(model, tokenizer)
        self.takes_logits_to_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        head = model.get_output_embeddings()
        self.hidden_size = head.weight.shape[1] if _is_matrix_head(head) else model.config.hidden_size
        self._states_hook = None  # the hook on the output layer while states are kept
        self._head_input: torch.Tensor | None = None  # what the output layer last multiplied, until taken
        self._layers = _decoder_layers(model)
        self.layer_count = len(self._layers)
        self.state_layers: tuple[int, ...] | None = None  # while states are kept: the layers whose inputs they are
        self._layer_hooks: list = []
        self._layer_inputs: dict[int, torch.Tensor] = {}  # layer -> its input in the forward just run, until taken

    def keep_states(self, on: bool = True, layers: tuple[int, ...] | None = None) -> None:
        """From now on every forward leaves on each sequence it fed `states`: the rows the output
        layer multiplied (the final norm's output) for exactly the rows of logits returned, or with
        `layers`, the inputs of those decoder layers side by side for every token fed; off: None,
        and no hooks. The states come from the forward itself (hooks on the output layer's or the
        decoder layers' inputs), so nothing is computed twice."""
        for hook in self._layer_hooks:
            hook.remove()
        self._layer_hooks, self._layer_inputs, self.state_layers = [], {}, None
        if on and layers is not None:
            self.keep_states(False)
            check_state_layers(self, layers)
            self.state_layers = tuple(layers)
            self._layer_hooks = [self._layers[i].register_forward_pre_hook(self._layer_input_taker(i), with_kwargs=True)
                                 for i in set(layers)]
            return
        if on and self._states_hook is None:
            head = self.model.get_output_embeddings()
            if not _is_matrix_head(head):
                raise SpecDecError(f"{self.describe()}: no hidden states ({type(head).__name__} is not a linear "
                                   "output layer)")
            self._states_hook = head.register_forward_pre_hook(self._take_head_input)
        elif not on and self._states_hook is not None:
            self._states_hook.remove()
            self._states_hook = None
        self._head_input = None

    @property
    def keeps_states(self) -> bool:
        return self._states_hook is not None or self.state_layers is not None

    def _layer_input_taker(self, index: int):
        def take(layer, args, kwargs) -> None:
            self._layer_inputs[index] = args[0] if args else kwargs["hidden_states"]
        return take

    def state_rows(self, fed: int, returned: int, skipped: int = 0) -> slice:
        """Which of a row's `fed` new tokens' states a forward leaves (`returned`: its rows of logits), as rows of
        the states it took (the output layer's input skips the first `skipped` tokens where logits were kept)."""
        if self.state_layers is not None:
            return slice(0, fed)
        return slice(fed - returned - skipped, fed - skipped)

    def _take_head_input(self, head, args) -> None:
        self._head_input = args[0]

    def taken_states(self) -> torch.Tensor | None:
        """[batch, rows, hidden_size]: what the output layer multiplied in the forward just run
        (None while states are off); taken once."""
        if self.state_layers is not None:
            inputs, self._layer_inputs = self._layer_inputs, {}
            return torch.cat([inputs[i] for i in self.state_layers], dim=-1)
        states, self._head_input = self._head_input, None
        return states

    def sequence(self) -> HFSequence:
        return HFSequence(self)

    def input_embeddings(self, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.model.get_input_embeddings().weight.detach().to(device, dtype)

    def output_rows(self, embeddings: torch.Tensor | None = None) -> torch.Tensor:
        return self.model.get_output_embeddings().weight.detach().float().cpu()[: self.vocab_size]

    @property
    def attn_implementation(self) -> str:
        return getattr(self.model.config, "_attn_implementation", None) or "eager"

    def describe(self) -> str:
        return f"{self.path} ({self.model.config.model_type}, {self.attn_implementation} attention)"

    def warm_up(self, rows: int = 1) -> float:
        return 0.0  # eager kernels: nothing to compile (`StaticHFModel` compiles its pool's forwards)

    def verify_room(self, root_position: int) -> int:
        """How many positions after `root_position` may be fed in one forward with it.

        The context bounds it; with longrope, so does the switch: a forward that reaches it runs
        every position on the long factors, so nodes before the switch must not share it."""
        room = self.max_length - 1 - root_position
        if self.rope_switch is not None and root_position < self.rope_switch:
            room = min(room, self.rope_switch - 1 - root_position)
        return max(room, 0)

    def known_tree_refusal(self) -> str | None:
        return named_tree_refusal(self.model.config)

    def layer_masks(self, mask: torch.Tensor, key_positions: torch.Tensor, positions: torch.Tensor,
                    sliding: tuple[torch.Tensor, torch.Tensor] | None = None):
        """[batch, n, keys] bool -> the model's attention mask(s), for both backends (on the mask's
        device; `key_positions` [batch, keys], `positions` [batch, n]). An explicit mask replaces the
        model's own, so apply its sliding window here (`tree.sliding_window`, by position). Models
        mixing full and sliding layers get one mask per layer type. sliding: the sliding layers' own
        (mask, key positions) where they read other keys (the static pool's windows), else `mask`'s."""
        window = self.sliding_window
        if window is None:
            return self._additive(mask)
        windowed = self._additive(tree.sliding_window(*(sliding or (mask, key_positions)), positions, window))
        if "full_attention" in (getattr(self.model.config, "layer_types", None) or []):
            return {"full_attention": self._additive(mask), "sliding_attention": windowed}
        return windowed

    def _additive(self, mask: torch.Tensor) -> torch.Tensor:
        """[batch, n, keys] bool -> [batch, 1, n, keys] float: 0 where a token may attend, the dtype's
        minimum elsewhere. Every attention implementation adds a float mask to its scores; eager
        attention would add a boolean one too (True as 1), masking nothing."""
        dtype = self.torch_dtype
        zero = torch.zeros((), dtype=dtype, device=mask.device)  # where the mask is: the static pool's is on the device
        return torch.where(mask, zero, torch.finfo(dtype).min).to(self.torch_device)[:, None]

    def logits_out(self, logits: torch.Tensor) -> torch.Tensor:
        """The tokenizer's columns, in float32 (float64 kept), on the CPU."""
        return host_float(logits[..., : self.vocab_size])

    @torch.inference_mode()
    def forward_batch(self, feeds: list[base.Feed]) -> list[torch.Tensor]:
        """Several sequences in one forward. Each row's cached entries are left-padded to the
        longest (`width`) and its new entries follow at slots width.., padded to the most new
        entries; each row's mask admits its own entries only (a padding query sees itself). The
        batch's keys and values are written once (`_StackedLayer`); afterwards each sequence's
        cache is a view of its row: its entries are contiguous there, so nothing is copied back.
        Models that cannot take a tree exactly (ALiBi, windows by slot) place keys by slot, which
        padding would move: their rows go one at a time."""
        base.check_distinct(feeds)
        if any(feed.sequence.owner is not self for feed in feeds):
            raise ValueError("a batched forward takes sequences of its own model only")
        # padding moves slots: only where masks and positions are exact
        if len(feeds) == 1 or self.tree_refusal() is not None:
            return base.forward_each(feeds)
        rows = [(feed.sequence, *feed.sequence.place(feed.tokens, feed.parents)) for feed in feeds]
        # its cache is recomputed
        crossing = any(sequence.crosses_rope_switch(positions) for sequence, _, positions, _ in rows)
        if crossing or len({sequence._long_rope for sequence, *_ in rows}) > 1:
            # longrope picks its factors from the batch's largest position: rows on both sides of the switch go apart
            return base.forward_each(feeds)
        width = max(s.cache_len for s, *_ in rows)
        tokens, positions, key_positions, allowed = _padded_batch(rows, width)
        cache = DynamicCache()
        if width:
            cache.layers = [_StackedLayer([s._cache.layers[i] if s.cache_len else None for s, *_ in rows], width)
                            for i in range(len(next(s for s, *_ in rows if s.cache_len)._cache.layers))]
        out = self.model(input_ids=tokens.to(self.torch_device), position_ids=positions.to(self.torch_device),
                         attention_mask=self.layer_masks(allowed, key_positions, positions),
                         use_cache=True, **{self.cache_keyword: cache})
        states = self.taken_states()  # [batch, new, hidden] or None
        results = []
        for r, ((sequence, row_tokens, row_positions, all_parents), feed) in enumerate(zip(rows, feeds)):
            start, n = sequence.cache_len, len(row_tokens)
            for index, layer in enumerate(cache.layers):
                keys, values = (t[r : r + 1, :, width - start : width + n] for t in (layer.keys, layer.values))
                if index < len(sequence._cache.layers) and sequence._cache.layers[index].is_initialized:
                    sequence._cache.layers[index].keys, sequence._cache.layers[index].values = keys, values
                else:
                    sequence._cache.update(keys, values, index)
            sequence.commit(row_tokens, row_positions, all_parents)
            wanted = base.wanted_count(feed.last, n)
            results.append(self.logits_out(out.logits[r, n - wanted : n]))
            sequence.states = None if states is None else host_float(states[r, self.state_rows(n, wanted)])
        return results

    @property
    def sliding_window(self) -> int | None:
        config = self.model.config
        if not getattr(config, "use_sliding_window", True):
            return None
        window = getattr(config, "sliding_window", None)
        return window if isinstance(window, int) and window > 0 else None


def _padded_batch(rows: list, width: int) -> tuple[torch.Tensor, ...]:
    """`forward_batch`'s inputs for rows (sequence, tokens, positions, all parents) of `place`:
    tokens and positions [batch, new], each key's position [batch, width + new] and which keys each
    query sees [batch, new, width + new] (cached entries left-padded to `width`, new entries after;
    a padding query sees itself)."""
    batch, new = len(rows), max(len(t) for _, t, *_ in rows)
    tokens = torch.zeros(batch, new, dtype=torch.long)
    positions = torch.zeros(batch, new, dtype=torch.long)
    key_positions = torch.zeros(batch, width + new, dtype=torch.long)
    allowed = torch.zeros(batch, new, width + new, dtype=torch.bool)
    allowed[:, :, width:] = torch.eye(new, dtype=torch.bool)
    for r, (sequence, row_tokens, row_positions, all_parents) in enumerate(rows):
        start, n = sequence.cache_len, len(row_tokens)
        tokens[r, :n], positions[r, :n] = torch.tensor(row_tokens), torch.tensor(row_positions)
        key_positions[r, width - start : width] = torch.tensor(sequence._positions, dtype=torch.long)
        key_positions[r, width : width + n] = positions[r, :n]
        ancestry = sequence.attends(all_parents, start, n)
        if ancestry is None:
            ancestry = torch.ones(n, start + n, dtype=torch.bool).tril(start)
        allowed[r, :n, width - start : width] = ancestry[:, :start]
        allowed[r, :n, width : width + n] = ancestry[:, start:]
    return tokens, positions, key_positions, allowed


class HFSequence(SequenceEntries):
    """One sequence slot of an HFModel: a DynamicCache beside its entries' bookkeeping.

    Invariant (with `SequenceEntries`'): the cache holds keys and values of exactly `cache_len`
    entries, entry i in slot i."""

    def __init__(self, owner: HFModel):
        super().__init__(owner)
        # Plain full layers, even for sliding-window models: the window is applied by the attention
        # mask, and a full layer can be cut back exactly (a sliding layer's counters cannot).
        self._cache = DynamicCache()
        self._long_rope = False  # the cache was computed with longrope's long factors
        # [rows returned, hidden_size] of the last forward, while the model keeps states
        self.states: torch.Tensor | None = None

    def release(self) -> None:
        self._cache = None

    @torch.inference_mode()
    def forward(self, tokens, parents=None, last: int | None = None) -> torch.Tensor:
        tokens, positions, all_parents = self.place(tokens, parents)
        if self.crosses_rope_switch(positions):
            return self._forward_recomputing_cache(tokens, positions, all_parents, last)
        return self._forward(tokens, positions, all_parents, last)

    @torch.inference_mode()
    def fork(self, length: int) -> HFSequence | None:
        """The first `length` entries' keys and values copied into a new sequence; None after
        longrope's switch (those keys carry the long factors, a fresh shorter text's would not)."""
        self.check_fork(length)
        if self._long_rope:
            return None
        other = HFSequence(self.owner)
        for index, layer in enumerate(self._cache.layers):
            if length and getattr(layer, "keys", None) is not None and layer.keys.numel():
                other._cache.update(layer.keys[..., :length, :].clone(), layer.values[..., :length, :].clone(), index)
        self.share_entries(other, length)
        return other

    def crosses_rope_switch(self, positions: list[int]) -> bool:
        switch = self.owner.rope_switch
        return switch is not None and not self._long_rope and max(positions, default=0) >= switch

    def _forward(self, tokens: list[int], positions: list[int], all_parents: list[int],
                 last: int | None) -> torch.Tensor:
        owner, start = self.owner, self.cache_len
        ancestry = self.attends(all_parents, start, len(tokens))
        mask = (None if ancestry is None
                else owner.layer_masks(ancestry[None], torch.tensor([self._positions + positions]),
                                       torch.tensor([positions])))
        keep = {"logits_to_keep": last} if last and owner.takes_logits_to_keep else {}
        out = owner.model(
            input_ids=torch.tensor([tokens], device=owner.torch_device),
            position_ids=torch.tensor([positions], device=owner.torch_device),
            attention_mask=mask,
            use_cache=True,
            **{owner.cache_keyword: self._cache},
            **keep,
        )
        states = owner.taken_states()  # [1, n, hidden], or [1, last, hidden] with logits_to_keep; None while off
        self.commit(tokens, positions, all_parents)
        logits = out.logits[0, -last:] if last else out.logits[0]
        self.states = None if states is None else host_float(states[0, owner.state_rows(states.shape[1],
                                                                                      last or states.shape[1])])
        return owner.logits_out(logits)

    def attends(self, all_parents: list[int], start: int, n: int) -> torch.Tensor | None:
        """[n, start + n] bool: which entries each new entry attends to (its ancestors and itself);
        None when the new entries continue a chain (the model's causal mask is the same)."""
        if self.continues_chain(all_parents, start, n):
            return None
        return tree.ancestry(all_parents, self._trunk, start, n)

    def continues_chain(self, all_parents: list[int], start: int, n: int) -> bool:
        """Whether the n new entries after `start` continue the cache's chain, each after the one before."""
        return self._trunk == start and all(all_parents[start + j] == start + j - 1 for j in range(n))

    def _forward_recomputing_cache(self, tokens, positions, all_parents, last) -> torch.Tensor:
        """The first forward past longrope's switch: feed the cached tokens again with the new
        ones, so that every key is computed with the long factors, as Hugging Face does."""
        old = self.cache_len
        if self._trunk != old:
            raise ValueError("the cache must hold plain text (no tree nodes) when the context crosses the RoPE switch")
        cached, cached_positions = self._tokens, self._positions
        self.__init__(self.owner)
        self._long_rope = True
        logits = self._forward(cached + tokens, cached_positions + positions, all_parents, last)
        if not last:
            self.states = None if self.states is None else self.states[old:]
        return logits if last else logits[old:]

    @torch.inference_mode()
    def keep(self, start: int, indices: list[int]) -> None:
        """Keep the first `start` entries, then the entries at `indices` (each >= start), moved
        to contiguous slots in the given order (tree compaction: the accepted path stays)."""
        indices = self.kept_path(start, indices)
        end = start + len(indices)
        moved = indices != list(range(start, end))  # a chain's path is already in place
        index = torch.tensor(indices, dtype=torch.long)
        device = self.owner.torch_device
        for layer in self._cache.layers:
            if getattr(layer, "keys", None) is None or not layer.keys.numel():
                continue
            if moved:
                layer.keys[..., start:end, :] = layer.keys.index_select(-2, index.to(device))
                layer.values[..., start:end, :] = layer.values.index_select(-2, index.to(device))
            layer.keys, layer.values = layer.keys[..., :end, :], layer.values[..., :end, :]
        self.keep_entries(start, indices)
        self._long_rope = self._long_rope and end > 0  # an emptied cache starts short again, as after reset()

    def cache_tensors(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(keys, values) per layer, [batch, heads, cache_len, head_dim]: for tests and tools."""
        return [(layer.keys, layer.values) for layer in self._cache.layers]


class _StackedLayer(DynamicLayer):
    """One layer's cache for a batched forward: every row's cached keys and values (a DynamicLayer
    of its sequence, or None when empty), left-padded with zeros to `width`. `update` writes the
    whole batch, cached entries then the new ones, into one tensor [batch, heads, width + new, dim]."""

    def __init__(self, rows: list[DynamicLayer | None], width: int):
        super().__init__()
        self.rows, self.width = rows, width

    def get_seq_length(self) -> int:
        return self.width

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.keys = self._stack("keys", key_states)
        self.values = self._stack("values", value_states)
        self.is_initialized, self.dtype, self.device = True, key_states.dtype, key_states.device
        return self.keys, self.values

    def _stack(self, kind: str, new: torch.Tensor) -> torch.Tensor:
        batch, heads, count, dim = new.shape
        out = new.new_zeros(batch, heads, self.width + count, dim)  # zeros: padding keys must be finite under a mask
        for r, row in enumerate(self.rows):
            if row is not None:
                cached = getattr(row, kind)
                out[r, :, self.width - cached.shape[-2] : self.width] = cached[0]
        out[:, :, self.width :] = new
        return out


# How far a 2-node tree's logits may be from its paths', relative to the logits' scale. Loose for
# float64 because some models keep float32 internals (RoPE tables, norms) in float64 runs; an ignored
# mask or a wrong position moves logits by O(1).
TREE_CHECK_TOLERANCE = {torch.float64: 1e-5, torch.float32: 1e-4, torch.float16: 3e-2, torch.bfloat16: 3e-2}


def named_tree_refusal(config) -> str | None:
    """Position schemes and attention code that a token tree cannot be fed through exactly."""
    if getattr(config, "alibi", False) or config.model_type in ("bloom", "mpt"):
        return "ALiBi: the position bias is built from cache slots, not from each node's position"
    if config.model_type == "gpt_neo" and "local" in (getattr(config, "attention_layers", None) or []):
        return "its local-attention window is applied by cache slot, not by position"
    implementation = getattr(config, "_attn_implementation", None) or ""
    if implementation.startswith("flash") or "flash_attention" in implementation:
        return f"{implementation} takes no arbitrary attention mask"
    return None


def as_float(rows: torch.Tensor) -> torch.Tensor:
    """Rows of logits or states as returned: float32 (float64 kept)."""
    return rows.to(torch.float64 if rows.dtype == torch.float64 else torch.float32)


def host_float(rows: torch.Tensor) -> torch.Tensor:
    return as_float(rows).cpu()


def _decoder_layers(model) -> list:
    """The model's decoder layers, in order: the longest ModuleList of its layers' count (an empty list
    where none is found: its states are then the final norm's only)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    count = getattr(config, "num_hidden_layers", None)
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == count:
            return list(module)
    return []


def _is_matrix_head(head) -> bool:
    """An output layer whose input is the states: a module multiplying them by a [vocab, hidden] weight."""
    return isinstance(head, torch.nn.Module) and getattr(head, "weight", None) is not None and head.weight.dim() == 2


def _stop_token_ids(model, tokenizer) -> frozenset[int]:
    """EOS ids from the tokenizer and the generation config."""
    ids = {tokenizer.eos_token_id}
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(configured if isinstance(configured, list) else [configured])
    return frozenset(i for i in ids if i is not None)


def _rope_parameters(config) -> list[dict]:
    """The RoPE settings of every layer type (transformers 5 may nest them per layer type)."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if isinstance(rope, dict) and rope and all(isinstance(v, dict) for v in rope.values()):
        return list(rope.values())
    return [rope] if isinstance(rope, dict) else []


def longrope_switch(config) -> int | None:
    """The first position longrope runs on its long factors, or None (no longrope)."""
    for rope in _rope_parameters(config):
        if rope.get("rope_type", rope.get("type")) == "longrope":
            original = (rope.get("original_max_position_embeddings")
                        or getattr(config, "original_max_position_embeddings", None))
            return int(original) if original else None
    return None


def _context_length(config) -> int:
    """The context specdec may fill: the model's, or for dynamic NTK RoPE its original length
    (beyond it the frequencies depend on how tokens are grouped into forwards, so no speculative
    step could match plain decoding)."""
    for rope in _rope_parameters(config):
        if "dynamic" in str(rope.get("rope_type", rope.get("type", ""))):
            original = rope.get("original_max_position_embeddings") or getattr(config, "max_position_embeddings", None)
            if original:
                return int(original)
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "max_seq_len"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 2048


def avoid_cudnn_attention() -> None:
    """Keep scaled_dot_product_attention off cuDNN's kernel (process-wide). cuDNN builds an execution
    plan for every new shape, and decoding with a growing cache shows it a new key length at every
    token: the plans, not the kernels, then took most of the eager path's time per token (issue 31's
    profile). Flash and memory-efficient attention need no plan."""
    torch.backends.cuda.enable_cudnn_sdp(False)
