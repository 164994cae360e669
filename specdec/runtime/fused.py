"""A decoder forward written for the static pool, for the Llama family (Llama 2/3.x, Mistral, Qwen 2/2.5, Qwen 3)
and Gemma (1: Llama's layer with Gemma's norm and activation; 2 and 3's text model: a norm after attention and
after the MLP as well; 2: attention scores soft-capped, as transformers' eager attention computes them).

transformers' decoder layer launches dozens of small kernels per layer (three projections, norm,
rotary, cache writes, gate and up apart, residual adds), each reading its inputs from memory again.
Here, for the families that share Llama's layer:
- the query, key and value projections are one matrix, and gate and up one (concatenated once, at load;
  the model's own modules keep views into them, so no weight is held twice and its own forward still runs);
- on a GPU the elementwise work between the matrix products is compiled by Inductor (`torch.compile` of the
  pure functions below), at one of two scopes (`SCOPES`): "pieces", one kernel each for the residual add with
  the next norm, the query and key rotations, the gated activation and attention's softmax, the products and
  the cache writes as they are; or "layers", a whole decoder layer (`layer_step`) as one compiled graph, so
  Inductor may also fold the cache writes into the rotation's kernel and the views between them (fewer
  kernels a step). Both run the same `layer_step`; which is faster is the device's to say (benchmarks/gpu.py,
  section 6), and the loser goes;
- attention reads the pool's key and value heads where they are: each key head's group of query heads
  runs as that head's group × n queries (no copy of the keys per query head). A step's (the pool's
  buckets) is two batched products around the softmax: SDPA's masked kernel runs one block per key head
  there and left an H100 idle (45 µs a layer on an 8B shape, benchmarks/RESULTS.md). A prefill chunk's
  is SDPA's, whose scores the products would hold whole;
- the norms, the rotary embedding and the activation are the model's own modules or their
  arithmetic operation for operation (`Family`), so the forward equals transformers' (tests: float64,
  every covered family).

Every other model keeps transformers' forward on the pool (`fused_refusal` says why).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, replace
from functools import partial
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

def rms_norm(hidden, weight, eps: float):
    """The Llama family's RMSNorm, operation for operation (in float32 whatever the dtype, weighted after)."""
    dtype = hidden.dtype
    wide = hidden.to(torch.float32)
    wide = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)
    return weight * wide.to(dtype)


def gemma_rms_norm(hidden, weight, eps: float):
    """Gemma's RMSNorm, operation for operation (in float32, weighted by 1 + weight before the cast back)."""
    wide = hidden.float()
    wide = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)
    return (wide * (1.0 + weight.float())).type_as(hidden)


def gelu_tanh(x):
    return F.gelu(x, approximate="tanh")


@dataclass(frozen=True)
class Family:
    """What a covered family computes differently: its norm's arithmetic and its activation (whether the
    outputs of attention and of the MLP are normed too, Gemma 3's "sandwich", each layer's modules say)."""

    norm: Callable
    activation: Callable
    activation_name: str
    attention: str = "sdpa"  # the attention implementation whose arithmetic it computes (transformers' for the model)


LLAMA = Family(rms_norm, F.silu, "silu")
GEMMA = Family(gemma_rms_norm, gelu_tanh, "gelu_pytorch_tanh")
# Gemma 2 soft-caps its attention scores, which transformers computes in eager attention only
FAMILIES = {"llama": LLAMA, "mistral": LLAMA, "qwen2": LLAMA, "qwen3": LLAMA, "gemma": GEMMA,
            "gemma2": replace(GEMMA, attention="eager"), "gemma3_text": GEMMA}


