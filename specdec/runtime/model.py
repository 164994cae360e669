"""A local Hugging Face causal LM with a KV cache that only its caller moves.

`CausalLM.forward` feeds new tokens at explicit positions, optionally under an attention mask over
cached + new tokens (a token tree); `truncate` and `keep` edit the cache. That is everything the engine needs, so
tree attention or another runtime can slot in behind the same four methods.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DynamicCache

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
        self._device = model.device  # fixed: the model is moved before it is wrapped (HF's property is slow)
        self.weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
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

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor | list[int],  # [n]
        positions: torch.Tensor | None = None,  # [n]; default: cache_len, cache_len + 1, ...
        attention_mask: torch.Tensor | None = None,  # [n, cache_len + n] bool, True = may attend; default causal
    ) -> torch.Tensor:
        """Append the new tokens to the cache and return their next-token logits: [n, vocab] on the CPU."""
        tokens = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
        n, start = tokens.numel(), self.cache_len
        if positions is None:
            positions = torch.arange(start, start + n)
        if int(positions.max()) >= self.max_length:
            raise SpecDecError(f"position {int(positions.max())} is beyond the model's context of {self.max_length}")
        mask = None
        if attention_mask is not None:
            if attention_mask.shape != (n, start + n):
                raise ValueError(f"attention_mask must be [{n}, {start + n}], got {list(attention_mask.shape)}")
            mask = self._layer_masks(attention_mask, torch.cat([self._slot_positions, positions]), positions)
        out = self.model(
            input_ids=tokens.to(self.device)[None],
            position_ids=positions.to(self.device)[None],
            attention_mask=mask,
            past_key_values=self._cache,
            use_cache=True,
        )
        self._slot_positions = torch.cat([self._slot_positions, positions.cpu()])
        logits = out.logits[0, :, : self.vocab_size]
        return logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32).cpu()

    def _layer_masks(self, mask: torch.Tensor, key_positions: torch.Tensor, positions: torch.Tensor):
        """An explicit mask replaces the model's own, so apply its sliding window here: a query at
        position p sees keys at positions > p - window. Models mixing full and sliding layers get
        one mask per layer type. Keys are placed by the positions they were fed at: while a tree
        is in the cache, an entry's slot is not its position."""
        window = self.sliding_window
        if window is not None:
            windowed = mask & (key_positions[None, :] > positions[:, None] - window)
            if "full_attention" in (getattr(self.model.config, "layer_types", None) or []):
                return {"full_attention": mask.to(self.device)[None, None], "sliding_attention": windowed.to(self.device)[None, None]}
            mask = windowed
        return mask.to(self.device)[None, None]

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

    def cache_tensors(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(keys, values) per layer, [batch, heads, cache_len, head_dim]: for tests and tools."""
        return [(layer.keys, layer.values) for layer in self._cache.layers]


def _context_length(config) -> int:
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
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


def load_model(path: str | os.PathLike, device: str | None = None, dtype: str | torch.dtype | None = None) -> CausalLM:
    """Load a local checkpoint directory: config.json, *.safetensors, tokenizer files.

    Never downloads, never runs remote code, never unpickles: `.bin` weights are refused.
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
