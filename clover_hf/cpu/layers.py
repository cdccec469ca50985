"""Which linear layers of a model the linear forms serve, and which of them take one input.

The forms (`products`) stand in for `nn.Linear.forward` of plain layers only; layers that a decoder calls on one
input (a layer's q/k/v projections, its gate and up projections) can compute in one product of their weights
stacked, which a "unit" of layers here names: a group, or a layer alone.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from clover_hf.core.quantized import plain

# sibling layers a decoder layer calls on one input, by the names transformers' decoders give them
SHARED_INPUT = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _linears(model: nn.Module) -> list[nn.Linear]:
    """Plain nn.Linear layers (exact type: quantized and adapter layers subclass it with forwards of
    their own) with a plain weight (not a quantized tensor subclass, as torchao's `quantize_` puts in)
    and without a forward set on the instance (accelerate's offloading hooks set one)."""
    return [m for m in model.modules() if type(m) is nn.Linear and plain(m.weight) and "forward" not in m.__dict__]


def plain_layers(models: Iterable[nn.Module]) -> list[nn.Linear]:
    """The models' plain linear layers (`_linears`), a layer the models share listed once, in the order found."""
    return list({id(m): m for model in models for m in _linears(model)}.values())


def shared_input_groups(models: Iterable[nn.Module]) -> list[tuple[nn.Linear, ...]]:
    """Groups of plain sibling linear layers named in SHARED_INPUT, alike in input size, dtype, device
    and bias, whose products one product of their stacked weights computes (in the order named, the
    order a forward calls them). The names only suggest it: `linear_forms` computes a member on its own
    where it is called with another input than the group's first; a module whose class sets `shared_input`
    False (Clover's Attention Decoder) is known to call them on different inputs."""
    models = list(models)
    plain_ids = {id(m) for model in models for m in _linears(model)}
    groups, seen = [], set()
    for model in models:
        for parent in model.modules():
            if not getattr(type(parent), "shared_input", True):
                continue
            for names in SHARED_INPUT:
                group = tuple(parent._modules.get(name) for name in names)
                if not all(m is not None and id(m) in plain_ids for m in group) or id(group[0]) in seen:
                    continue
                if _alike(group) and len({id(m) for m in group}) == len(group):
                    groups.append(group)
                    seen.add(id(group[0]))
    return groups


def _alike(group: tuple[nn.Linear, ...]) -> bool:
    """Whether the layers' weights stack into one product: one input size, dtype and device, all with a bias or none."""
    first = group[0]
    return all(m.in_features == first.in_features and m.weight.dtype == first.weight.dtype
               and m.weight.device == first.weight.device and (m.bias is None) == (first.bias is None) for m in group)


def _units(models: list[nn.Module], apart: Iterable[nn.Module] = (), groups: list[tuple[nn.Linear, ...]] | None = None
           ) -> list[tuple[nn.Linear, ...]]:
    """The models' plain linear layers in the order a forward runs them, a `shared_input_groups` group as
    one (but those whose first layer is in `apart`); `groups`: the models' `shared_input_groups`, where known."""
    layers = plain_layers(models)
    apart = {id(m) for m in apart}
    groups = shared_input_groups(models) if groups is None else groups
    first = {id(g[0]): g for g in groups if id(g[0]) not in apart}
    grouped = {id(m) for g in first.values() for m in g}
    return [first.get(id(m), (m,)) for m in layers if id(m) not in grouped or id(m) in first]


def shape_keys(models: Iterable[nn.Module]) -> dict[int, tuple[tuple[int, ...], bool]]:
    """Each plain linear layer's (by id) weight shape, and whether it is a model's output embedding (timed
    apart: it runs once a forward, on the last rows only in a prefill)."""
    models = list(models)
    vocab = {id(m.get_output_embeddings()) for m in models if hasattr(m, "get_output_embeddings")}
    return {id(m): (tuple(m.weight.shape), id(m) in vocab) for model in models for m in _linears(model)}