def fused_refusal(model) -> str | None:
    """Why `model` (a transformers causal LM) has no fused forward, or None."""
    config = model.config
    family = FAMILIES.get(config.model_type)
    if family is None:
        return f"{config.model_type} is not among the families it covers ({', '.join(FAMILIES)})"
    implementation = getattr(config, "_attn_implementation", None)
    if implementation != family.attention:
        return f"its attention is {implementation}; the fused forward computes {family.attention}'s"
    activation = getattr(config, "hidden_activation", None) or config.hidden_act
    if activation != family.activation_name:
        return f"its activation is {activation}, not {family.activation_name}"
    if getattr(config, "attn_logit_softcapping", None) is not None and implementation == "sdpa":
        return "its attention soft-caps its scores, which transformers' sdpa attention does not"
    if getattr(config, "use_bidirectional_attention", False):
        return "its attention sees later tokens"
    layer = model.model.layers[0]
    projections = (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj)
    gate_up = (layer.mlp.gate_proj, layer.mlp.up_proj)
    if len({p.bias is None for p in projections}) > 1 or len({p.bias is None for p in gate_up}) > 1:
        return "some of its projections have biases and others not"
    ropes = getattr(config, "rope_parameters", None) or {}
    for rope in (ropes.values() if all(isinstance(v, dict) for v in ropes.values()) and ropes else [ropes]):
        if rope.get("rope_type", "default") in ("dynamic", "longrope"):
            return f"its {rope['rope_type']} rotary embedding changes with the context"
    return None


class FusedForward:
    """model's forward over the pool: (tokens, positions, mask(s), SlotCache, states kind) -> logits,
    or (logits, states) as `StaticHFModel._forward_logits` returns them (logits of the last `keep` tokens only,
    where given)."""

    def __init__(self, model, compiled: bool, scope: str = "pieces", backend: str = "inductor"):
        """compiled: the elementwise work by torch.compile (`backend`, Inductor on a GPU), at `scope` (`SCOPES`)."""
        if scope not in SCOPES:
            raise ValueError(f"unknown compile scope {scope!r}; choose one of {', '.join(SCOPES)}")
        inner, config = model.model, model.config
        self.family = FAMILIES[config.model_type]
        self.embed, self.rotary, self.norm, self.head = inner.embed_tokens, inner.rotary_emb, inner.norm, model.lm_head
        self.layers = [layer_weights(layer) for layer in inner.layers]
        types = getattr(config, "layer_types", None) or ["full_attention"] * len(self.layers)
        self.layer_types = list(types)
        # each layer's output is normed by the next layer's input norm, the last one's by the final norm
        self.next_norms = [layer.norm_in for layer in self.layers[1:]] + [_norm(self.norm)]
        # Gemma 3: one rotary embedding per layer type (local layers use another base)
        self.rotary_by_type = "layer_type" in inspect.signature(self.rotary.forward).parameters
        self.softcap = getattr(config, "final_logit_softcapping", None)
        # a compiled forward's shapes (the pool's buckets) against the rest (prefill chunks), run as written;
        # scores soft-capped (Gemma 2) are the products' everywhere: SDPA's kernel cannot cap them
        scores_cap = getattr(config, "attn_logit_softcapping", None)
        self.kernels = {"bucketed": _Kernels(self.family, scope if compiled else None, products=True,
                                             scores_cap=scores_cap, backend=backend),
                        "other": _Kernels(self.family, None, products=scores_cap is not None, scores_cap=scores_cap)}

    def __call__(self, tokens, positions, mask, cache, states=None, bucketed: bool = True, keep: int | None = None):
        kernels = self.kernels["bucketed" if bucketed else "other"]
        hidden = self.embed(tokens)
        if self.rotary_by_type:
            rotations = {kind: self.rotary(hidden, positions, kind) for kind in set(self.layer_types)}
        else:
            rotations = dict.fromkeys(self.layer_types, self.rotary(hidden, positions))
        taken = {}  # layer -> its input, for states of layers
        normed = self.family.norm(hidden, *self.layers[0].norm_in)
        for index, (layer, next_norm) in enumerate(zip(self.layers, self.next_norms)):
            if isinstance(states, tuple) and index in states:
                taken[index] = hidden
            kind = self.layer_types[index]
            layer_mask = mask[kind] if isinstance(mask, dict) else mask
            hidden, normed = kernels.layer(layer, hidden, normed, *rotations[kind], layer_mask, *cache.cells(index),
                                           next_norm)
        if keep is not None:  # the output product's rows, and so the norm's states, as transformers' logits_to_keep
            normed = normed[:, -keep:]
        logits = self.head(normed)
        if self.softcap is not None:
            logits = soft_capped(logits, self.softcap)
        if not states:
            return logits
        return logits, (normed if states == "norm" else torch.cat([taken[i] for i in states], dim=-1))


