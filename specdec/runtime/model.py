"""A local Hugging Face causal LM with a KV cache that only its caller moves.

`CausalLM.forward` feeds new tokens at explicit positions, optionally under an attention mask over
cached + new tokens (a token tree); `truncate` and `keep` edit the cache. That is everything the engine needs, so
tree attention or another runtime can slot in behind the same four methods.

Exactness across architectures (each point is a way a well-known implementation went wrong):
- A tree mask is handed to the model as an additive float mask (0 where a token may attend, the
  dtype's minimum elsewhere): eager attention adds the mask to the scores, so a boolean mask there
  would mask nothing; sdpa and flex attention read the additive form the same way.
- Whether trees are exact on a model is checked once, on first use, by `tree_refusal`: known
  position schemes that trees cannot follow are refused by name, then a 2-node tree must give
  each node the logits of its own path computed alone.
- RoPE that depends on the sequence length: "longrope" (Phi-3) switches every position to its long
  factors once the sequence passes `original_max_position_embeddings`, and Hugging Face recomputes
  the whole cache at that moment; so does `forward`, and `verify_room` keeps one forward from
  straddling the switch. "dynamic" NTK scaling depends on how tokens are grouped into forwards, so
  the context is capped at the original length instead.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DynamicCache

from specdec import tree
from specdec.errors import SpecDecError
from specdec.runtime.cpu_matmul import use_small_batch_matmul

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


class CausalLM:
    """One model, one sequence, one KV cache.

    Invariant: the cache holds exactly `cache_len` entries, entry i for the token fed at the i-th
    slot; logits come back restricted to the tokenizer's real vocabulary (padding rows dropped).
    """

    def __init__(self, model, tokenizer, path: str = ""):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.path = path
        self.vocab_size = len(tokenizer)
        rows = model.get_output_embeddings().weight.shape[0]
        if rows < self.vocab_size:
            raise SpecDecError(
                f"{path}: the model has {rows} output rows but its tokenizer has {self.vocab_size} tokens"
            )
        self.max_length = _context_length(model.config)
        self.rope_switch = _longrope_switch(model.config)  # None, or the first position that runs long factors
        self._device = model.device  # fixed: the model is moved before it is wrapped (HF's property is slow)
        self.weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        self._tree_refusal: str | None = _UNCHECKED  # see tree_refusal()
        self.reset()

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def cache_len(self) -> int:
        return self._cache.get_seq_length()

    def reset(self) -> None:
        # Plain full layers, even for sliding-window models: the window is applied by the attention
        # mask, and a full layer can be cut back exactly (a sliding layer's counters cannot).
        self._cache = DynamicCache()
        self._slot_positions = torch.zeros(0, dtype=torch.long)  # the position each cache entry was fed at
        self._slot_tokens = torch.zeros(0, dtype=torch.long)  # the token each cache entry was fed
        self._long_rope = False  # the cache was computed with longrope's long factors

    @property
    def attn_implementation(self) -> str:
        return getattr(self.model.config, "_attn_implementation", None) or "eager"

    def describe(self) -> str:
        return f"{self.path} ({self.model.config.model_type}, {self.attn_implementation} attention)"

    def verify_room(self, root_position: int) -> int:
        """How many positions after `root_position` may be fed in one forward with it.

        The context bounds it; with longrope, so does the switch: a forward that reaches it runs
        every position on the long factors, so nodes before the switch must not share it."""
        room = self.max_length - 1 - root_position
        if self.rope_switch is not None and root_position < self.rope_switch:
            room = min(room, self.rope_switch - 1 - root_position)
        return max(room, 0)

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor | list[int],  # [n]
        positions: torch.Tensor | None = None,  # [n]; default: cache_len, cache_len + 1, ...
        attention_mask: torch.Tensor | None = None,  # [n, cache_len + n] bool, True = may attend; default causal
    ) -> torch.Tensor:
        """Append the new tokens to the cache and return their next-token logits: [n, vocab] on the CPU."""
        tokens = torch.as_tensor(tokens, dtype=torch.long).reshape(-1).cpu()
        n, start = tokens.numel(), self.cache_len
        if positions is None:
            positions = torch.arange(start, start + n)
        positions = positions.cpu()
        if int(positions.max()) >= self.max_length:
            raise SpecDecError(f"position {int(positions.max())} is beyond the model's context of {self.max_length}")
        if start + n > self.max_length:  # some models keep buffers sized to the context, indexed by slot
            raise SpecDecError(f"{n} new tokens after {start} cached ones overflow the model's context of {self.max_length}")
        if attention_mask is not None and attention_mask.shape != (n, start + n):
            raise ValueError(f"attention_mask must be [{n}, {start + n}], got {list(attention_mask.shape)}")
        if self.rope_switch is not None and not self._long_rope and int(positions.max()) >= self.rope_switch:
            return self._forward_recomputing_cache(tokens, positions, attention_mask)
        return self._forward(tokens, positions, attention_mask)

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        mask = None
        if attention_mask is not None:
            mask = self._layer_masks(attention_mask, torch.cat([self._slot_positions, positions]), positions)
        out = self.model(
            input_ids=tokens.to(self.device)[None],
            position_ids=positions.to(self.device)[None],
            attention_mask=mask,
            past_key_values=self._cache,
            use_cache=True,
        )
        self._slot_positions = torch.cat([self._slot_positions, positions])
        self._slot_tokens = torch.cat([self._slot_tokens, tokens])
        logits = out.logits[0, :, : self.vocab_size]
        return logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32).cpu()

    def _forward_recomputing_cache(self, tokens, positions, attention_mask) -> torch.Tensor:
        """The first forward past longrope's switch: feed the cached tokens again with the new
        ones, so that every key is computed with the long factors, as Hugging Face does."""
        cached, cached_positions = self._slot_tokens, self._slot_positions
        old = cached.numel()
        if not torch.equal(cached_positions, torch.arange(old)):
            raise ValueError("the cache must hold plain text (no tree nodes) when the context crosses the RoPE switch")
        if attention_mask is not None:
            full = torch.ones(old + tokens.numel(), old + tokens.numel(), dtype=torch.bool).tril()
            full[old:] = attention_mask
            attention_mask = full
        self.reset()
        self._long_rope = True
        return self._forward(torch.cat([cached, tokens]), torch.cat([cached_positions, positions]), attention_mask)[old:]

    def _layer_masks(self, mask: torch.Tensor, key_positions: torch.Tensor, positions: torch.Tensor):
        """An explicit mask replaces the model's own, so apply its sliding window here: a query at
        position p sees keys at positions > p - window. Models mixing full and sliding layers get
        one mask per layer type. Keys are placed by the positions they were fed at: while a tree
        is in the cache, an entry's slot is not its position."""
        window = self.sliding_window
        if window is not None:
            windowed = mask & (key_positions[None, :] > positions[:, None] - window)
            if "full_attention" in (getattr(self.model.config, "layer_types", None) or []):
                return {"full_attention": self._additive(mask), "sliding_attention": self._additive(windowed)}
            mask = windowed
        return self._additive(mask)

    def _additive(self, mask: torch.Tensor) -> torch.Tensor:
        """[n, keys] bool -> [1, 1, n, keys] float: 0 where a token may attend, the dtype's minimum
        elsewhere. Every attention implementation adds a float mask to its scores; eager attention
        would add a boolean one too (True as 1), masking nothing."""
        dtype = self.dtype
        additive = torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, torch.finfo(dtype).min)
        return additive.to(self.device)[None, None]

    def tree_refusal(self) -> str | None:
        """Why token trees cannot be scored exactly on this model, or None when they can.

        Checked once per model: position schemes trees cannot follow are refused by name; then a
        2-node tree (two siblings below a prefix) must give each node the logits of its own path
        computed alone, within the dtype's rounding. Costs three tiny forwards."""
        if self._tree_refusal is _UNCHECKED:
            self._tree_refusal = _known_tree_refusal(self.model.config) or self._two_node_tree_check()
            self.reset()
        return self._tree_refusal

    def require_trees(self) -> None:
        reason = self.tree_refusal()
        if reason is not None:
            raise SpecDecError(f"{self.describe()} does not support token trees ({reason}); use a chain")

    def _two_node_tree_check(self) -> str | None:
        prefix = [i % self.vocab_size for i in (1, 2, 3)]
        siblings = [4 % self.vocab_size, 5 % self.vocab_size]
        try:
            self.reset()
            self.forward(prefix[:-1])
            # the engine's own layout: the root (last prefix token) and two children below it
            positions, mask = tree.tree_inputs(torch.tensor([-1, 0, 0]), len(prefix) - 1, new=3)
            tree_logits = self.forward([prefix[-1], *siblings], positions, mask)[1:]
            alone = []
            for token in siblings:
                self.reset()
                alone.append(self.forward(prefix + [token])[-1])
            self.reset()
            leaked = self.forward(prefix + siblings)[-1]  # the second sibling seeing the first: what a broken mask gives
        except Exception as error:  # a model whose attention cannot take the mask at all
            return f"a 2-node tree failed: {type(error).__name__}: {' '.join(str(error).split())[:200]}"
        alone = torch.stack(alone)
        error = float((tree_logits - alone).abs().max())
        # within the dtype's rounding, and far closer than a leak would be (16-bit rounding is coarse)
        tolerance = min(TREE_CHECK_TOLERANCE[self.dtype] * max(1.0, float(alone.abs().max())),
                        0.25 * float((leaked - alone[1]).abs().max()))
        if not error <= tolerance:
            return f"a 2-node tree's logits differ from its paths computed alone by {error:.3g} (> {tolerance:.3g})"
        return None

    @property
    def sliding_window(self) -> int | None:
        config = self.model.config
        if not getattr(config, "use_sliding_window", True):
            return None
        window = getattr(config, "sliding_window", None)
        return window if isinstance(window, int) and window > 0 else None

    def truncate(self, length: int) -> None:
        """Keep the first `length` cache entries."""
        if not 0 <= length <= self.cache_len:
            raise ValueError(f"cannot truncate a cache of {self.cache_len} entries to {length}")
        self.keep(length, [])

    @torch.inference_mode()
    def keep(self, start: int, indices: list[int]) -> None:
        """Keep the first `start` entries, then the entries at `indices` (each >= start), moved
        to contiguous slots in the given order (tree compaction: the accepted path stays)."""
        if not 0 <= start <= self.cache_len or any(not start <= i < self.cache_len for i in indices):
            raise ValueError(f"cannot keep entries {indices} after {start} of a cache of {self.cache_len}")
        end = start + len(indices)
        moved = indices != list(range(start, end))  # a chain's path is already in place
        index = torch.tensor(indices, dtype=torch.long)
        for layer in self._cache.layers:
            if getattr(layer, "keys", None) is None or not layer.keys.numel():
                continue
            if moved:
                layer.keys[..., start:end, :] = layer.keys.index_select(-2, index.to(self.device))
                layer.values[..., start:end, :] = layer.values.index_select(-2, index.to(self.device))
            layer.keys, layer.values = layer.keys[..., :end, :], layer.values[..., :end, :]
        self._slot_positions = torch.cat([self._slot_positions[:start], self._slot_positions[index]])
        self._slot_tokens = torch.cat([self._slot_tokens[:start], self._slot_tokens[index]])
        self._long_rope = self._long_rope and end > 0  # an emptied cache starts short again, as after reset()

    def cache_tensors(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(keys, values) per layer, [batch, heads, cache_len, head_dim]: for tests and tools."""
        return [(layer.keys, layer.values) for layer in self._cache.layers]


_UNCHECKED = "unchecked"  # tree_refusal not computed yet (None means: trees are fine)
# How far a 2-node tree's logits may be from its paths', relative to the logits' scale. Loose for
# float64 because some models keep float32 internals (RoPE tables, norms) in float64 runs; an ignored
# mask or a wrong position moves logits by O(1).
TREE_CHECK_TOLERANCE = {torch.float64: 1e-5, torch.float32: 1e-4, torch.float16: 3e-2, torch.bfloat16: 3e-2}


def _known_tree_refusal(config) -> str | None:
    """Position schemes and attention code that a token tree cannot be fed through exactly."""
    if getattr(config, "alibi", False) or config.model_type in ("bloom", "mpt"):
        return "ALiBi: the position bias is built from cache slots, not from each node's position"
    if config.model_type == "gpt_neo" and "local" in (getattr(config, "attention_layers", None) or []):
        return "its local-attention window is applied by cache slot, not by position"
    implementation = getattr(config, "_attn_implementation", None) or ""
    if implementation.startswith("flash") or "flash_attention" in implementation:
        return f"{implementation} takes no arbitrary attention mask"
    return None


def _rope_parameters(config) -> list[dict]:
    """The RoPE settings of every layer type (transformers 5 may nest them per layer type)."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if isinstance(rope, dict) and rope and all(isinstance(v, dict) for v in rope.values()):
        return list(rope.values())
    return [rope] if isinstance(rope, dict) else []


def _longrope_switch(config) -> int | None:
    for rope in _rope_parameters(config):
        if rope.get("rope_type", rope.get("type")) == "longrope":
            original = rope.get("original_max_position_embeddings") or getattr(config, "original_max_position_embeddings", None)
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


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def check_device(device: str) -> str:
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError) as error:
        raise SpecDecError(f"unknown device {device!r}; use cpu, cuda or cuda:N") from error
    if kind == "cuda" and not torch.cuda.is_available():
        raise SpecDecError(f"device {device!r} was asked for but this torch build sees no CUDA device")
    if kind not in ("cpu", "cuda"):
        raise SpecDecError(f"device {device!r} is not supported; use cpu, cuda or cuda:N")
    return device


