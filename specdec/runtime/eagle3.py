"""An EAGLE-3 draft head (Li et al. 2025) behind the runtime protocol, loaded from the layouts heads
are published in.

The target's residual stream is read at three depths (the states entering decoder layers
`layers`, by default 2, L // 2 and L - 3 of an L-layer target) and fused by one linear layer (`fc`)
into a feature f_t per committed position t. One decoder layer then runs over the head's own cache:
the entry for the token at position t reads (the token's input embedding, the feature at t - 1) and
attends to its ancestors' entries; its output, normed and multiplied by `lm_head`, scores the next
token over a draft vocabulary (draft id d is target id d + d2t[d]). A draft node's children read
the node's own output before the norm in place of a feature, as EAGLE-3 drafts.

    residual = f if not norm_before_residual else hidden_norm(f)
    x = [input_layernorm(embed(token)), hidden_norm(f)]          # 2 * hidden wide
    residual = o_proj(attention(q_proj x, k_proj x, v_proj x)) + residual
    out = mlp(post_attention_layernorm(residual)) + residual      # what a child reads
    logits = lm_head(norm(out))

Invariants of a sequence (`Eagle3Sequence`): an entry's keys and values depend on its own input
alone (one layer), so a tree costs nothing to fork or roll back; an entry whose input was the head's
own guess is recomputed from the target's feature once that is known and the entry is committed
text; an entry with no feature at its parent (position 0, or a prompt prefix the target took from
its prefix cache without computing states) is never attended to. Logits come in the draft's own
columns (`columns`: their target ids), as a pruned draft's do.

Layouts (`read_config`): EAGLE-3 / SpecForge (`architectures: ["LlamaForCausalLMEagle3"]`, tensors
under `midlayer.`) and Red Hat's speculators (`speculators_model_type: "eagle3"`, the layer's
settings in `transformer_layer_config`, tensors under `layers.0.`).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from specdec import tree
from specdec.errors import SpecDecError
from specdec.runtime import base, cpu_head
from specdec.runtime.entries import SequenceEntries
from specdec.runtime.head import RMSNorm, inference_dtype, one_thread

KEPT_STATES = 4096  # positions whose target states a sequence keeps (a default drafter feeds its head lazily)


@dataclass(frozen=True)
class Eagle3Config:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    draft_vocab: int
    target_vocab: int
    target_hidden: int
    rms_eps: float
    rope: dict  # what transformers' rotary embedding reads: rope_theta, rope_scaling, max_position_embeddings
    layers: tuple[int, ...] | None  # the target layers whose inputs are read; None: the default for the target
    norm_before_residual: bool = False
    layout: str = "eagle3"  # "eagle3" (EAGLE-3, SpecForge) or "speculators"

    def aux_layers(self, target_layers: int) -> tuple[int, ...]:
        return self.layers if self.layers is not None else (2, target_layers // 2, target_layers - 3)


def is_eagle3(path: str | Path) -> bool:
    """A directory with an EAGLE-3 head's config.json (either published layout)."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    try:
        raw = json.loads(config.read_text())
    except (OSError, ValueError):
        return False
    return _layout(raw) is not None


def _layout(raw: dict) -> str | None:
    if raw.get("speculators_model_type") == "eagle3":
        return "speculators"
    if any("eagle3" in str(name).lower() for name in raw.get("architectures") or ()):
        return "eagle3"
    return None