class LayerWeights(NamedTuple):
    """One decoder layer's weights (the model's own tensors, q/k/v and gate/up concatenated), its norms as
    (weight, eps) or None where the family has none, and the attention's shapes: a compiled `layer_step` takes
    them as inputs, so one compiled graph per shape serves every layer."""

    qkv: tuple  # (weight, bias or None)
    o: tuple
    gate_up: tuple
    down: tuple
    norm_in: tuple  # applied where the layer before adds its residual (`layer_step`'s next_norm)
    norm_attended: tuple | None  # Gemma 2 and 3: attention's output normed before the residual add
    norm_mlp_in: tuple  # the Llama family's "post attention" norm is the MLP's input norm
    norm_mlp_out: tuple | None  # Gemma 2 and 3: the MLP's output normed too
    q_norm: tuple | None  # Qwen 3, Gemma 3: a norm over each head, before the rotation
    k_norm: tuple | None
    head_dim: int
    scaling: float
    widths: tuple  # the query, key and value widths of the qkv product


def layer_weights(layer) -> LayerWeights:
    """A transformers decoder layer's `LayerWeights` (its q/k/v and gate/up concatenated: `_concatenated`)."""
    attention, mlp = layer.self_attn, layer.mlp
    sandwich = hasattr(layer, "pre_feedforward_layernorm")
    q_norm, k_norm = getattr(attention, "q_norm", None), getattr(attention, "k_norm", None)
    return LayerWeights(
        qkv=_concatenated(attention.q_proj, attention.k_proj, attention.v_proj),
        o=(attention.o_proj.weight, attention.o_proj.bias),
        gate_up=_concatenated(mlp.gate_proj, mlp.up_proj),
        down=(mlp.down_proj.weight, mlp.down_proj.bias),
        norm_in=_norm(layer.input_layernorm),
        norm_attended=_norm(layer.post_attention_layernorm) if sandwich else None,
        norm_mlp_in=_norm(layer.pre_feedforward_layernorm if sandwich else layer.post_attention_layernorm),
        norm_mlp_out=_norm(layer.post_feedforward_layernorm) if sandwich else None,
        q_norm=None if q_norm is None else _norm(q_norm), k_norm=None if k_norm is None else _norm(k_norm),
        head_dim=attention.head_dim, scaling=attention.scaling,
        widths=(attention.q_proj.out_features, attention.k_proj.out_features, attention.v_proj.out_features))


def layer_step(kernels: _Kernels, weights: LayerWeights, hidden, normed, cos, sin, mask, pool_keys, pool_values,
               row_index, slots, reads: int, columns, next_norm):
    """One decoder layer: (hidden, normed) -> the next layer's (hidden, its norm of it). `normed` is this
    layer's input norm of `hidden` [rows, n, width], computed where the previous layer added its residual;
    the new keys and values are written into the pool's rows [rows, kv heads, cells, d] at cells
    slots[r, j] of row row_index[r] (`write_cells`), and attention reads the rows' first `reads` cells, or a
    sliding layer's window (`read_cells`: columns [rows, window], or None); the mask, [rows, 1, n, cells read],
    hides the rest."""
    rows, n, _ = hidden.shape
    queries, keys, values = F.linear(normed, *weights.qkv).split(weights.widths, dim=-1)
    queries, keys, values = (x.view(rows, n, -1, weights.head_dim) for x in (queries, keys, values))
    if weights.q_norm is not None:
        queries, keys = kernels.norm(queries, *weights.q_norm), kernels.norm(keys, *weights.k_norm)
    queries, keys = kernels.rotate(queries.transpose(1, 2), keys.transpose(1, 2), cos, sin)
    write_cells(pool_keys, row_index, slots, keys)
    write_cells(pool_values, row_index, slots, values.transpose(1, 2))
    keys, values = read_cells(pool_keys, reads, columns), read_cells(pool_values, reads, columns)
    attended = grouped_attention(queries, keys, values, mask, weights.scaling, kernels)
    delta = F.linear(attended.transpose(1, 2).reshape(rows, n, -1), *weights.o)
    hidden, normed = kernels.residual(hidden, delta, weights.norm_attended, weights.norm_mlp_in)
    gated = kernels.gated(F.linear(normed, *weights.gate_up))
    return kernels.residual(hidden, F.linear(gated, *weights.down), weights.norm_mlp_out, next_norm)


