"""Keras graph walkers: find the channels HOPE may cut, and why others are pinned.

The walker reads the model as a flat list of calls (`hope_keras.graph.adapter`,
nested sub-models expanded) and follows every *channel* through it with the layer
registry (`hope_keras.layers`):

* a *source* layer (Dense, ConvND, SeparableConvND) creates a new channel space;
* channelwise layers (BN, activations, pooling, depthwise convolutions, ...) carry
  channel ``c`` to channel ``c``; Concatenate places its inputs at offsets; Flatten
  spreads a channel over ``P`` positions;
* elementwise merges (Add, Multiply, ...) *couple* the spaces of their inputs:
  channel ``c`` of each input can only be removed together with the others.

A *neuron group* is a set of coupled spaces none of which is pinned; removing its
channel ``c`` means editing every `Coupling` of the group: the output slice of each
writer (the sources of its spaces), the per-channel weights of each channelwise
layer on its path (BN γ/β/μ/σ², depthwise kernels, ...), and the input slice of each
reader (the sources that consume it). A space is *pinned* when one of its channels
reaches a model output, a shared layer, or a layer the registry cannot see through;
the reason is kept. A group whose shape is the paper's neuron layer — one Dense/Conv
producer → BatchNormalization → ReLU → readers through pass-through layers only — is
of kind ``"neurons"``: HOPE can also merge its neurons. Other groups (residual
streams, BN after the activation, pre-activation layouts, depthwise chains, SE
gates, concatenations) are of kind ``"coupled"`` and are pruned channel by channel.

A *residual block* (`hope_keras.graph.blocks`) is an ``Add`` of a shortcut and a
branch that starts from the shortcut's source and holds at least one whole group; an
identity (or pooled identity) shortcut makes it evictable.

The walkers only read the model; they never change it.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple

import keras
import numpy as np

from hope_keras.graph import adapter as kg
from hope_keras.graph import layers as layer_rules
from hope_keras.graph.blocks import ResidualBlock, find_blocks, is_batch_norm, is_plain_relu


@dataclasses.dataclass(frozen=True)
class Consumer:
    """A layer that reads a ``"neurons"`` group's channels through its kernel.

    Attributes:
        layer: Name of the consumer layer (Dense or ConvND).
        kind: ``"conv"`` (the kernel's input-channel axis is ``-2``) or ``"dense"``
            (kernel rows; after a Flatten the rows of channel ``c`` are
            ``c, c + C, c + 2C, ...``).
    """

    layer: str
    kind: str


@dataclasses.dataclass(frozen=True, eq=False)
class Coupling:
    """One layer's share of a group: which weights channel ``c`` owns there.

    Attributes:
        layer: The layer's key.
        role: ``"out"`` (a writer: its output channel at ``positions[c]``, ``c``
            itself unless an Add ties a part of its channels to another group's
            concatenation: Inception-ResNet, NASNet), ``"channel"`` (a
            channelwise layer with weights: its channel at ``positions[c]``) or
            ``"in"`` (a reader: its input positions ``positions[c]``).
        positions: ``(n, k)`` int array: the positions on the layer's channel axis
            (output axis for writers, input axis otherwise) that carry channel
            ``c`` (``k > 1`` after a Flatten).
        tensor: The tensor key of those positions (the layer's output for writers,
            its input otherwise).
    """

    layer: str
    role: str
    positions: np.ndarray
    tensor: str = ""

    @property
    def in_order(self) -> bool:
        """Whether channel ``c`` sits at position ``c`` (``positions[:, 0]`` is
        ``0, 1, …, n − 1``): a writer whose group holds its first outputs in order is
        edited and read by channel index; one an Add split, by position."""
        return bool(np.array_equal(self.positions[:, 0], np.arange(len(self.positions))))

    def __repr__(self) -> str:  # the positions' shape, not every position
        return (f"Coupling(layer={self.layer!r}, role={self.role!r}, "
                f"positions={tuple(np.shape(self.positions))}, tensor={self.tensor!r})")


@dataclasses.dataclass(frozen=True, eq=False)
class NeuronGroup:
    """A set of channels removed together (see the module docstring).

    Attributes:
        name: The group's name: its first writer's layer name.
        size: Number of channels.
        kind: ``"neurons"`` (the paper's producer → BN → ReLU → consumers, mergeable)
            or ``"coupled"`` (every other pattern; pruned only).
        couplings: Every layer's share of the group.
        producer, bn, activation: ``"neurons"`` groups: the producer, its
            BatchNormalization and activation layer; for ``"coupled"`` groups the
            first writer, and None.
        consumers: ``"neurons"`` groups: the kernel layers that read the channels.
        passthrough: ``"neurons"`` groups: weightless layers between activation and
            consumers.
        tensors: ``{tensor key: (n, k) positions}`` wherever the channels flow.
        note: For a ``"coupled"`` group, why it is pruned only.
        stream: The channels flow through an ``Add``: a residual stream (every
            block's output and shortcut share these channels).
    """

    name: str
    size: int
    kind: str
    couplings: Tuple[Coupling, ...]
    producer: str
    bn: Optional[str] = None
    activation: Optional[str] = None
    consumers: Tuple[Consumer, ...] = ()
    passthrough: Tuple[str, ...] = ()
    tensors: Dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    note: str = ""
    stream: bool = False

    def __repr__(self) -> str:  # one line: layer names, not every coupling's positions
        parts = [f"name={self.name!r}", f"size={self.size}", f"kind={self.kind!r}",
                 f"layers={len(self.layers)}"]
        if self.kind == "neurons":
            parts += [f"producer={self.producer!r}", f"bn={self.bn!r}",
                      f"consumers={len(self.consumers)}"]
        if self.stream:
            parts.append("stream=True")
        return f"NeuronGroup({', '.join(parts)})"

    @property
    def mergeable(self) -> bool:
        return self.kind == "neurons"

    @property
    def num_readers(self) -> int:
        """How many layers read the channels (distinct ``"in"`` couplings; ≥ 1)."""
        return max(1, len({c.layer for c in self.couplings if c.role == "in"}))

    @property
    def writers(self) -> Tuple[str, ...]:
        return tuple(c.layer for c in self.couplings if c.role == "out")

    @property
    def readers(self) -> Tuple[Coupling, ...]:
        return tuple(c for c in self.couplings if c.role == "in")

    @property
    def channelwise(self) -> Tuple[Coupling, ...]:
        return tuple(c for c in self.couplings if c.role == "channel")

    @property
    def layers(self) -> Tuple[str, ...]:
        """Every layer name involved in the group (writers first)."""
        if self.kind == "neurons":
            return (self.producer, self.bn, self.activation) + self.passthrough + tuple(
                c.layer for c in self.consumers)
        seen = []
        for c in sorted(self.couplings, key=lambda c: ("out", "channel", "in").index(c.role)):
            if c.layer not in seen:
                seen.append(c.layer)
        return tuple(seen)


@dataclasses.dataclass(frozen=True)
class Pinned:
    """A layer whose output channels cannot be compressed, and why."""

    layer: str
    reason: str


@dataclasses.dataclass(frozen=True, eq=False)
class ModelGraph:
    """Result of walking a model: its groups, residual blocks and pinned layers.

    Attributes:
        groups: `NeuronGroup` by name, in topological order.
        blocks: `ResidualBlock` records.
        pinned: `Pinned` layers with the reason.
        bn_after: Reader layer → the BatchNormalization that alone follows it
            (where a bias-free reader's mean compensation goes).
        flat: The `FlatGraph` the walk read (layer lookups by key).
        hidden_channels: Output channels of every source layer that does not
            produce a model output (the denominator of `coverage`).
    """

    groups: Dict[str, NeuronGroup]
    blocks: Tuple[ResidualBlock, ...]
    pinned: Tuple[Pinned, ...]
    bn_after: Dict[str, str] = dataclasses.field(default_factory=dict)
    flat: Optional[kg.FlatGraph] = None
    hidden_channels: int = 0

    def __repr__(self) -> str:  # one line whatever the model's size
        channels = sum(g.size for g in self.groups.values())
        return (f"ModelGraph(groups={len(self.groups)}, channels={channels}, "
                f"blocks={len(self.blocks)}, pinned={len(self.pinned)}, "
                f"coverage={self.coverage():.3f})")

    def block_of_group(self) -> Dict[str, str]:
        """Maps each internal group name to the name of the block that holds it."""
        return {g: b.name for b in self.blocks for g in b.groups}

    def layer(self, key: str):
        """The layer with key `key` (nested layers included)."""
        return self.flat.layers[key]

    def coverage(self) -> float:
        """Share of hidden channels (output channels of the source layers — Dense,
        ConvND, SeparableConvND — that do not produce a model output) that some
        group can remove."""
        n = sum(g.size * len(g.writers) for g in self.groups.values())
        return n / self.hidden_channels if self.hidden_channels else 0.0

    def with_groups(self, groups: Dict[str, NeuronGroup], blocks=None, pinned=None):
        """A copy restricted to `groups` (and `blocks`; extra `pinned` entries)."""
        return dataclasses.replace(
            self, groups=groups, blocks=self.blocks if blocks is None else tuple(blocks),
            pinned=self.pinned if pinned is None else tuple(pinned))


# ---------------------------------------------------------------------------- walker
_UNSET = object()


class _Spaces:
    """Union-find over channel spaces, with a pin reason per space."""

    def __init__(self):
        self.parent: List[int] = []
        self.size: List[int] = []
        self.pin: List[Optional[str]] = []

    def new(self, size: int, pin: Optional[str] = None) -> int:
        self.parent.append(len(self.parent))
        self.size.append(size)
        self.pin.append(pin)
        return len(self.parent) - 1

    def find(self, s: int) -> int:
        root = s
        while self.parent[root] != root:
            root = self.parent[root]
        while self.parent[s] != root:
            self.parent[s], s = root, self.parent[s]
        return root

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra == rb:
            return
        self.parent[rb] = ra
        if self.pin[ra] is None:
            self.pin[ra] = self.pin[rb]

    def pin_space(self, s: int, reason: str) -> None:
        r = self.find(s)
        if self.pin[r] is None:
            self.pin[r] = reason
        if self.pin[s] is None:
            self.pin[s] = reason


def _channels(shape) -> int:
    if len(shape) < 2 or shape[-1] is None:
        return 0
    return int(shape[-1])


#: Walks at most this many times to split the spaces an Add aligns at other offsets.
_MAX_PASSES = 8


class _Walker:
    """One walk. ``cuts``: ``{source's output tensor: channel offsets}`` at which
    that source's channels start new spaces, so that an Add of it and tensors
    whose channels come from elsewhere at other offsets (a concatenation, as in
    Inception-ResNet and NASNet) ties channel to channel; the offsets a walk finds
    missing are in `new_cuts` (`walk` walks again with them)."""

    def __init__(self, model, fg=None, cuts=None, final=True):
        self.model = model
        self.fg = fg if fg is not None else kg.flatten(model)
        self.cuts = cuts or {}
        self.new_cuts: Dict[str, set] = {}
        self.final = final  # the last walk: a misaligned Add pins what it combines
        self.sp = _Spaces()
        self.origin: List[Tuple[str, int]] = []  # space → (its tensor, first channel)
        # tensor key → (space ids, channel ids), one entry per channel position.
        self.pos: Dict[str, Tuple[np.ndarray, np.ndarray]] = {}
        self.writer_of: Dict[int, int] = {}  # space → source node index
        self.readers: List[Tuple[int, str]] = []  # (source node index, tensor read)
        self.chanwise: List[Tuple[int, str]] = []  # (node index, tensor read)
        self.unsupported: List[Pinned] = []
        self.sums: set = set()  # outputs of Add layers: tensors of residual streams

    # -- spaces of tensors
    def _fresh(self, tensor: str, pin: Optional[str], writer: Optional[int] = None):
        n = _channels(self.fg.shapes[tensor])
        bounds = [0] + sorted(c for c in self.cuts.get(tensor, ()) if 0 < c < n) + [n]
        spaces = np.empty(n, dtype=np.int64)
        chans = np.empty(n, dtype=np.int64)
        for a, b in zip(bounds[:-1], bounds[1:]):
            s = self.sp.new(b - a, pin)
            self.origin.append((tensor, a))
            if writer is not None:
                self.writer_of[s] = writer
            spaces[a:b], chans[a:b] = s, np.arange(b - a)
        self.pos[tensor] = (spaces, chans)

    def _cut(self, sides) -> bool:
        """For a merge of tensors whose channels (`sides`: ``(spaces, chans)`` each)
        do not line up: records the offsets at which their sources must start new
        spaces so that every run of positions where each side's channels are
        consecutive in one space is whole spaces on every side (aligned in the next
        walk). False when a space has no source to split."""
        if self.final or not all(int(s) in self.writer_of
                                 for spaces, _ in sides for s in np.unique(spaces)):
            return False
        start = np.zeros(len(sides[0][0]), dtype=bool)
        start[0] = True
        for spaces, chans in sides:
            start[1:] |= (spaces[1:] != spaces[:-1]) | (chans[1:] != chans[:-1] + 1)
        first = np.flatnonzero(start)
        last = np.append(first[1:], len(start)) - 1
        for spaces, chans in sides:
            for a, b in zip(first, last):
                tensor, base = self.origin[int(spaces[a])]
                offsets = self.new_cuts.setdefault(tensor, set())
                offsets.update((base + int(chans[a]), base + int(chans[b]) + 1))
        return True

    def _pin_tensor(self, tensor: str, reason: str) -> None:
        spaces, _ = self.pos.get(tensor, (np.zeros(0, dtype=np.int64), None))
        for s in np.unique(spaces):
            self.sp.pin_space(int(s), reason)

    def run(self) -> "ModelGraph":
        fg = self.fg
        for key, _ in fg.inputs:
            self._fresh(key, "it is computed from the model input")
        for node in fg.nodes:
            self._visit(node)
        for t in fg.outputs:
            prod = fg.producer_node(t)
            self._pin_tensor(t, f"it reaches the model output "
                                f"('{prod.key if prod else 'input'}')")
        return self._assemble()

    def _unsupported(self, node, reason: str) -> None:
        for t in node.inputs:
            if t in self.pos:
                self._pin_tensor(t, f"it feeds '{node.key}': {reason}")
        for t in node.outputs:
            self._fresh(t, f"it is the output of '{node.key}': {reason}")

    def _visit(self, node) -> None:
        fg = self.fg
        op = node.op
        rule = layer_rules.get(op)
        role = layer_rules.role_of(op, node)
        in_shape = fg.shapes.get(node.inputs[0]) if node.inputs else None
        rank = len(in_shape) if in_shape is not None else None
        if fg.calls[node.key] > 1:
            reason = f"a shared layer (called {fg.calls[node.key]} times)"
            self.unsupported.append(Pinned(node.key, reason))
            self._unsupported(node, reason)
            return
        if len(node.outputs) != 1 or not node.inputs or any(t not in self.pos
                                                             for t in node.inputs):
            self._unsupported(node, f"{type(op).__name__} with inputs or outputs "
                                    "hope_keras cannot follow")
            return
        problem = rule.check(op, rank) if role != "unsupported" else None
        if role == "unsupported" or problem:
            reason = problem or rule.check(op, rank) or (
                f"{type(op).__name__}, which hope_keras cannot see through")
            self.unsupported.append(Pinned(node.key, reason))
            self._unsupported(node, reason)
            return
        out = node.outputs[0]
        n_out = _channels(fg.shapes[out])
        if role == "source":
            self.readers.append((node.index, node.inputs[0]))
            self._fresh(out, None, writer=node.index)
            return
        if role in ("channelwise", "reshape"):
            t = node.inputs[0]
            spaces, chans = self.pos[t]
            if len(spaces) != n_out:
                self._unsupported(node, f"{type(op).__name__}, which changes the "
                                        "number of channels")
                return
            self.pos[out] = (spaces, chans)
            self.chanwise.append((node.index, t))
            return
        if role == "flatten":
            t = node.inputs[0]
            spaces, chans = self.pos[t]
            cmap = layer_rules.FlattenRule.channel_map(op, fg.shapes[t])
            self.pos[out] = (spaces[cmap], chans[cmap])
            return
        if role == "concat":
            parts = [self.pos[t] for t in node.inputs]
            self.pos[out] = (np.concatenate([p[0] for p in parts]),
                             np.concatenate([p[1] for p in parts]))
            if len(self.pos[out][0]) != n_out:
                self._unsupported(node, "a Concatenate whose channels do not add up")
            return
        if role == "merge":
            self._merge(node, n_out)
            return
        self._unsupported(node, f"{type(op).__name__}, which hope_keras cannot see through")

    def _merge(self, node, n_out: int) -> None:
        if layer_rules.get(node.op).op == "add":  # an Add layer, also `x + y` (ConvNeXt)
            self.sums.add(node.outputs[0])
        full = [t for t in node.inputs if len(self.pos[t][0]) == n_out]
        for t in node.inputs:
            if len(self.pos[t][0]) != n_out:  # broadcast over channels
                self._pin_tensor(t, f"it is broadcast over channels by '{node.key}'")
        if not full:
            self._fresh(node.outputs[0], f"it is the output of '{node.key}'")
            return
        s0, c0 = self.pos[full[0]]
        for t in full[1:]:
            s1, c1 = self.pos[t]
            if not np.array_equal(c0, c1):
                if self._cut([(s0, c0), (s1, c1)]):
                    continue  # aligned in the next walk
                reason = f"'{node.key}' combines misaligned channels"
                self._pin_tensor(full[0], reason)
                self._pin_tensor(t, reason)
                continue
            pairs = np.unique(np.stack([s0, s1]), axis=1)
            for a, b in pairs.T:
                self.sp.union(int(a), int(b))
        self.pos[node.outputs[0]] = (s0, c0)

    # -- assembling groups
    def _assemble(self) -> "ModelGraph":
        fg, sp = self.fg, self.sp
        roots_of_tensor: Dict[str, np.ndarray] = {}
        members: Dict[int, Dict[str, Tuple[np.ndarray, np.ndarray]]] = {}
        find = np.vectorize(sp.find, otypes=[np.int64]) if sp.parent else None
        root_map = np.array([sp.find(s) for s in range(len(sp.parent))], dtype=np.int64)
        for t, (spaces, chans) in self.pos.items():
            if len(spaces) == 0:
                continue
            roots = root_map[spaces]
            roots_of_tensor[t] = roots
            for r in np.unique(roots):
                if sp.pin[r] is not None:
                    continue
                sel = np.flatnonzero(roots == r)
                members.setdefault(int(r), {})[t] = (sel, chans[sel])
        del find
        # Group sizes; uneven appearances pin the group.
        groups_pos: Dict[int, Dict[str, np.ndarray]] = {}
        for r, tensors in members.items():
            n = sp.size[r]
            table = {}
            for t, (sel, chans) in tensors.items():
                counts = np.bincount(chans, minlength=n)
                if counts.size != n or np.any(counts != counts[0]) or counts[0] == 0:
                    sp.pin[r] = f"its channels appear unevenly in '{t}'"
                    break
                order = np.argsort(chans, kind="stable")
                table[t] = sel[order].reshape(n, counts[0])
            else:
                groups_pos[r] = table
        # Writers per group, in topological order. A writer whose two outputs are one
        # channel of a group (`concat([x, x]) + conv`) has no single filter: pinned.
        writers: Dict[int, List[int]] = {}
        for s, node_idx in self.writer_of.items():
            r = int(root_map[s])
            out = fg.nodes[node_idx].outputs[0]
            if r in groups_pos and groups_pos[r][out].shape[1] > 1:
                sp.pin[r] = (f"an Add ties two output channels of "
                             f"'{fg.nodes[node_idx].key}' to one channel")
                del groups_pos[r]
            if r in groups_pos:
                writers.setdefault(r, []).append(node_idx)
        writers = {r: w for r, w in writers.items() if r in groups_pos}
        groups: Dict[str, NeuronGroup] = {}
        order = sorted(writers, key=lambda r: min(writers[r]))
        readers_by_tensor: Dict[str, List[int]] = {}
        for idx, t in self.readers:
            readers_by_tensor.setdefault(t, []).append(idx)
        chan_by_tensor: Dict[str, List[int]] = {}
        for idx, t in self.chanwise:
            chan_by_tensor.setdefault(t, []).append(idx)
        group_of_root: Dict[int, str] = {}
        for r in order:
            table = groups_pos[r]
            couplings = []
            n = sp.size[r]
            for w in sorted(writers[r]):
                couplings.append(Coupling(fg.nodes[w].key, "out",
                                          table[fg.nodes[w].outputs[0]],
                                          fg.nodes[w].outputs[0]))
            for t, positions in table.items():
                for idx in chan_by_tensor.get(t, ()):
                    node = fg.nodes[idx]
                    if layer_rules.get(node.op).channel_weights(node.op):
                        couplings.append(Coupling(node.key, "channel", positions, t))
                for idx in readers_by_tensor.get(t, ()):
                    couplings.append(Coupling(fg.nodes[idx].key, "in", positions, t))
            first = fg.nodes[min(writers[r])]
            name = first.key
            mine = table[first.outputs[0]]
            if mine.size != _channels(fg.shapes[first.outputs[0]]):  # a part of its channels
                name = f"{name}[{mine.min()}:{mine.max() + 1}]"
            group = NeuronGroup(name=name, size=n, kind="coupled", couplings=tuple(couplings),
                                producer=first.key, tensors=table,
                                stream=any(t in self.sums for t in table))
            groups[name] = _as_neurons(fg, group)
            group_of_root[r] = name
        pinned = self._pinned(root_map, groups_pos)
        blocks = find_blocks(fg, groups)
        bn_after = {}
        for grp in groups.values():
            for c in grp.readers:
                node = fg.node_of(c.layer)
                kids = fg.children(node)
                if len(kids) == 1 and is_batch_norm(kids[0].op) \
                        and fg.calls[kids[0].key] == 1:
                    bn_after[c.layer] = kids[0].key
        hidden = 0
        for s, node_idx in self.writer_of.items():
            out = fg.nodes[node_idx].outputs[0]
            if not fg.is_output(out):
                hidden += sp.size[s]
        return ModelGraph(groups=groups, blocks=tuple(blocks), pinned=tuple(pinned),
                          bn_after=bn_after, flat=fg, hidden_channels=hidden)

    def _pinned(self, root_map, groups_pos) -> List[Pinned]:
        fg, sp = self.fg, self.sp
        out: List[Pinned] = []
        seen = set()
        for s, node_idx in sorted(self.writer_of.items(), key=lambda kv: kv[1]):
            r = int(root_map[s])
            if r in groups_pos:
                continue
            key = fg.nodes[node_idx].key
            if key in seen:
                continue
            seen.add(key)
            out.append(Pinned(key, sp.pin[r] or sp.pin[s] or "pinned"))
        # Unsupported layers are listed when they are what pinned some channels
        # (not, e.g., a preprocessing layer on the model input), or when they hold a
        # kernel themselves (e.g. a channels_first convolution) or wrap a layer that
        # does (TimeDistributed(Conv2D(...))).
        causes = {sp.pin[r] for r in set(root_map.tolist()) if sp.pin[r]}
        for p in self.unsupported:
            layer = fg.layers.get(p.layer)
            has_kernel = any(getattr(owner, a, None) is not None
                             for owner in (layer, getattr(layer, "layer", None))
                             for a in ("kernel", "depthwise_kernel", "pointwise_kernel"))
            if p.layer not in seen and (f"it feeds '{p.layer}': {p.reason}" in causes
                                        or "shared layer" in p.reason or has_kernel):
                seen.add(p.layer)
                out.append(p)
        return out


def normalised_together(group: NeuronGroup, get) -> bool:
    """Whether a layer that normalises across channels (LayerNormalization) reads
    `group` (``get`` looks a layer up by key): its statistics mix every channel, so
    a removed channel must be counted as a zero (`slim`) and a drifting one would
    move all the others (DEFT keeps such a group core)."""
    return any(getattr(layer_rules.get(get(c.layer)), "normalises_channels", False)
               for c in group.couplings if c.role == "channel")


def _as_neurons(fg, group: NeuronGroup) -> NeuronGroup:
    """The group as the paper's neuron layer when it has that shape; otherwise the
    group with ``note`` saying why it is pruned only."""

    def only(why):
        return dataclasses.replace(group, note=f"prune only: {why}")

    outs = [c for c in group.couplings if c.role == "out"]
    if len(outs) != 1:
        return only(f"{len(outs)} layers write these channels (coupled through "
                    "Add/Multiply)")
    if outs[0].positions.size != _channels(fg.shapes[outs[0].tensor]):
        return only(f"they are a part of the channels of '{outs[0].layer}'")
    producer = fg.node_of(outs[0].layer)
    if layer_rules.get(producer.op).kind not in ("dense", "conv", "transpose"):
        return only(f"written by a {type(producer.op).__name__}")
    act_fused = layer_rules.get(producer.op).activation(producer.op)
    if act_fused is not None:
        return only(f"the activation is fused into '{producer.key}'")
    kids = fg.children(producer)
    if len(kids) != 1 or not is_batch_norm(kids[0].op):
        return only(f"'{producer.key}' is not followed by a single BatchNormalization")
    bn = kids[0]
    kids = fg.children(bn)
    if len(kids) != 1 or layer_rules.get(kids[0].op).activation(kids[0].op) is None:
        return only(f"'{bn.key}' is not followed by a single activation")
    if not is_plain_relu(kids[0].op):
        return only(f"activation '{kids[0].key}' is not plain ReLU (merges need ReLU)")
    act = kids[0]
    consumers, passthrough = [], []
    frontier = [act]
    while frontier:
        node = frontier.pop()
        for kid in fg.children(node):
            rule = layer_rules.get(kid.op)
            role = layer_rules.role_of(kid.op, kid)
            if role == "source" and rule.kind in ("dense", "conv", "transpose"):
                consumers.append(Consumer(kid.key, rule.kind))
            elif role in ("channelwise", "flatten") and rule.is_passthrough(kid.op, kid) \
                    and not rule.channel_weights(kid.op):
                passthrough.append(kid.key)
                frontier.append(kid)
            else:
                return only(f"its channels reach '{kid.key}' ({type(kid.op).__name__})")
    roles = {(c.layer, c.role) for c in group.couplings}
    expected = {(producer.key, "out"), (bn.key, "channel")} | {
        (c.layer, "in") for c in consumers}
    if roles != expected or not consumers:
        return only("its channels flow through other layers with weights")
    return dataclasses.replace(group, kind="neurons", producer=producer.key, bn=bn.key,
                               activation=act.key, consumers=tuple(consumers),
                               passthrough=tuple(passthrough))


def walk(model: keras.Model) -> ModelGraph:
    """Finds the neuron groups, residual blocks and pinned layers of a model.

    Args:
        model: A built Functional or Sequential Keras model; nested sub-models are
            walked through.

    Returns:
        A `ModelGraph` with ``groups`` (by name, in topological order), ``blocks``
        and ``pinned``.

    Raises:
        ValueError: for unbuilt models, and subclassed ones whose `call` cannot be
            traced (`hope_keras.graph.tracing`).

    Example:

    >>> import keras
    >>> from hope_keras.graph.walker import walk
    >>> inputs = keras.Input((8,))
    >>> x = keras.layers.Dense(16)(inputs)
    >>> x = keras.layers.BatchNormalization()(x)
    >>> x = keras.layers.ReLU()(x)
    >>> outputs = keras.layers.Dense(2)(x)
    >>> graph = walk(keras.Model(inputs, outputs))
    >>> [(g.size, g.kind, len(g.consumers)) for g in graph.groups.values()]
    [(16, 'neurons', 1)]
    """
    fg, cuts = kg.flatten(model), {}
    for k in range(_MAX_PASSES - 1):
        walker = _Walker(model, fg=fg, cuts=cuts, final=False)
        graph = walker.run()
        if not walker.new_cuts:
            return graph
        more = {t: cuts.get(t, set()) | walker.new_cuts.get(t, set())
                for t in cuts.keys() | walker.new_cuts.keys()}
        if more == cuts:
            break
        cuts = more
    return _Walker(model, fg=fg, cuts=cuts).run()  # what is still misaligned is pinned


def rebuild(model: keras.Model, call_node, name: str, graph=None) -> keras.Model:
    """Rebuilds a model call by call (shared by `slim` and `calibrate`); see
    `hope_keras.graph.adapter.rebuild`."""
    return kg.rebuild(model, call_node, name, graph=graph)
