"""A draft head: a small network that drafts from the target's own hidden states (EAGLE-style).

The target's final norm gives, at every position, the state its output layer multiplies into the
next token's logits. The head maps (that state at position t - 1, the token at t) to a guess of the
state at t, and scores it with the target's own output rows of a pruned vocabulary (`VocabMap`):
its q is over those tokens only (q = 0 elsewhere, exact as for any pruned draft). Deeper tokens
chain on the head's own guesses. There is no attention, so no cache of keys and values: a
sequence's entries hold the head's guessed states, and the target's verified states replace them
where the engine reports them (`HeadSequence.observe`).

`HeadModel` puts the head behind the runtime protocol with the pruned vocabulary's draft ids (as a
distilled draft model has them), so the drafters grow chains and trees with it unchanged: wrapped
in `PrunedVocab`, it is a draft model whose forward is the head's.

Files: DIR/head.safetensors (the network and the two matrices of target rows) and DIR/head.json
(shape, vocabulary map, the target's tokenizer fingerprint), written by `specdec train
--distill-from TARGET --small-head`.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from specdec.errors import SpecDecError
from specdec.runtime import base, cpu_head
from specdec.runtime.entries import SequenceEntries
from specdec.runtime.pruned import VocabMap

HEAD_FILE, CONFIG_FILE = "head.safetensors", "head.json"
KEPT_STATES = 16  # the target's states a sequence keeps, by position (it reads the latest; a few spare for a rollback)


@dataclass(frozen=True)
class HeadShape:
    width: int  # the target's hidden size: states in and out
    blocks: int = 2  # residual MLP blocks
    inner: int = 640  # each block's gated hidden width
    vocab: int = 8192  # tokens the head predicts (the map's target ids)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, in x's dtype; the squares and their mean in float32 at least, as transformers' Llama
    norm takes them (in float16 a square overflows past 256; in bfloat16 each rounds)."""

    def __init__(self, width: int, eps: float = 1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(width)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x if x.element_size() >= 4 else x.float()
        return (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class Block(nn.Module):
    """x + down(silu(gate(norm x)) * up(norm x))."""

    def __init__(self, width: int, inner: int):
        super().__init__()
        self.norm = RMSNorm(width)
        self.gate_up = nn.Linear(width, 2 * inner, bias=False)
        self.down = nn.Linear(inner, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(self.norm(x)).chunk(2, dim=-1)
        return x + self.down(nn.functional.silu(gate) * up)


class HeadNet(nn.Module):
    """(state [n, width], draft token ids [n]) -> (next state [n, width], logits [n, vocab]).

    `inputs` [vocab + 1, width]: the target's input embeddings of the predicted tokens, then a zero
    row for every other token; `outputs` [vocab, width]: the target's output rows of the predicted
    tokens. Both are the target's, frozen (buffers, not parameters)."""

    def __init__(self, shape: HeadShape, inputs: torch.Tensor, outputs: torch.Tensor):
        super().__init__()
        self.shape = shape
        self.register_buffer("inputs", inputs.float().contiguous())
        self.register_buffer("outputs", outputs.float().contiguous())
        self.state_norm, self.token_norm = RMSNorm(shape.width), RMSNorm(shape.width)
        self.fuse = nn.Linear(2 * shape.width, shape.width, bias=False)
        self.blocks = nn.ModuleList(Block(shape.width, shape.inner) for _ in range(shape.blocks))
        self.out_norm = RMSNorm(shape.width)

    def forward(self, states: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        guessed = self.guess(states, tokens)
        return guessed, self.score(guessed)

    def guess(self, states: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """[n, width] states and [n] draft ids -> [n, width]: the target's next final-norm state, as
        the head guesses it."""
        states = states.to(self.fuse.weight.dtype)
        x = self.fuse(torch.cat([self.state_norm(states), self.token_norm(self.inputs[tokens])], dim=-1))
        for block in self.blocks:
            x = block(x)
        return self.out_norm(x)

    def score(self, guessed: torch.Tensor) -> torch.Tensor:
        """[n, width] -> [n, vocab] logits through the target's output rows."""
        return guessed @ self.outputs.T


def inference_dtype() -> torch.dtype:
    """bfloat16 where this CPU multiplies it natively (a draft level then reads half the bytes), else float32."""
    return torch.bfloat16 if torch.ops.mkldnn._is_mkldnn_bf16_supported() else torch.float32


def load_head(directory: str | Path, dtype: torch.dtype = torch.float32) -> tuple[HeadNet, VocabMap]:
    """A head written by `save_head`, on the CPU."""
    from safetensors.torch import load_file

    directory = Path(directory)
    try:
        saved = json.loads((directory / CONFIG_FILE).read_text())
        weights = load_file(str(directory / HEAD_FILE))
    except (OSError, ValueError) as error:
        raise SpecDecError(f"{directory}: not a draft head ({error})") from error
    shape = HeadShape(**saved["shape"])
    vocab_map = VocabMap(tuple(saved["vocab_map"]["target_ids"]), saved["vocab_map"]["target_vocab_size"],
                         saved["vocab_map"]["target_fingerprint"])
    net = HeadNet(shape, weights["inputs"], weights["outputs"])
    net.load_state_dict({k: v.float() for k, v in weights.items()})
    return net.to(dtype).eval(), vocab_map


def save_head(net: HeadNet, vocab_map: VocabMap, directory: str | Path, extra: dict | None = None) -> None:
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in net.state_dict().items()}, str(directory / HEAD_FILE))
    (directory / CONFIG_FILE).write_text(json.dumps({"shape": asdict(net.shape), "vocab_map": {
        "target_ids": list(vocab_map.target_ids), "target_vocab_size": vocab_map.target_vocab_size,
        "target_fingerprint": vocab_map.target_fingerprint}, **(extra or {})}))


def is_head(path: str | Path) -> bool:
    return (Path(path) / CONFIG_FILE).is_file() and (Path(path) / HEAD_FILE).is_file()


class HeadModel:
    """A head behind the runtime protocol, in draft ids (wrap it in `PrunedVocab` for target ids).
    Its logits have one more column than it predicts, the input-only unknown id, at -inf."""

    backend = "head"
    peer_kind = None  # specdec's own: no other library's loop runs it
    tree_tolerance = 1e-5
    spare_cells = None  # no cache of keys and values
    spare_sequences = None
    device_logits = False
    max_sequence_ids = None
    batch_invariant = False
    threads = None  # torch's (one thread for its matmuls, `one_thread`)
    output_layer = None  # the target's output rows, as the network or `cpu_head` scores them
    compile_backend = None  # eager
    columns = None  # in draft ids: `PrunedVocab` maps them to target ids
    reads_target_states = True  # its sequences take the target's verified states (`HeadSequence.observe`)
    times_ops = False
    layer_count = 0
    state_layers = None  # it reads the target's final-norm states

    def __init__(self, net: HeadNet, vocab_map: VocabMap, target: base.CausalLM, path: str = "",
                 device: torch.device | None = None):
        """net: moved to `device` (None: the target's, a GPU's too; llama.cpp's is the CPU)."""
        if net.shape.width != target.hidden_size:
            raise SpecDecError(f"the head {path} reads states {net.shape.width} wide; the target's are "
                               f"{target.hidden_size}")
        self.net, self.path = net.to(device or torch.device(target.device)), str(path)
        # where the network computes; its logits come back to the host
        self.torch_device = net.fuse.weight.device
        self.device, self.on_gpu = str(self.torch_device), self.torch_device.type == "cuda"
        # the output rows through specdec's CPU kernel where the target's GGUF matrix suits it (the same
        # rows, quantized as the target reads them; far fewer bytes per draft level), else the network's matmul
        self.score = _kernel_score(target, vocab_map) or (lambda guessed: net.score(guessed.to(net.outputs.dtype)))
        self.tokenizer, self.max_length = target.tokenizer, target.max_length
        self.vocab_size = vocab_map.draft_vocab_size
        self.hidden_size = net.shape.width
        self.parameters = sum(p.numel() for p in net.parameters())
        # one forward reads the network and the output rows
        self.weight_bytes = net.fuse.weight.element_size() * (self.parameters + net.outputs.numel())
        self.dtype = str(net.fuse.weight.dtype).removeprefix("torch.")
        draft_id = {target_id: i for i, target_id in enumerate(vocab_map.target_ids)}
        self.stop_token_ids = frozenset(draft_id[t] for t in target.stop_token_ids if t in draft_id)
        self.compile_seconds: dict[tuple[int, ...], float] = {}  # nothing compiled

    def sequence(self) -> HeadSequence:
        return HeadSequence(self)

    def keep_states(self, on: bool = True) -> None:
        if on:
            raise SpecDecError(f"{self.describe()}: a draft head keeps no final-norm states of its own")

    def input_embeddings(self, device="cpu", dtype=None) -> None:
        return None  # a head's matrices are the target's rows of a pruned vocabulary

    def output_rows(self, embeddings: torch.Tensor | None = None) -> None:
        return None

    def describe(self) -> str:
        return f"{self.path} (draft head, {self.parameters / 1e6:.1f}M parameters, {self.net.shape.vocab} tokens)"

    def verify_room(self, root_position: int) -> int:
        return max(self.max_length - 1 - root_position, 0)

    def warm_up(self, rows: int = 1) -> float:
        return 0.0  # eager: nothing to compile

    def tree_refusal(self) -> str | None:
        return None  # each entry reads its own parent's state only: a tree is exact by construction

    def forward_batch(self, feeds: list[base.Feed]) -> list[torch.Tensor]:
        """Every feed's wanted rows, the head run once per dependency level across all feeds."""
        base.check_distinct(feeds)
        wanted = []
        for feed in feeds:
            sequence = feed.sequence
            tokens, positions, all_parents = sequence.place(feed.tokens, feed.parents)
            start = sequence.cache_len
            sequence.commit(tokens, positions, all_parents)
            sequence.guesses += [None] * len(tokens)
            n = len(tokens)
            count = base.wanted_count(feed.last, n)
            wanted.append((sequence, list(range(start + n - count, start + n))))
        logits = self._compute([(sequence, entry) for sequence, entries in wanted for entry in entries])
        return [self._rows([logits[id(sequence), entry] for entry in entries]) for sequence, entries in wanted]

    def _compute(self, targets: list[tuple[HeadSequence, int]]) -> dict[tuple[int, int], torch.Tensor]:
        """Guess the states of new entries `targets`, in waves (`_plan`), each one run of the network;
        returns their logits, by (id of the sequence, entry)."""
        logits = {}
        with torch.inference_mode(), one_thread():
            for wave in _plan(targets):
                states = torch.stack([sequence.input_state(entry) for sequence, entry in wave])  # [n, width]
                tokens = torch.tensor([sequence.token(entry) for sequence, entry in wave], device=self.torch_device)
                guessed = self.net.guess(states, tokens).float()  # [n, width]
                scores = self.score(guessed).float()  # [n, vocab]
                for i, (sequence, entry) in enumerate(wave):
                    sequence.guesses[entry] = guessed[i]
                    logits[id(sequence), entry] = scores[i]
        return logits

    def _rows(self, logits: list[torch.Tensor]) -> torch.Tensor:
        """[n, vocab + 1]: the predicted tokens' logits, then the input-only unknown id at -inf."""
        rows = torch.full((len(logits), self.vocab_size), -torch.inf)
        if logits:
            rows[:, : self.vocab_size - 1] = base.to_host(torch.stack(logits))
        return rows


@contextlib.contextmanager
def one_thread():
    """torch on one thread for the head's small matmuls: a second thread only waits on the first at
    these sizes, and spins for milliseconds when another process holds a core."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _kernel_score(target: base.CausalLM, vocab_map: VocabMap):
    """The head's scoring by `cpu_head.CpuHead` over the target's own rows of its GGUF output matrix, or
    None where that kernel cannot run (not llama.cpp, no AVX-512 VNNI, a matrix type it does not take)."""
    if target.backend != "llamacpp" or cpu_head.unavailable() is not None:
        return None
    try:
        kernel = cpu_head.CpuHead(target.path, target.llama_cpp, target.hidden_size, target.vocab_size, 1,
                                  rows=vocab_map.target_ids)
    except ValueError:
        return None
    return lambda guessed: kernel.logits(guessed.float())


def _plan(targets: list[tuple[HeadSequence, int]]) -> list[list[tuple[HeadSequence, int]]]:
    """Waves of the entries to compute (those asked for and not yet guessed), each wave needing only
    states known before it: an entry reads its parent's state, the target's (observed), the head's
    earlier guess, or a guess of an earlier wave when its parent is asked for too. A parent with none
    of these, not asked for, reads zeros (`input_state`): the head never computes what nobody asked."""
    depth: dict[tuple[int, int], int] = {}
    order: list[tuple[HeadSequence, int]] = []
    for sequence, entry in sorted(set(targets), key=lambda t: (id(t[0]), t[1])):  # parents (earlier entries) first
        if sequence.guesses[entry] is not None:
            continue
        parent = (id(sequence), sequence.parent(entry))
        depth[(id(sequence), entry)] = depth[parent] + 1 if parent in depth else 0  # a parent computed here first
        order.append((sequence, entry))
    waves: list[list] = [[] for _ in range(max(depth.values(), default=-1) + 1)]
    for sequence, entry in order:
        waves[depth[(id(sequence), entry)]].append((sequence, entry))
    return waves


class HeadSequence(SequenceEntries):
    """One sequence of a head. Invariant: `guesses[i]` is None or the head's state [width] for entry
    i, computed from its parent's (`input_state`); `_observed` maps positions of committed text to the
    target's verified states there."""

    def __init__(self, owner: HeadModel):
        super().__init__(owner)
        self.guesses: list[torch.Tensor | None] = []
        self._observed: dict[int, torch.Tensor] = {}

    def forward(self, tokens, parents=None, last: int | None = None) -> torch.Tensor:
        return self.owner.forward_batch([base.Feed(self, tokens, parents, last)])[0]

    def observe(self, first: int, states: torch.Tensor) -> None:
        """The target's final-norm states at positions first, first + 1, ... of the committed text
        ([n, width]). Positions below the last keep theirs only while they could still be read (the
        head reads one state back). Entries fed after them read them (`input_state` prefers them to a
        guess); an entry guessed before they came is a draft node the engine's keep drops next. On the
        head's device, whichever the forward that made them left them on."""
        last = first + len(states) - 1
        self._observed = {p: s for p, s in self._observed.items() if last - KEPT_STATES < p < first}
        for position, state in enumerate(states.detach().float().to(self.owner.torch_device), start=first):
            if position > last - KEPT_STATES:
                self._observed[position] = state

    def observed(self, entry: int) -> torch.Tensor | None:
        """The target's state at this entry, if it is committed text the target reported."""
        state = self._observed.get(self._positions[entry])
        return state if state is not None and entry < self._trunk else None

    def parent(self, entry: int) -> int:
        return self._parents[entry]

    def token(self, entry: int) -> int:
        return self._tokens[entry]

    def input_state(self, entry: int) -> torch.Tensor:
        """The state entry's guess reads: its parent's, the target's where known, else the head's own
        (zeros at position 0 and where `_plan` left the parent uncomputed)."""
        parent = self._parents[entry]
        if parent >= 0:
            observed = self.observed(parent)
            if observed is not None:
                return observed
            if self.guesses[parent] is not None:
                return self.guesses[parent]
        return torch.zeros(self.owner.hidden_size, device=self.owner.torch_device)

    def keep(self, start: int, indices) -> None:
        indices = self.kept_path(start, indices)
        self.guesses = self.guesses[:start] + [self.guesses[i] for i in indices]
        self.keep_entries(start, indices)

    def release(self) -> None:
        self.guesses, self._observed = [], {}

    def fork(self, length: int) -> None:
        return None  # a head's sequences are cheap to refill; nothing is shared