def write_cells(pool, row_index, slots, new) -> None:
    """new [rows, heads, n, d] into pool [rows, heads, cells, d] at cells slots[r, j] of row row_index[r]
    ([rows, 1] beside slots [rows, n]), in place: an index_put_, which Inductor keeps in place (a scatter_
    copied the whole pool)."""
    pool[row_index, :, slots] = new.transpose(1, 2).to(pool.dtype)  # indexed: [rows, n, heads, d]


def read_cells(pool, reads: int, columns):
    """The cells attention reads of pool [rows, heads, cells, d] (contiguous): its rows' first `reads`, a view; or
    where columns [rows, window] is given, row r's cells columns[r] (a sliding layer's window), a copy: whole
    cells by an index_select (on the CPU 3 times as fast as a gather's or an index's element by element)."""
    if columns is None:
        return pool[:, :, :reads]
    rows, heads, cells, dim = pool.shape
    firsts = torch.arange(0, rows * heads * cells, cells, device=pool.device).view(rows, heads, 1)
    picked = pool.view(-1, dim).index_select(0, (firsts + columns[:, None, :]).view(-1))
    return picked.view(rows, heads, -1, dim)


def grouped_attention(queries, keys, values, mask, scale: float, kernels: _Kernels) -> torch.Tensor:
    """Attention of queries [rows, heads, n, d] over keys and values [rows, kv heads, cells, d] with an
    additive mask [rows, 1, n, cells], each key head's group of query heads run as that head's
    group × n queries (query head h reads key head h // group, as transformers' repeat_kv pairs them)."""
    rows, heads, n, dim = queries.shape
    group = heads // keys.shape[1]
    grouped = queries.reshape(rows, keys.shape[1], group * n, dim)  # query g * n + j: head (kv, g), token j
    grouped_mask = mask if n == 1 or group == 1 else mask.repeat(1, 1, group, 1)
    return kernels.attend(grouped, keys, values, grouped_mask, scale).reshape(rows, heads, n, dim)


def masked_softmax(scores, mask, scale: float, cap: float | None = None, eager: bool = False):
    """softmax(scores × scale + mask) in float32 at least, back in the scores' dtype; the scaled scores
    soft-capped first where the family caps them. eager: as transformers' eager attention computes it
    (Gemma 2's), the softmax in float32 whatever the dtype (a float64 model's too)."""
    wide = scores.to(torch.promote_types(scores.dtype, torch.float32)) * scale
    if cap is not None:
        wide = soft_capped(wide, cap)
    return torch.softmax(wide + mask, dim=-1, dtype=torch.float32 if eager else None).to(scores.dtype)


def soft_capped(x, cap: float):
    """cap · tanh(x / cap): Gemma 2's and 3's soft cap (of attention scores, of logits)."""
    return torch.tanh(x / cap) * cap


def fused_attention(queries, keys, values, mask, scale: float) -> torch.Tensor:
    """SDPA's kernel: for a prefill's many queries, whose scores two products would hold whole."""
    return F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale)


def rotate(queries, keys, cos, sin):
    """transformers' rotary embedding ([rows, heads, n, d] each; cos, sin [rows, n, d])."""
    cos, sin = cos[:, None], sin[:, None]
    return queries * cos + _rotated_half(queries) * sin, keys * cos + _rotated_half(keys) * sin


def _rotated_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def add_norm(hidden, delta, weight, eps: float, norm=rms_norm):
    """The residual add, and the next norm of its sum."""
    hidden = hidden + delta
    return hidden, norm(hidden, weight, eps)


def add_normed(hidden, delta, delta_weight, delta_eps: float, weight, eps: float, norm=gemma_rms_norm):
    """Gemma 3's residual add of a normed output, and the next norm of the sum."""
    hidden = hidden + norm(delta, delta_weight, delta_eps)
    return hidden, norm(hidden, weight, eps)


