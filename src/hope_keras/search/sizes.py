"""Live parameter and FLOPs counts of the model a HOPE run is slimming.

`SizeCounter` keeps, per tensor, its live channel count and, per layer whose size
depends on it, its parameters and FLOPs (the layer registry's formulas,
`hope_keras.layers`); a step recounts only the layers it touched. The encoder
(`hope_keras.search.encoder.Encoder`) ranks actions by what they save (`SizeCounter.marginal`)
and stops at a parameter or FLOPs budget on these counts.
"""

from __future__ import annotations

import copy
from typing import Dict, Iterable

import numpy as np

from hope_keras.edit.slim import live_channels
from hope_keras.graph import layers as layer_rules
from hope_keras.scoring.analysis import Analysis
from hope_keras.graph import adapter as kg


class SizeCounter:
    """Live parameters and FLOPs of the slimmed model, updated per touched layer.

    Every tensor has a live channel count; removing a channel of a group lowers it
    on every tensor the group flows through, and each layer's size is recounted
    from its input and output live counts by its layer rule (`hope_keras.layers`).
    A step recounts only the layers of the group it touched. FLOPs are 2 × the
    multiply-adds of the layers with kernels (Dense, ConvND, depthwise and
    separable convolutions) for one example; BN, activations and pooling count 0.
    """

    def __init__(self, model, analysis: Analysis):
        g = analysis.graph
        fg = g.flat
        self.fg = fg
        self.params0 = int(model.count_params())
        self.live = {name: grp.size for name, grp in g.groups.items()}
        self.tensor_live = {t: (int(s[-1]) if len(s) > 1 and s[-1] else 0)
                            for t, s in fg.shapes.items()}
        self.group_tensors = {name: {t: pos.shape[1] for t, pos in grp.tensors.items()}
                              for name, grp in g.groups.items()}
        self.layers_of: Dict[str, set] = {}
        touched = set()
        for name, grp in g.groups.items():
            keys = set()
            for t in grp.tensors:
                p = fg.producer_node(t)
                if p is not None:
                    keys.add(p.key)
                keys |= {fg.nodes[k].key for k in fg.consumers.get(t, ())}
            keys = {k for k in keys if _sized(fg.layers[k])}
            self.layers_of[name] = keys
            touched |= keys
        for b in g.blocks:
            touched |= {k for k in b.branch_layers if _sized(fg.layers[k])}
        self.evicted: set = set()
        self._formulas: Dict[str, tuple] = {}
        self.flops0 = sum(self._node_flops(n) for n in fg.nodes)
        self.params_now, self.flops_now = {}, {}
        for key in touched:
            self.params_now[key], self.flops_now[key] = self._count(key)
        self.params = self.params0
        self.flops = self.flops0

    def _node_flops(self, node, tensor_live=None) -> int:
        layer = node.op
        if not kg.is_layer(layer) or not node.inputs or not node.outputs:
            return 0
        live = self.tensor_live if tensor_live is None else tensor_live
        rule = layer_rules.get(layer)
        return int(rule.flops(layer, node, live[node.inputs[0]], live[node.outputs[0]],
                              self.fg.shapes[node.inputs[0]], self.fg.shapes[node.outputs[0]]))

    def _size_at(self, key: str, n_in, n_out):
        """(params, flops) of layer `key` at input/output widths (rule formulas)."""
        node = self.fg.node_of(key)
        layer = node.op
        rule = layer_rules.get(layer)
        role = layer_rules.role_of(layer, node)
        if role == "source":
            params = layer_rules.weight_param_count(layer, rule, n_in, n_out, None)
        elif role == "channelwise":
            params = layer_rules.weight_param_count(layer, rule, None, None, n_in)
        else:
            params = int(layer.count_params())
        flops = 0
        if node.inputs and node.outputs:
            flops = int(rule.flops(layer, node, n_in, n_out, self.fg.shapes[node.inputs[0]],
                                   self.fg.shapes[node.outputs[0]]))
        return params, flops

    def _formula(self, key: str):
        """Bilinear coefficients of (params, flops) in (live in, live out): every
        layer rule's sizes are affine in each width, so four probes fix them."""
        f = self._formulas.get(key)
        if f is None:
            (p11, f11), (p21, f21), (p12, f12), (p22, f22) = (
                self._size_at(key, a, b) for a, b in ((1, 1), (2, 1), (1, 2), (2, 2)))
            pc = p22 - p21 - p12 + p11
            fc = f22 - f21 - f12 + f11
            pa, fa = p21 - p11 - pc, f21 - f11 - fc
            pb, fb = p12 - p11 - pc, f12 - f11 - fc
            f = (p11 - pa - pb - pc, pa, pb, pc, f11 - fa - fb - fc, fa, fb, fc)
            node = self.fg.node_of(key)
            f = f + (node.inputs[0] if node.inputs else None,
                     node.outputs[0] if node.outputs else None)
            self._formulas[key] = f
        return f

    def _count(self, key: str, tensor_live=None):
        """(params, flops) of layer `key` at the given live tensor widths."""
        if key in self.evicted:
            return 0, 0
        live = self.tensor_live if tensor_live is None else tensor_live
        p0, pa, pb, pc, f0, fa, fb, fc, t_in, t_out = self._formula(key)
        a = live[t_in] if t_in is not None else 0
        b = live[t_out] if t_out is not None else 0
        return p0 + pa * a + pb * b + pc * a * b, f0 + fa * a + fb * b + fc * a * b

    def _lives_after(self, group: str, removed: int):
        live = dict(self.tensor_live)
        for t, k in self.group_tensors[group].items():
            live[t] -= k * removed
        return live

    def remove(self, group: str, removed: int) -> None:
        """Records that `group` lost `removed` channels (recount with `update`)."""
        self.live[group] -= removed
        for t, k in self.group_tensors[group].items():
            self.tensor_live[t] -= k * removed

    def update(self, names: Iterable[str]) -> None:
        for name in names:
            p, f = self._count(name)
            self.params += p - self.params_now[name]
            self.flops += f - self.flops_now[name]
            self.params_now[name], self.flops_now[name] = p, f

    def marginal(self, group: str, removed: int = 1):
        """(params, flops) the slimmed model loses if `group` loses `removed` channels."""
        live = {t: self.tensor_live[t] - k * removed
                for t, k in self.group_tensors[group].items()}
        full = _Overlay(self.tensor_live, live)
        dp = df = 0
        for name in self.layers_of[group]:
            p, f = self._count(name, full)
            dp += self.params_now[name] - p
            df += self.flops_now[name] - f
        return dp, df

    def savings(self, layers) -> tuple:
        """(params, flops) the slimmed model loses with `layers` (an evicted block's
        branch)."""
        dp = sum(self.params_now[layer] for layer in layers if layer in self.params_now)
        df = sum(self.flops_now[layer] for layer in layers if layer in self.flops_now)
        return dp, df

    def evict(self, branch_layers, groups) -> None:
        """Records an evicted block: its branch layers and every live channel of its
        groups go (recount with `update`)."""
        self.evicted |= set(branch_layers)
        for g in groups:
            self.remove(g, self.live[g])

    def save(self, touched, groups, evict: bool = False):
        """What a step may change (the `touched` layers' counts, the totals, the
        live counts of `groups` and of their tensors): `restore` puts it back."""
        return ({k: (self.params_now[k], self.flops_now[k]) for k in touched},
                self.params, self.flops, {g: self.live[g] for g in groups},
                {t: self.tensor_live[t] for g in groups for t in self.group_tensors[g]},
                set(self.evicted) if evict else None)

    def restore(self, saved) -> None:
        """Undoes the changes since `save` gave `saved`."""
        for k, (p, f) in saved[0].items():
            self.params_now[k], self.flops_now[k] = p, f
        self.params, self.flops = saved[1], saved[2]
        self.live.update(saved[3])
        self.tensor_live.update(saved[4])
        if saved[5] is not None:
            self.evicted = saved[5]

    def ratios_at(self, live_per_group, evicted_layers):
        """(parameter ratio, FLOPs ratio) with each group of `live_per_group` at that
        many live channels and `evicted_layers` gone (this counter unchanged)."""
        counter = self.copy()
        for n, v in live_per_group.items():
            counter.remove(n, counter.live[n] - max(v, 0))
        counter.evicted |= set(evicted_layers)
        counter.update(list(counter.params_now))
        return counter.params_ratio, counter.flops_ratio

    def copy(self) -> "SizeCounter":
        """An independent counter in the same state (formulas shared)."""
        new = copy.copy(self)
        for attr in ("live", "tensor_live", "params_now", "flops_now"):
            setattr(new, attr, dict(getattr(self, attr)))
        new.evicted = set(self.evicted)
        return new

    @property
    def params_ratio(self) -> float:
        return self.params / self.params0

    @property
    def flops_ratio(self) -> float:
        return self.flops / max(self.flops0, 1)