def read_config(directory: str | Path) -> Eagle3Config:
    """The head's shape from its config.json, in either layout."""
    path = Path(directory) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise SpecDecError(f"{directory}: not an EAGLE-3 head ({error})") from error
    layout = _layout(raw)
    if layout is None:
        raise SpecDecError(f"{path}: neither an EAGLE-3 config (architectures LlamaForCausalLMEagle3) nor a "
                           "speculators one (speculators_model_type eagle3)")
    layer = raw.get("transformer_layer_config") or {} if layout == "speculators" else raw
    eagle = raw.get("eagle_config") or {}
    try:
        hidden, heads = int(layer["hidden_size"]), int(layer["num_attention_heads"])
        layers = raw.get("eagle_aux_hidden_state_layer_ids", eagle.get("eagle_aux_hidden_state_layer_ids"))
        return Eagle3Config(
            hidden=hidden, heads=heads, kv_heads=int(layer.get("num_key_value_heads") or heads),
            head_dim=int(layer.get("head_dim") or hidden // heads), intermediate=int(layer["intermediate_size"]),
            draft_vocab=int(raw.get("draft_vocab_size") or layer.get("draft_vocab_size") or layer["vocab_size"]),
            target_vocab=int(layer["vocab_size"]), target_hidden=int(raw.get("target_hidden_size") or hidden),
            rms_eps=float(layer.get("rms_norm_eps", 1e-6)),
            rope={"rope_theta": float(layer.get("rope_theta", 10000.0)), "rope_scaling": layer.get("rope_scaling"),
                  "max_position_embeddings": int(layer.get("max_position_embeddings", 2048))},
            layers=None if not layers else tuple(int(i) for i in layers),
            norm_before_residual=bool(raw.get("norm_before_residual", False)), layout=layout)
    except (KeyError, TypeError, ValueError) as error:
        raise SpecDecError(f"{path}: an EAGLE-3 config without a usable {error}") from error


class Attention(nn.Module):
    def __init__(self, config: Eagle3Config):
        super().__init__()
        width, d = 2 * config.hidden, config.head_dim
        self.heads, self.kv_heads, self.head_dim = config.heads, config.kv_heads, d
        self.q_proj = nn.Linear(width, config.heads * d, bias=False)
        self.k_proj = nn.Linear(width, config.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(width, config.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(config.heads * d, config.hidden, bias=False)


class MLP(nn.Module):
    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden, config.rms_eps)
        self.hidden_norm = RMSNorm(config.hidden, config.rms_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden, config.rms_eps)
        self.mlp = MLP(config.hidden, config.intermediate)


class Eagle3Net(nn.Module):
    """The head's weights, named as published (`midlayer.` for either layout once loaded), and its math
    as pure functions of tensors: `inputs` (keys, values and what attention adds to), `outputs`."""

    def __init__(self, config: Eagle3Config, embeddings: torch.Tensor):
        super().__init__()
        self.config = config
        # [target vocab, hidden]: the target's (not saved with the head), or the head's own
        self.register_buffer("embed_tokens", embeddings, persistent=False)
        self.fc = nn.Linear(3 * config.target_hidden, config.hidden, bias=False)
        self.midlayer = MidLayer(config)
        self.norm = RMSNorm(config.hidden, config.rms_eps)
        self.lm_head = nn.Linear(config.hidden, config.draft_vocab, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab, dtype=torch.long))
        self.rotary = _rotary(config)

    @property
    def dtype(self) -> torch.dtype:
        """What it computes in (its norms' weights, never quantized)."""
        return self.norm.weight.dtype

    def placed(self, device: torch.device, dtype: torch.dtype) -> Eagle3Net:
        """Itself on `device`, computing in `dtype`, its rotary frequencies kept in float32 as transformers
        keeps a model's (rounded to bfloat16 they are off by up to 0.4%, 1.8e-3 at most: a position's angle by radians
        within a few thousand positions, unlike the head's training in float32)."""
        frequencies = {name: buffer.detach().clone().float() for name, buffer in self.rotary.named_buffers()}
        self.to(device=device, dtype=dtype)
        for name, buffer in frequencies.items():
            setattr(self.rotary, name, buffer.to(device))
        return self

    def fuse(self, states: torch.Tensor) -> torch.Tensor:
        """[n, 3 * target hidden] states at the target's three layers -> [n, hidden] features."""
        return self.fc(states.to(self.dtype))

    def inputs(self, tokens: torch.Tensor, features: torch.Tensor, positions: torch.Tensor):
        """Entries' (target ids [n], features or parents' outputs [n, hidden], positions [n]) ->
        (keys, values [n, kv heads, head dim], queries [n, heads, head dim], residuals [n, hidden])."""
        layer, config = self.midlayer, self.config
        if config.norm_before_residual:
            features = layer.hidden_norm(features)
            residual = features
        else:
            residual, features = features, layer.hidden_norm(features)
        x = torch.cat([layer.input_layernorm(self.embed_tokens[tokens].to(features.dtype)), features], dim=-1)
        attention, n = layer.self_attn, len(tokens)
        cos, sin = self.rotary(x[None], positions[None])
        queries = _rotate(attention.q_proj(x).view(n, attention.heads, -1), cos[0], sin[0])
        keys = _rotate(attention.k_proj(x).view(n, attention.kv_heads, -1), cos[0], sin[0])
        return keys, attention.v_proj(x).view(n, attention.kv_heads, -1), queries, residual

    def outputs(self, queries, residual, keys, values, allowed) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries [n, heads, d] over keys and values [m, kv heads, d] where `allowed` [n, m] ->
        (logits [n, draft vocab], outputs before the final norm [n, hidden]: what children read)."""
        attended = nn.functional.scaled_dot_product_attention(
            queries.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
            attn_mask=allowed[None, None], enable_gqa=True)[0].transpose(0, 1)  # [n, heads, d]
        attended = attended.nan_to_num(0.0)  # a row with no key to attend to: nothing
        return self.finish(attended.reshape(len(queries), -1), residual)

    def finish(self, attended: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention's output [..., heads * d] and the residual [..., hidden] -> (logits, output before the norm)."""
        layer = self.midlayer
        residual = layer.self_attn.o_proj(attended) + residual
        out = layer.mlp(layer.post_attention_layernorm(residual)) + residual
        return self.lm_head(self.norm(out)), out


def _rotary(config: Eagle3Config):
    """transformers' Llama rotary embedding for the head's settings (llama3 and other scalings included)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    llama = LlamaConfig(hidden_size=config.hidden, num_attention_heads=config.heads,
                        num_key_value_heads=config.kv_heads, head_dim=config.head_dim, **{
                            k: v for k, v in config.rope.items() if v is not None})
    try:
        return LlamaRotaryEmbedding(llama)
    except (KeyError, ValueError, TypeError) as error:
        raise SpecDecError(f"an EAGLE-3 head with rope settings transformers does not take: {config.rope} "
                           f"({error})") from error


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on [n, heads, d] with cos and sin [n, d] (the rotate-half convention Llama uses)."""
    cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


# ---------------------------------------------------------------- loading

def load_eagle3(directory: str | Path, target: base.CausalLM) -> Eagle3Model:
    """The head in `directory` for `target`, checked against it (shapes, vocabulary, layers). It computes
    on a torch target's device (a GPU's too: on the host a level of an 8B target's head would cost
    several of the target's steps) in its own precision, and beside llama.cpp on the CPU in bfloat16
    where the CPU multiplies it natively (a draft level then reads half the bytes), else float32."""
    directory = Path(directory)
    dtype = getattr(target, "torch_dtype", None) or inference_dtype()
    config = read_config(directory)
    weights = _read_weights(directory)
    layers = config.aux_layers(_target_layers(target))
    _check_fits(config, weights, target, layers, directory)
    embeddings = weights.pop("embed_tokens.weight", None)
    if embeddings is None:  # the target's own tensor where it computes in the head's precision: no second copy
        embeddings = target.input_embeddings(torch.device(target.device), dtype)
        if embeddings is None or embeddings.shape[0] < target.vocab_size or embeddings.shape[1] != config.hidden:
            raise SpecDecError(f"the EAGLE-3 head {directory} has no embed_tokens of its own and the target's input "
                               f"embeddings are {None if embeddings is None else list(embeddings.shape)}, not "
                               f"[{target.vocab_size}, {config.hidden}]")
    net = Eagle3Net(config, embeddings.to(dtype))
    weights.pop("t2d", None)
    try:
        missing, unexpected = net.load_state_dict(weights, strict=False)
    except RuntimeError as error:
        raise SpecDecError(f"the EAGLE-3 head {directory}: {' '.join(str(error).split())[:400]}") from error
    missing = [name for name in missing if not name.startswith("rotary.")]
    if missing or unexpected:
        raise SpecDecError(f"the EAGLE-3 head {directory}: tensors missing {missing or 'none'}, "
                           f"not understood {unexpected or 'none'}")
    model = Eagle3Model(net.eval(), target, layers, str(directory), dtype=dtype)
    if target.backend == "llamacpp":  # beside llama.cpp, on the CPU: its matrices in Q8_0 where the kernel runs
        model.quantize()
    return model


def _read_weights(directory: Path) -> dict[str, torch.Tensor]:
    """Every safetensors file's tensors, named as `Eagle3Net` names them."""
    from safetensors.torch import load_file

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise SpecDecError(f"the EAGLE-3 head {directory} has no .safetensors file")
    weights = {}
    for file in files:
        for name, tensor in load_file(str(file)).items():
            name = name.removeprefix("model.")
            name = "midlayer." + name.removeprefix("layers.0.") if name.startswith("layers.0.") else name
            weights[name] = tensor
    if "d2t" in weights:
        weights["d2t"] = weights["d2t"].long()
    return weights


def _target_layers(target: base.CausalLM) -> int:
    layers = getattr(target, "layer_count", None)
    if not layers:
        raise SpecDecError(f"an EAGLE-3 head reads the target's decoder layers; {target.describe()} does not give them")
    return layers


def _check_fits(config: Eagle3Config, weights: dict, target: base.CausalLM, layers: tuple[int, ...],
                directory: Path) -> None:
    """Refuse, saying which, a head whose shapes, vocabulary or layers do not fit the target."""
    where = f"the EAGLE-3 head {directory}"
    if len(set(layers)) != 3 or not all(1 <= i < target.layer_count for i in layers):
        raise SpecDecError(f"{where} reads the inputs of layers {list(layers)}; the target has {target.layer_count} "
                           "(three distinct layers from 1 on are needed: name them in its config's "
                           "eagle_aux_hidden_state_layer_ids)")
    if config.target_hidden != target.hidden_size:
        raise SpecDecError(f"{where} reads states {config.target_hidden} wide; the target's are "
                           f"{target.hidden_size}")
    if config.target_vocab != target.vocab_size and config.target_vocab != len(target.tokenizer):
        raise SpecDecError(f"{where} was made for a vocabulary of {config.target_vocab} tokens; the target has "
                           f"{target.vocab_size}")
    expected = {"fc.weight": (config.hidden, 3 * config.target_hidden),
                "lm_head.weight": (config.draft_vocab, config.hidden), "d2t": (config.draft_vocab,)}
    for name, shape in expected.items():
        if name not in weights:
            raise SpecDecError(f"{where} has no {name}")
        if tuple(weights[name].shape) != shape:
            raise SpecDecError(f"{where}: {name} is {list(weights[name].shape)}, its config says {list(shape)}")
    target_ids = torch.arange(config.draft_vocab) + weights["d2t"].long()
    if target_ids.min() < 0 or target_ids.max() >= target.vocab_size or len(target_ids.unique()) != len(target_ids):
        raise SpecDecError(f"{where}: its d2t does not map its {config.draft_vocab} draft tokens to distinct ids "
                           f"among the target's {target.vocab_size}")
    t2d = weights.get("t2d")
    if t2d is not None and (len(t2d) < target.vocab_size or not t2d.bool()[target_ids].all()
                            or int(t2d.bool().sum()) != config.draft_vocab):
        raise SpecDecError(f"{where}: its t2d and d2t disagree on which target tokens it predicts")


# ---------------------------------------------------------------- the runtime protocol

class Eagle3Model:
    """An EAGLE-3 head behind the runtime protocol: target ids in, logits over its draft vocabulary out
    (`columns`), the target's states at `state_layers` read through `Eagle3Sequence.observe`."""

    backend = "eagle3"
    peer_kind = None  # specdec's own loop runs it
    tree_tolerance = 1e-4
    spare_cells = spare_sequences = None
    device_logits = False
    max_sequence_ids = None
    batch_invariant = False
    threads = None
    output_layer = None
    compile_backend = None
    reads_target_states = True
    times_ops = False
    layer_count = 0

    def __init__(self, net: Eagle3Net, target: base.CausalLM, layers: tuple[int, ...], path: str = "",
                 device: torch.device | None = None, dtype: torch.dtype | None = None):
        """net: placed on `device` (None: the target's, a GPU's too; llama.cpp's is the CPU) in `dtype`
        (None: as it is)."""
        config = net.config
        self.columns = torch.arange(config.draft_vocab) + net.d2t.cpu()  # [draft vocab]: each column's target id
        self.net = net.placed(device or torch.device(target.device), dtype or net.dtype)
        self.path, self.state_layers = path, tuple(layers)
        # where it computes; its logits come back to the host
        self.torch_device = net.norm.weight.device
        self.device, self.on_gpu = str(self.torch_device), self.torch_device.type == "cuda"
        self.tokenizer, self.max_length, self.vocab_size = target.tokenizer, target.max_length, target.vocab_size
        self.hidden_size = config.hidden
        self.stop_token_ids = frozenset(int(t) for t in self.columns if int(t) in target.stop_token_ids)
        self.parameters = sum(p.numel() for p in net.parameters())
        self.dtype = str(net.dtype).removeprefix("torch.")
        self.weight_bytes = self.parameters * net.norm.weight.element_size()
        self.compile_seconds: dict[tuple[int, ...], float] = {}

    def quantize(self) -> None:
        """Its linear layers multiplied as Q8_0 by specdec's CPU kernel (`cpu_head.quantize_linears`), where
        it runs: a level reads about half of bfloat16's bytes. The head's q is whatever it computes, so
        drafting stays lossless; it only guesses a little differently."""
        if cpu_head.quantize_linears(self.net):
            kept = sum(p.numel() for p in self.net.parameters())  # the norms'
            self.weight_bytes = (self.parameters - kept) * 34 // 32 + kept * self.net.norm.weight.element_size()
            self.dtype = f"q8_0 ({self.dtype} elsewhere)"

    def sequence(self) -> Eagle3Sequence:
        return Eagle3Sequence(self)

    def keep_states(self, on: bool = True, layers=None) -> None:
        if on:
            raise SpecDecError(f"{self.describe()}: a draft head keeps no states of its own")

    def input_embeddings(self, device="cpu", dtype=None) -> None:
        return None

    def output_rows(self, embeddings: torch.Tensor | None = None) -> None:
        return None

    def describe(self) -> str:
        c = self.net.config
        return (f"{self.path} (EAGLE-3 head, {c.layout} layout, {self.parameters / 1e6:.1f}M parameters, "
                f"{c.draft_vocab} draft tokens, reading target layers {list(self.state_layers)})")

    def verify_room(self, root_position: int) -> int:
        return max(self.max_length - 1 - root_position, 0)

    def warm_up(self, rows: int = 1) -> float:
        return 0.0  # eager: nothing to compile

    def tree_refusal(self) -> str | None:
        return None  # every entry attends to its own ancestors by an explicit mask

    def forward_batch(self, feeds: list[base.Feed]) -> list[torch.Tensor]:
        base.check_distinct(feeds)
        with torch.inference_mode(), one_thread():
            return [feed.sequence.run(feed.tokens, feed.parents, feed.last) for feed in feeds]


class Eagle3Sequence(SequenceEntries):
    """One sequence of the head: per entry its keys and values, the output children read, and whether
    its input was the target's feature (see the module docstring for the invariants)."""

    def __init__(self, owner: Eagle3Model):
        super().__init__(owner)
        config = owner.net.config
        # entry i's key and value at row i, for the cache_len entries; rows past them are room (`_store`)
        self.keys = torch.zeros(0, config.kv_heads, config.head_dim, dtype=owner.net.dtype, device=owner.torch_device)
        self.values = torch.zeros_like(self.keys)
        self.outputs: list[torch.Tensor | None] = []  # [hidden] before the final norm, per entry
        self.read_target: list[bool] = []  # its input was the target's feature at its parent
        self.guessed: set[int] = set()  # entries whose input was a parent's output (until re-read)
        self.attendable: list[bool] = []  # it had an input at all (else no entry attends to it)
        # position -> the target's states there, fused when read; in the order observed, which is the
        # positions' (each committed position is reported once, prefill chunks and verifies in turn)
        self._states: OrderedDict[int, torch.Tensor] = OrderedDict()
        self.states = None

    def forward(self, tokens, parents=None, last: int | None = None) -> torch.Tensor:
        return self.owner.forward_batch([base.Feed(self, tokens, parents, last)])[0]

    def observe(self, first: int, states: torch.Tensor) -> None:
        """The target's states at positions first, first + 1, ... ([n, 3 * target hidden]: its three layers'
        inputs, in order), kept for the last KEPT_STATES positions: an entry fed later reads them. On the
        head's device, whichever the forward that made them left them on (a prefill's on the host), in its
        dtype, which `fuse` reads them in (float32 rows of an 8B target's would hold 200 MB a sequence)."""
        for position, row in enumerate(states.to(self.owner.torch_device, self.owner.net.dtype), start=first):
            self._states[position] = row
        oldest = first + len(states) - KEPT_STATES
        while self._states and next(iter(self._states)) < oldest:  # the first observed is the oldest: no scan
            self._states.popitem(last=False)

    def run(self, tokens, parents, last: int | None) -> torch.Tensor:
        """Add entries for `tokens` under `parents` and return the last `last` rows of logits (all: None)."""
        self._reread_committed()
        tokens, positions, all_parents = self.place(tokens, parents)
        start, n = self.cache_len, len(tokens)
        self.commit(tokens, positions, all_parents)
        self.outputs += [None] * n
        self.read_target += [False] * n
        self.attendable += [False] * n
        logits = [None] * n
        for wave in self._waves(start, n):
            for entry, row in zip(wave, self._compute(wave)):
                logits[entry - start] = row
        count = base.wanted_count(last, n)
        return base.to_host(torch.stack(logits[n - count:])) if count else torch.zeros(0, len(self.owner.columns))

    def _waves(self, start: int, n: int) -> list[list[int]]:
        """The new entries in waves: an entry whose input is a new entry's output waits for it."""
        depth = {}
        for entry in range(start, start + n):
            parent = self._parents[entry]
            depth[entry] = depth[parent] + 1 if parent in depth and self._feature(entry) is None else 0
        waves = [[] for _ in range(max(depth.values(), default=-1) + 1)]
        for entry, d in depth.items():
            waves[d].append(entry)
        return waves

    def _feature(self, entry: int) -> torch.Tensor | None:
        """The target's states at entry's parent, where it is committed text the target reported."""
        parent = self._parents[entry]
        if parent < 0 or parent >= self._trunk:
            return None
        return self._states.get(self._positions[parent])

    def _inputs(self, entries: list[int]) -> tuple[torch.Tensor, list[bool], list[bool]]:
        """The entries' inputs [n, hidden] (the target's states at each one's parent, fused, else the
        parent's own output, a draft node's child, else zeros), which of them are the target's, and which
        had any input at all."""
        net, width = self.owner.net, self.owner.net.config.hidden
        states = [self._feature(entry) for entry in entries]
        inputs = [None if state is not None or self._parents[entry] < 0 else self.outputs[self._parents[entry]]
                  for entry, state in zip(entries, states)]
        read = [i for i, state in enumerate(states) if state is not None]
        if read:
            for i, feature in zip(read, net.fuse(torch.stack([states[i] for i in read]))):
                inputs[i] = feature
        readable = [x is not None for x in inputs]
        nothing = torch.zeros(width, dtype=self.keys.dtype, device=self.keys.device)
        rows = torch.stack([x.to(self.keys.dtype) if x is not None else nothing for x in inputs])
        return rows, [state is not None for state in states], readable

    def _compute(self, entries: list[int]) -> list[torch.Tensor]:
        """Keys, values, outputs and logits of `entries` (whose inputs are known), as one batch."""
        net = self.owner.net
        features, from_target, readable = self._inputs(entries)
        tokens, positions = self._on_device([self._tokens[e] for e in entries], [self._positions[e] for e in entries])
        keys, values, queries, residual = net.inputs(tokens, features, positions)
        self._store(entries, keys, values)
        for entry, target_read, had_input in zip(entries, from_target, readable):
            self.read_target[entry], self.attendable[entry] = target_read, had_input
            if had_input and not target_read:
                self.guessed.add(entry)
        low = min(entries)  # the rows of entries low .. cache_len - 1, then the wave's
        allowed = tree.ancestry(self._parents, self._trunk, low, self.cache_len - low)[[e - low for e in entries]]
        allowed = (allowed & torch.tensor(self.attendable)[None]).to(self.keys.device)
        n = self.cache_len
        logits, outputs = net.outputs(queries, residual, self.keys[:n], self.values[:n], allowed)
        for entry, output in zip(entries, outputs):
            self.outputs[entry] = output
        return list(logits)

    def _store(self, entries: list[int], keys: torch.Tensor, values: torch.Tensor) -> None:
        if self.cache_len > len(self.keys):  # the room doubles: growing by the new rows alone copied all at each level
            grow = max(self.cache_len, 2 * len(self.keys)) - len(self.keys)
            pad = self.keys.new_zeros(grow, *self.keys.shape[1:])
            self.keys, self.values = torch.cat([self.keys, pad]), torch.cat([self.values, pad])
        (index,) = self._on_device(entries)
        self.keys[index], self.values[index] = keys, values

    def _on_device(self, *lists: list[int]) -> tuple[torch.Tensor, ...]:
        """Lists of integers as tensors on the head's device."""
        return tuple(torch.tensor(values, dtype=torch.long, device=self.keys.device) for values in lists)

    def _reread_committed(self) -> None:
        """Committed entries whose input was a guess (kept draft nodes) take the target's feature, now
        known: their keys and values as plain decoding with the head would have them."""
        stale = sorted(e for e in self.guessed if e < self._trunk and self._feature(e) is not None)
        if not stale:
            return
        self.guessed.difference_update(stale)
        features, _, _ = self._inputs(stale)
        tokens, positions = self._on_device([self._tokens[e] for e in stale], [self._positions[e] for e in stale])
        keys, values, _, _ = self.owner.net.inputs(tokens, features, positions)
        self._store(stale, keys, values)
        for e in stale:
            self.read_target[e] = self.attendable[e] = True

    def keep(self, start: int, indices) -> None:
        indices = self.kept_path(start, indices)
        order = list(range(start)) + indices
        (index,) = self._on_device(order)
        self.keys, self.values = self.keys[index], self.values[index]
        for name in ("outputs", "read_target", "attendable"):
            kept = getattr(self, name)
            setattr(self, name, [kept[i] for i in order])
        moved = {old: new for new, old in enumerate(order)}
        self.guessed = {moved[e] for e in self.guessed if e in moved}
        self.keep_entries(start, indices)

    def release(self) -> None:
        self.outputs, self.read_target, self.attendable, self.guessed, self._states = [], [], [], set(), OrderedDict()

    def fork(self, length: int) -> None:
        return None  # cheap to refill from the target's features; nothing is shared
