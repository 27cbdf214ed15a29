"""The one look-up from a Keras activation to hope_keras's activation entries.

HOPE reads an activation's Gaussian moments (`hope_keras.activations`), derivative
matching its Taylor table (`hope_keras.derivative_matching`). Both are *views* of one
`ActivationEntry` per activation, registered under a name (``"silu"``) or a callable,
and both resolve what a Keras model holds the same way, here:

* a name (``"swish"`` is ``"silu"``), a Keras activation callable, a serialised dict;
* ``functools.partial(keras.activations.relu, max_value=6.0)``: the entry ``"relu"``
  with parameters, which a view reads through its *family* (HOPE has closed forms for
  the parametrised ReLU, leaky ReLU and ELU; an analytic view has none, as these
  are not real-analytic). ``partial(keras.activations.gelu, approximate=True)`` is
  ``"gelu_approximate"``;
* a layer: the activation its rule in the layer registry says it applies
  (`hope_keras.layers.LayerRule.activation`: ``ReLU(max_value=6.0)`` is the partial
  above), else its ``activation`` attribute (Dense, convolutions).

Example:
    >>> import keras
    >>> from hope_keras.activations import lookup
    >>> lookup.resolve(keras.layers.ReLU(max_value=6.0)).params
    (('max_value', 6.0), ('negative_slope', 0.0), ('threshold', 0.0))
    >>> lookup.activation_name("swish")
    'silu'
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Callable, Dict, Optional, Tuple

import keras

from hope_keras.graph import adapter as kg
from hope_keras.graph import layers as layer_rules

__all__ = ["ActivationEntry", "Resolved", "VIEWS", "register", "register_family",
           "resolve", "lookup", "activation_name", "layer_activation", "names",
           "NOT_ELEMENTWISE"]

#: The views an entry has: HOPE's Gaussian moments, derivative matching's Taylor table.
VIEWS = ("gaussian", "analytic")

#: Keras activations that are not elementwise, with the reason.
NOT_ELEMENTWISE = {
    "softmax": "softmax is not elementwise (it normalises over an axis)",
    "log_softmax": "log_softmax is not elementwise (it normalises over an axis)",
    "sparsemax": "sparsemax is not elementwise (it projects over an axis)",
    "glu": "glu is not elementwise (it gates one half of the channels by the other)",
}

#: Other names of the same activation (Keras' and the serialised name of
#: `hope_keras.derivative_matching.gelu_approximate`).
_ALIASES = {"swish": "silu", "hard_swish": "hard_silu",
            "hope_keras>gelu_approximate": "gelu_approximate"}


@dataclasses.dataclass(eq=False)
class ActivationEntry:
    """One activation and its views (None where a view does not know it).

    Attributes:
        name: The entry's name (``"silu"``), or the callable's for a callable entry.
        gaussian: Its `hope_keras.activations.GaussianActivation`.
        analytic: Its `hope_keras.derivative_matching.AnalyticActivation`.
    """

    name: str
    gaussian: object = None
    analytic: object = None

    def view(self, view: str):
        return getattr(self, view)


@dataclasses.dataclass(frozen=True)
class Resolved:
    """A Keras activation as the look-up reads it.

    Attributes:
        name: The canonical name (``"silu"`` for ``"swish"``), or None.
        params: Keyword parameters (of a ``functools.partial`` or an activation
            layer), sorted by name; ``()`` for the plain activation.
        entry: The entry registered for the callable itself, if any.
        problem: Why the identifier cannot be read (then ``name`` may be None).
    """

    name: Optional[str]
    params: Tuple[Tuple[str, object], ...] = ()
    entry: Optional[ActivationEntry] = None
    problem: Optional[str] = None


_BY_NAME: Dict[str, ActivationEntry] = {}
_BY_CALLABLE: Dict[Callable, ActivationEntry] = {}
_FAMILIES: Dict[Tuple[str, str], Callable] = {}


def register(activation, view: str, spec, *, overwrite: bool = False,
             caller: str = "register") -> None:
    """Sets the `view` of the entry of `activation` (a name or a callable).

    Raises:
        ValueError: if `activation` is neither a string nor a callable, or the view
            is already set to another spec and `overwrite` is False.
    """
    if view not in VIEWS:
        raise ValueError(f"view must be one of {VIEWS}. Received: view={view!r}")
    if isinstance(activation, str):
        table, key = _BY_NAME, _ALIASES.get(activation, activation)
    elif callable(activation):
        table, key = _BY_CALLABLE, activation
    else:
        raise ValueError(f"{caller} expects a callable or a string name. "
                         f"Received: activation={activation!r}")
    entry = table.get(key)
    if entry is None:
        entry = table[key] = ActivationEntry(
            key if isinstance(key, str) else str(getattr(key, "__name__", key)))
    old = entry.view(view)
    if old is not None and old is not spec and not overwrite:
        raise ValueError(f"Activation {activation!r} is already registered as "
                         f"{old.name!r}; pass overwrite=True to replace it.")
    setattr(entry, view, spec)


def register_family(name: str, view: str, factory: Callable) -> None:
    """`factory(**params)` gives the `view` of activation `name` with parameters
    (``register_family("relu", "gaussian", relu)``)."""
    _FAMILIES[(name, view)] = factory


def names(view: str) -> Tuple[str, ...]:
    """The names (aliases included) whose entry has `view`, sorted."""
    known = {n for n, e in _BY_NAME.items() if e.view(view) is not None}
    known |= {a for a, n in _ALIASES.items() if n in known}
    return tuple(sorted(known))


def _callable_name(fn) -> Optional[str]:
    try:
        with warnings.catch_warnings():  # keras warns when it serialises a lambda
            warnings.simplefilter("ignore")
            name = keras.activations.serialize(fn)
    except Exception:  # noqa: BLE001 - exotic callables: their __name__ below
        name = None
    if isinstance(name, dict):
        name = name.get("config", name.get("class_name"))
    if not isinstance(name, str):
        name = getattr(fn, "__name__", None)
    return name


def layer_activation(layer):
    """The Keras activation `layer` applies: its rule's (`hope_keras.layers`), else its
    ``activation`` attribute; None when it applies none. A rule gives the layer
    itself for an activation with learned per-channel parameters (PReLU)."""
    act = layer_rules.get(layer).activation(layer)
    return getattr(layer, "activation", None) if act is None else act


def _from_partial(fn: functools.partial) -> Optional[Resolved]:
    if fn.args:
        return None
    base = resolve(fn.func)
    if base.name is None or base.problem or base.params:
        return None
    kw = dict(fn.keywords or {})
    if base.name == "gelu" and set(kw) <= {"approximate"}:
        return Resolved("gelu_approximate" if kw.get("approximate") else "gelu")
    return Resolved(base.name, tuple(sorted(kw.items())))


def resolve(identifier) -> Resolved:
    """Reads a Keras activation: a name, callable, ``functools.partial``, serialised
    dict, activation layer, or None (linear). See the module docstring."""
    if identifier is None:
        return Resolved("linear")
    if kg.is_layer(identifier):
        act = layer_activation(identifier)
        if act is None:
            return Resolved(None, problem="applies no activation")
        if act is identifier:
            return Resolved(None, problem=(
                f"{type(identifier).__name__} has learned per-channel parameters, "
                "not supported"))
        return resolve(act)
    if isinstance(identifier, dict):
        try:
            identifier = keras.activations.deserialize(identifier)
        except Exception as exc:  # noqa: BLE001 - reported with the identifier
            return Resolved(None, problem=(
                f"Could not deserialise the activation {identifier!r}: {exc}"))
    entry = None
    if callable(identifier):
        try:
            entry = _BY_CALLABLE.get(identifier)
        except TypeError:  # unhashable
            entry = None
        if entry is None and isinstance(identifier, functools.partial):
            found = _from_partial(identifier)
            if found is not None:
                return found
        name = _callable_name(identifier)
    elif isinstance(identifier, str):
        name = identifier
    else:
        return Resolved(None, problem=(
            f"Could not interpret the activation identifier. Received: {identifier!r}"))
    return Resolved(_ALIASES.get(name, name), entry=entry)


def lookup(identifier, view: str):
    """``(spec, resolved)``: the `view` of the activation `identifier` names (None
    when that view does not know it) and how it was read (`resolve`)."""
    found = resolve(identifier)
    if found.problem:
        return None, found
    if found.entry is not None and found.entry.view(view) is not None:
        return found.entry.view(view), found
    if found.params:
        factory = _FAMILIES.get((found.name, view))
        if factory is None:
            return None, found
        try:
            return factory(**dict(found.params)), found
        except TypeError as exc:  # parameters the family does not take
            return None, dataclasses.replace(found, problem=(
                f"Could not read the parameters of activation {found.name!r} "
                f"{dict(found.params)}: {exc}"))
    entry = _BY_NAME.get(found.name) if found.name is not None else None
    return (entry.view(view) if entry is not None else None), found


def activation_name(identifier) -> Optional[str]:
    """The canonical name of a Keras activation (``"silu"`` for ``"swish"``), or
    None when it cannot be read."""
    return resolve(identifier).name


def _bind_keras_callables() -> None:
    """Keras' activation functions resolve to their entries without serialising."""
    A = keras.activations
    for name in ("relu", "relu6", "leaky_relu", "elu", "selu", "hard_sigmoid", "hard_silu",
                 "sigmoid", "tanh", "softplus", "silu", "gelu", "mish", "linear", "swish",
                 "hard_swish"):
        fn = getattr(A, name, None)
        if fn is not None:
            _BY_CALLABLE.setdefault(fn, _BY_NAME.setdefault(
                _ALIASES.get(name, name), ActivationEntry(_ALIASES.get(name, name))))


_bind_keras_callables()
