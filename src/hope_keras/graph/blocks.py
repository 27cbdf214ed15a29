"""Residual blocks: the ``Add`` of a shortcut and a branch that HOPE may evict.

A *residual block* is an ``Add`` (or a scaled sum whose shortcut keeps factor 1) of a
shortcut and a branch that starts from the shortcut's source and holds at least one
whole neuron group (`hope_keras.graph.walker`); an identity (or pooled identity)
shortcut makes it evictable: the branch goes, the sum outputs its shortcut.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple

from hope_keras.graph import layers as layer_rules
from hope_keras.activations import registry as activations

__all__ = ["ResidualBlock", "find_blocks", "is_batch_norm", "is_residual_add", "is_plain_relu"]


@dataclasses.dataclass(frozen=True)
class ResidualBlock:
    """A residual block ``Add([shortcut, branch])``.

    Attributes:
        name: The block's name (the ``Add`` layer's name).
        add: Name of the Add layer.
        groups: Groups that lie wholly inside the branch, input side first.
        final_producer: The branch's last source layer.
        final_bn: The BatchNormalization that ends the branch (None when the branch
            ends with the source itself, as in pre-activation networks); evicting
            the block makes it output exactly zero.
        shortcut: ``"identity"`` or ``"projection"``.
        evictable: True for identity shortcuts (only those can be evicted).
        input_bn: The BN that conditions the block input (docs/theory.md §5): the BN
            producing it, or None.
        block_input: The layer whose output is the block input.
        branch_layers: Every layer of the branch (what ``slim`` removes when the
            block is evicted).
        input_reader_bn: Pre-activation layouts: the BN of the branch that reads the
            block input (its moving statistics measure the stream), or None.
        input_tensor: The flat graph's key of the block input tensor (the stream the
            branch is added to).
        branch_scale: The factor the sum applies to the branch (Inception-ResNet's
            ``x + scale · r``; `hope_keras.layers.MergeRule`), 1 for an ``Add``.
    """

    name: str
    add: str
    groups: Tuple[str, ...]
    final_producer: str
    final_bn: Optional[str]
    shortcut: str
    evictable: bool
    input_bn: Optional[str]
    block_input: str
    branch_layers: Tuple[str, ...]
    input_reader_bn: Optional[str] = None
    input_tensor: Optional[str] = None
    branch_scale: float = 1.0


def is_batch_norm(op) -> bool:
    """A layer the registry knows as a batch normalization."""
    return layer_rules.get(op).normalization == "batch"


def is_residual_add(op) -> bool:
    """An Add layer (blocks are not sought at ``x + y`` operation nodes)."""
    rule = layer_rules.get(op)
    return rule.role == "merge" and rule.op == "add"


def is_plain_relu(op) -> bool:
    """ReLU with Keras' defaults (merges need it), whatever applies it: a ReLU layer,
    ``Activation("relu")``, ``keras.ops.relu`` (as the activation registry reads it)."""
    try:
        spec = activations.get(layer_rules.get(op).activation(op))  # None: linear
    except ValueError:  # not elementwise, unknown
        return False
    return spec.name == "relu" and not spec.params


_MAX_BRANCH_NODES = 400


def _passthrough_back(fg, tensor: str) -> List[str]:
    """`tensor` and the tensors it comes from through single-input pass-through
    layers (the candidates for a shortcut's source)."""
    out = [tensor]
    while True:
        node = fg.producer_node(out[-1])
        if node is None or len(node.inputs) != 1:
            return out
        rule = layer_rules.get(node.op)
        if layer_rules.role_of(node.op, node) != "channelwise" or \
                not rule.is_passthrough(node.op, node) or rule.channel_weights(node.op):
            return out
        out.append(node.inputs[0])


def _branch_nodes(fg, end: str, source: str) -> Optional[List[int]]:
    """Nodes computing `end` from `source` alone, or None."""
    stop = fg.producer.get(source, (-1, 0))[0]
    found, stack = set(), [end]
    while stack:
        t = stack.pop()
        if t == source:
            continue
        p = fg.producer.get(t)
        if p is None or p[0] <= stop:
            return None
        if p[0] in found:
            continue
        found.add(p[0])
        if len(found) > _MAX_BRANCH_NODES:
            return None
        stack.extend(fg.nodes[p[0]].inputs)
    return sorted(found)


def find_blocks(fg, groups: dict) -> List[ResidualBlock]:
    """The residual blocks of the flat graph `fg`, given its neuron groups
    (``{name: NeuronGroup}``)."""
    group_layers = {name: set(c.layer for c in g.couplings) for name, g in groups.items()}
    blocks: Dict[str, ResidualBlock] = {}
    for node in fg.nodes:
        if not is_residual_add(node.op) or len(node.inputs) != 2 \
                or fg.calls[node.key] != 1:
            continue
        scales = layer_rules.get(node.op).input_scales(node.op, 2)
        for side in (0, 1):
            if scales[1 - side] != 1.0:  # an evicted block outputs its shortcut as is
                continue
            block = _try_block(fg, node, node.inputs[side], node.inputs[1 - side],
                               group_layers, blocks)
            if block is not None:
                blocks[block.name] = dataclasses.replace(block, branch_scale=scales[side])
                break
    return list(blocks.values())


def _try_block(fg, add, branch_end: str, shortcut: str, group_layers, blocks):
    # The branch ends in [source → BN → pass-through*] or [source].
    end_tensor = branch_end
    end = fg.producer_node(end_tensor)
    while end is not None and layer_rules.role_of(end.op, end) == "channelwise" and \
            layer_rules.get(end.op).is_passthrough(end.op, end) and \
            not is_batch_norm(end.op):
        end = fg.producer_node(end.inputs[0])
    if end is None:
        return None
    final_bn = None
    if is_batch_norm(end.op):
        final_bn = end
        end = fg.producer_node(end.inputs[0])
        if end is None:
            return None
    if layer_rules.role_of(end.op, end) != "source":
        return None
    for source in _passthrough_back(fg, shortcut):
        nodes = _branch_nodes(fg, branch_end, source)
        if nodes is not None:
            kind = "identity"
            break
    else:
        # Projection: shortcut = [BN ←] source ← x, with the branch from x.
        sc = fg.producer_node(shortcut)
        if sc is not None and is_batch_norm(sc.op):
            sc = fg.producer_node(sc.inputs[0])
        if sc is None or layer_rules.role_of(sc.op, sc) != "source":
            return None
        source = sc.inputs[0]
        nodes = _branch_nodes(fg, branch_end, source)
        if nodes is None:
            return None
        kind = "projection"
    keys = [fg.nodes[i].key for i in nodes]
    inside = set(nodes)
    # A branch layer used outside the branch would make eviction change other paths.
    for i in nodes:
        for kid in fg.children(fg.nodes[i]):
            if kid.index not in inside and kid.index != add.index:
                return None
        if fg.calls[fg.nodes[i].key] != 1:
            return None
    key_set = set(keys)
    # In the groups' (topological) order.
    internal = [name for name, layers in group_layers.items() if layers <= key_set]
    if not internal:
        return None
    src_node = fg.producer_node(source)
    block_input = src_node.key if src_node is not None else source
    input_bn = _conditioning_bn(fg, src_node, blocks)
    reader_bn = None
    for i in nodes:
        n = fg.nodes[i]
        if source in n.inputs and is_batch_norm(n.op):
            reader_bn = n.key
            break
    return ResidualBlock(
        name=add.key, add=add.key, groups=tuple(internal), final_producer=end.key,
        final_bn=final_bn.key if final_bn is not None else None, shortcut=kind,
        evictable=kind == "identity", input_bn=input_bn, block_input=block_input,
        branch_layers=tuple(keys), input_reader_bn=reader_bn, input_tensor=source)


def _conditioning_bn(fg, node, blocks) -> Optional[str]:
    """The BN that produces the block input, through pass-through layers, a ReLU and
    the previous block's Add (its branch's final BN; docs/theory.md §5)."""
    seen = 0
    while node is not None and seen < 8:
        seen += 1
        if is_batch_norm(node.op):
            return node.key
        rule = layer_rules.get(node.op)
        if is_residual_add(node.op):
            block = blocks.get(node.key)
            return block.final_bn if block is not None else None
        if layer_rules.role_of(node.op, node) == "channelwise" and len(node.inputs) == 1 and (
                rule.is_passthrough(node.op, node) or is_plain_relu(node.op)):
            node = fg.producer_node(node.inputs[0])
            continue
        return None
    return None
