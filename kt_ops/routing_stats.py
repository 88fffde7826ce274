"""Expert hit counts of a model's MoE layers: the calibration of CPU/GPU hybrid inference.

:func:`record_routing` counts, per experts module (transformers' own or kt_ops'
:class:`kt_ops.nn.MoEExperts`), how many (token, slot) pairs the router sends to
each expert; :func:`collect_routing_stats` runs one forward pass under it.
:meth:`RoutingStats.hottest` picks each layer's most used experts, which
``kt_ops.replace_experts(..., num_gpu_experts=n, routing_stats=stats)`` or
:func:`kt_ops.hf.set_gpu_experts` keep on the GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Optional

import torch
from torch import Tensor, nn

from kt_ops.hf_experts import UnsupportedExpertsError, _plan
from kt_ops.nn import MoEExperts, hottest_experts

__all__ = ["RoutingStats", "collect_routing_stats", "record_routing"]


class RoutingStats:
    """Per-layer expert hit counts from :func:`record_routing` / :func:`collect_routing_stats`.

    ``counts[name]`` is an int64 ``[E]`` CPU tensor: how many (token, slot)
    pairs the router sent to each expert of the experts module ``name`` (its
    qualified name in the model, the same before and after
    :func:`replace_experts`). Slots with id ``-1`` are not counted.
    """

    def __init__(self, counts: Optional[dict[str, Tensor]] = None) -> None:
        """``counts``: experts module name -> int64 ``[E]`` hit counts (copied shallowly)."""
        self.counts: dict[str, Tensor] = dict(counts or {})

    def __getitem__(self, name: str) -> Tensor:
        return self.counts[name]

    def __contains__(self, name: object) -> bool:
        return name in self.counts

    def __repr__(self) -> str:
        total = sum(int(c.sum()) for c in self.counts.values())
        return f"RoutingStats({len(self.counts)} experts modules, {total} routed slots)"

    def hottest(self, name: str, n: int) -> Tensor:
        """The ``n`` most hit experts of module ``name`` (sorted int64 ids; ties: lower id)."""
        return hottest_experts(self.counts[name], n)

    def _add(self, name: str, ids: Tensor) -> None:
        counts = self.counts[name]
        ids = ids.detach().reshape(-1).to("cpu", torch.long)
        ids = ids[(ids >= 0) & (ids < counts.numel())]
        counts += torch.bincount(ids, minlength=counts.numel())


def _routed_ids(args: tuple, kwargs: dict) -> Optional[Tensor]:
    """``top_k_index`` of an ``experts(hidden_states, top_k_index, top_k_weights)`` call."""
    if len(args) >= 2:
        return args[1]
    return kwargs.get("top_k_index")


@contextlib.contextmanager
def record_routing(model: nn.Module) -> Iterator[RoutingStats]:
    """Count, per experts module of ``model``, the tokens routed to each expert while inside.

    Works before and after :func:`replace_experts`: it hooks every experts
    module :func:`find_experts` reports and every :class:`kt_ops.nn.MoEExperts`.
    Modules called as ``experts(hidden_states, top_k_index, top_k_weights)``
    (transformers' fused experts, ``MoEExperts``) count ``top_k_index``; an
    ``nn.ModuleList`` of expert MLPs (whose parent loops over them) counts the
    rows each expert MLP is called on. The hooks are removed on exit.

    Yields:
        A :class:`RoutingStats`, filled as the model runs (all zeros for
        modules that saw no token).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        UnsupportedExpertsError: as :func:`find_experts`, or the model has no
            experts module.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"record_routing: expected a torch.nn.Module, got {type(model).__name__}")
    plans, _ = _plan(model)
    targets = {p.info.name: (p.module, p.info) for p in plans}
    for name, module in model.named_modules():
        if isinstance(module, MoEExperts):
            targets[name] = (module, None)
    if not targets:
        raise UnsupportedExpertsError(
            f"record_routing: {type(model).__name__} has no MoE experts module"
        )
    stats = RoutingStats()
    handles = []

    def on_call(name):
        def hook(module, args, kwargs):
            ids = _routed_ids(args, kwargs)
            if isinstance(ids, Tensor):
                stats._add(name, ids)

        return hook

    def on_expert(name, index):
        def hook(module, args):
            if args and isinstance(args[0], Tensor):
                rows = args[0].reshape(-1, args[0].shape[-1]).shape[0] if args[0].dim() else 1
                stats.counts[name][index] += rows

        return hook

    try:
        for name, (module, info) in targets.items():
            num_experts = info.num_experts if info is not None else module.num_experts
            stats.counts[name] = torch.zeros(num_experts, dtype=torch.long)
            if info is not None and info.layout == "module_list":
                for i, mlp in enumerate(module):
                    handles.append(mlp.register_forward_pre_hook(on_expert(name, i)))
            else:
                handles.append(module.register_forward_pre_hook(on_call(name), with_kwargs=True))
        yield stats
    finally:
        for handle in handles:
            handle.remove()


def collect_routing_stats(model: nn.Module, *args, **kwargs) -> RoutingStats:
    """Run ``model(*args, **kwargs)`` once under ``torch.no_grad`` and count the routing.

    A calibration pass: ``collect_routing_stats(model, input_ids)`` with a
    representative prompt gives the per-layer hit counts that
    :func:`replace_experts` / :func:`set_gpu_experts` use to keep the hottest
    experts on the GPU. Call it several times and merge, or use
    :func:`record_routing` around your own loop, for more data.

    Args:
        model: a model with MoE experts (before or after :func:`replace_experts`).
        *args, **kwargs: the forward call's arguments (``input_ids [B, S]``, ...).

    Returns:
        :class:`RoutingStats`: ``counts[name]``, int64 ``[E]`` per experts module.

    Raises:
        What :func:`record_routing` and the model's forward raise.
    """
    with record_routing(model) as stats, torch.no_grad():
        model(*args, **kwargs)
    return stats