def _norm(module) -> tuple[torch.Tensor, float]:
    eps = getattr(module, "variance_epsilon", None)
    return module.weight, module.eps if eps is None else eps


def gated(gate_up, activation=F.silu):
    """activation(gate) * up, from the concatenated product."""
    gate, up = gate_up.chunk(2, dim=-1)
    return activation(gate) * up


def allow_compiled_shapes(entries: int = 1024) -> None:
    """Let torch.compile keep `entries` compiled shapes of one function, where a pool compiles one per (rows,
    tokens, cells read, window read) bucket and a target and its draft model share the functions: past dynamo's
    limits (8 per function, 256 in all by default) a further shape would silently run eagerly."""
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, entries)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, entries)


SCOPES = ("pieces", "layers")  # what one compiled graph holds: each elementwise step, or a whole layer


class _Kernels:
    """How a forward computes a layer and what lies between its matrix products. scope: what one compiled
    graph holds (`SCOPES`: each elementwise step, or a whole `layer_step`), on torch.compile's `backend`;
    None: as written. products: attention as two batched products around a softmax (a step's few queries
    over whole rows: a fused attention kernel runs one block per head there and leaves most of a GPU idle);
    else SDPA's kernel (a prefill's many queries, whose scores the products would hold whole). scores_cap:
    the products' scores soft-capped (Gemma 2)."""

    def __init__(self, family: Family, scope: str | None, products: bool, scores_cap: float | None = None,
                 backend: str = "inductor"):
        if scope:
            allow_compiled_shapes()

        def compiled(function, at: str):
            return torch.compile(function, backend=backend, dynamic=False, fullgraph=True) if scope == at else function

        wrap = partial(compiled, at="pieces")
        self.norm = family.norm
        self.rotate = wrap(rotate)
        self.softmax = wrap(partial(masked_softmax, cap=scores_cap, eager=family.attention == "eager"))
        self.add_norm = wrap(partial(add_norm, norm=family.norm))
        self.add_normed = wrap(partial(add_normed, norm=family.norm))
        self.gated = wrap(partial(gated, activation=family.activation))
        self.attend = self._products if products else fused_attention
        self.layer = compiled(partial(layer_step, self), at="layers")

    def residual(self, hidden, delta, delta_norm, next_norm):
        """hidden + delta (normed first where the family norms it: `delta_norm`, else None), and the next norm."""
        if delta_norm is None:
            return self.add_norm(hidden, delta, *next_norm)
        return self.add_normed(hidden, delta, *delta_norm, *next_norm)

    def _products(self, queries, keys, values, mask, scale: float) -> torch.Tensor:
        return self.softmax(queries @ keys.transpose(-1, -2), mask, scale) @ values


def _concatenated(*linears) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for several linear layers over the same input; each layer's own
    parameters become views into it (the separate copies are freed). Layers that are such views
    already (a second fused forward over one model) give the weight they view: nothing is copied again."""
    with torch.no_grad():
        weight = _joined([linear.weight for linear in linears])
        # these families give all or none of a layer's projections a bias (`fused_refusal`)
        bias = _joined([linear.bias for linear in linears]) if linears[0].bias is not None else None
        start = 0
        for linear in linears:
            end = start + linear.out_features
            linear.weight = torch.nn.Parameter(weight[start:end], requires_grad=False)
            if linear.bias is not None:
                linear.bias = torch.nn.Parameter(bias[start:end], requires_grad=False)
            start = end
    return weight, bias


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """The parts stacked along their first dimension: a view over them where they already lie so in
    one storage (consecutive blocks, in order), else a new tensor. (Separate storages may lie end to end
    in memory too: a view over them would read past the first one's.)"""
    first, rows = parts[0], sum(part.shape[0] for part in parts)
    step = first[0].numel() * first.element_size()  # bytes per first-dimension slice
    storage, address = first.untyped_storage().data_ptr(), first.data_ptr()
    for part in parts:
        if (not part.is_contiguous() or part.shape[1:] != first.shape[1:] or part.data_ptr() != address
                or part.untyped_storage().data_ptr() != storage):
            return torch.cat(parts)
        address += part.shape[0] * step
    return first.as_strided((rows, *first.shape[1:]), first.stride())