def resolve_dtype(dtype: str | torch.dtype | None, device: str) -> torch.dtype:
    """float32 on CPU unless asked; bfloat16 on CUDA unless asked."""
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise SpecDecError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def load_model(
    path: str | os.PathLike, device: str | None = None, dtype: str | torch.dtype | None = None,
    attn_implementation: str | None = None,
) -> CausalLM:
    """Load a local checkpoint directory: config.json, *.safetensors, tokenizer files.

    Never downloads, never runs remote code, never unpickles: `.bin` weights are refused.
    attn_implementation: "eager", "sdpa", "flex_attention" ... (default: what transformers picks).
    """
    path = Path(path).expanduser()
    device = check_device(device or default_device())
    _check_checkpoint_dir(path)
    torch_dtype = resolve_dtype(dtype, device)
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
        model, info = AutoModelForCausalLM.from_pretrained(
            path,
            config=config,
            dtype=torch_dtype,
            use_safetensors=True,
            local_files_only=True,
            trust_remote_code=False,
            output_loading_info=True,
            **({"attn_implementation": attn_implementation} if attn_implementation else {}),
            # grouped-matmul expert kernels (MoE) take no float64: the reference loop does
            **({"experts_implementation": "eager"} if torch_dtype == torch.float64 else {}),
        )
    except Exception as error:  # a corrupt or incomplete checkpoint: say which and why
        message = " ".join(str(error).split())  # one line, whatever the library printed
        raise SpecDecError(f"could not load the model in {path}: {type(error).__name__}: {message}") from error
    missing = sorted(info.get("missing_keys") or [])
    if missing:  # transformers would fill them with random values and only log it
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise SpecDecError(f"{path}: the safetensors files lack weights {', '.join(missing[:3])}{more}")
    if torch.device(device).type == "cpu":
        use_small_batch_matmul(model)
    return CausalLM(model.to(device), tokenizer, str(path))


def _check_checkpoint_dir(path: Path) -> None:
    if not path.is_dir():
        raise SpecDecError(f"model directory not found: {path}")
    if not (path / "config.json").is_file():
        raise SpecDecError(f"{path} has no config.json; is it a Hugging Face checkpoint directory?")
    try:
        json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as error:
        raise SpecDecError(f"{path / 'config.json'} is not valid JSON: {error}") from error
    if not any(path.glob("*.safetensors")):
        pickled = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
        hint = f" (found {', '.join(pickled)}: pickled weights are never loaded; convert them to safetensors)" if pickled else ""
        raise SpecDecError(f"{path} has no .safetensors weights{hint}")
    if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")):
        raise SpecDecError(f"{path} has no tokenizer files (tokenizer.json or tokenizer_config.json)")