class _Overlay(dict):
    """A read-only view of `base` with a few keys replaced (no copy)."""

    def __init__(self, base, changes):
        super().__init__(changes)
        self._base = base

    def __missing__(self, key):
        return self._base[key]


def _sized(layer) -> bool:
    """Whether a layer's size (parameters or FLOPs) depends on its channel counts."""
    if not kg.is_layer(layer):
        return False
    return bool(layer.weights) or layer_rules.get(layer).role == "source"



def start_from_live_channels(model, graph, groups, counter: SizeCounter, evictions) -> int:
    """What an earlier compression removed (the channels and evicted blocks that
    `slim` drops) starts removed: the densities, ratios and budgets of a run count
    from the model as given, not from its dense shapes. Only groups with a channel
    of zero capacity are read again (none in an uncompressed model).

    Returns the number of neurons found removed; ``groups`` (the encoder's live
    group states) and ``counter`` are updated."""
    touched, removed = evictions.evict_dead_branches(counter)
    for name, gs in groups.items():
        if gs.frozen or not np.any(np.asarray(gs.cache.capacity)[gs.active] == 0.0):
            continue
        dead = gs.active & ~live_channels(model, graph.groups[name], graph)
        if dead.all():  # a group the model does not use at all: left as it is
            continue
        gs.drop(dead)
        counter.remove(name, int(dead.sum()))
        touched |= counter.layers_of[name]
        removed += int(dead.sum())
    if touched:
        counter.update(touched & set(counter.params_now))
    return removed
