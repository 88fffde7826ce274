"""GPU-resident experts of :class:`kt_ops.nn.MoEExperts`: the hot experts in plain PyTorch.

CPU/GPU hybrid inference keeps the experts a model hits most as dense weights
on the GPU and runs the rest on the CPU (kt_ops' op, with ``gpu_experts_mask``).
:class:`GpuResidentExperts` is the half of ``MoEExperts`` that does the GPU
part: choosing the experts (:meth:`~GpuResidentExperts.set_gpu_experts`,
:func:`hottest_experts`), holding their dense copies as buffers that follow
``.to()``, computing them with torch (gathered per slot or grouped per expert,
LoRA included), and running the op beside them on a side CUDA stream so both
overlap. The CPU module itself (packed weights, the op, LoRA, the prepared
layer) is ``kt_ops/nn.py``.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Optional, Union

import torch
from torch import Tensor

from kt_ops.formats.dequant import dequantize_weights
from kt_ops.layer import PROJECTIONS, LoRAWeights, torch_glu

__all__ = ["GpuExperts", "GpuResidentExperts", "hottest_experts", "parse_gpu_experts"]

#: The dense weights of the GPU-resident experts: (buffer name, projection).
_GPU_WEIGHTS = (("gpu_gate_weight", "gate"), ("gpu_up_weight", "up"), ("gpu_down_weight", "down"))

#: Buffers that describe the GPU-resident experts (all non-persistent).
_GPU_BUFFERS = ("gpu_experts_mask", "gpu_expert_ids", "gpu_expert_slot") + tuple(
    name for name, _ in _GPU_WEIGHTS
)

_GPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

#: What selects the GPU-resident experts: a bool mask [E], expert ids, a count of
#: hottest experts (with routing counts), or None (no GPU experts).
GpuExperts = Union[None, Tensor, Sequence[int], int]


def hottest_experts(routing_counts: Tensor, n: int) -> Tensor:
    """The ``n`` experts with the most routed tokens, as sorted int64 ids.

    Args:
        routing_counts: ``[E]`` hit counts per expert (any real dtype, any
            device), e.g. from :func:`kt_ops.hf.collect_routing_stats`.
        n: how many experts to pick, ``0 <= n <= E``.

    Returns:
        int64 ``[n]`` expert ids in ascending order, on the CPU. Ties are broken
        towards the lower id, so the choice is deterministic.

    Raises:
        ValueError: ``routing_counts`` is not a 1-D real tensor, or ``n`` is
            not an int in ``[0, E]``.
    """
    if (
        not isinstance(routing_counts, Tensor)
        or routing_counts.dim() != 1
        or routing_counts.is_complex()
        or routing_counts.dtype == torch.bool
    ):
        what = (
            f"{routing_counts.dtype} {list(routing_counts.shape)}"
            if isinstance(routing_counts, Tensor)
            else type(routing_counts).__name__
        )
        raise ValueError(f"routing_counts must be a 1-D [E] tensor of hit counts, got {what}")
    E = routing_counts.shape[0]
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= E:
        raise ValueError(f"n must be an int in [0, E={E}], got {n!r}")
    counts = routing_counts.detach().cpu().double()
    order = torch.sort(counts, descending=True, stable=True).indices
    return order[:n].sort().values


def parse_gpu_experts(
    gpu_experts: GpuExperts,
    routing_counts: Optional[Tensor],
    num_experts: int,
    where: str = "MoEExperts.set_gpu_experts",
) -> Tensor:
    """``gpu_experts`` (see :meth:`MoEExperts.set_gpu_experts`) as sorted, distinct int64 CPU ids.

    ``None`` gives no ids.

    Raises:
        ValueError: prefixed with ``where``, naming ``gpu_experts`` or
            ``routing_counts``, for a selection that is not valid for
            ``num_experts`` experts.
    """
    E = num_experts
    if gpu_experts is None:
        return torch.empty(0, dtype=torch.long)
    if routing_counts is not None and (
        isinstance(gpu_experts, bool) or not isinstance(gpu_experts, int)
    ):
        raise ValueError(
            f"{where}: routing_counts is used only with an int gpu_experts (a count of "
            f"hottest experts), got gpu_experts of type {type(gpu_experts).__name__}"
        )
    if isinstance(gpu_experts, bool):
        raise ValueError(
            f"{where}: gpu_experts must be a bool mask [E={E}], expert ids or an int count, "
            f"got {gpu_experts!r}"
        )
    if isinstance(gpu_experts, int):
        if routing_counts is None:
            raise ValueError(
                f"{where}: gpu_experts={gpu_experts} is a count of hottest experts and needs "
                "routing_counts ([E] hits per expert, e.g. from "
                "kt_ops.hf.collect_routing_stats); pass expert ids or a mask instead to "
                "choose them yourself"
            )
        if not 0 <= gpu_experts <= E:
            raise ValueError(
                f"{where}: gpu_experts as a count must be in [0, E={E}], got {gpu_experts}"
            )
        if isinstance(routing_counts, Tensor) and routing_counts.shape != (E,):
            raise ValueError(
                f"{where}: routing_counts must be [E={E}], got {list(routing_counts.shape)}"
            )
        try:
            return hottest_experts(routing_counts, gpu_experts)
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None
    if isinstance(gpu_experts, Tensor):
        t = gpu_experts.detach()
        if t.dtype == torch.bool:
            if t.shape != (E,):
                raise ValueError(
                    f"{where}: gpu_experts as a bool mask must be [E={E}], got {list(t.shape)}"
                )
            return t.cpu().nonzero().flatten()
        if t.is_floating_point() or t.is_complex() or t.dim() > 1:
            raise ValueError(
                f"{where}: gpu_experts must be a bool mask [E={E}] or a 1-D integer tensor "
                f"of expert ids, got {t.dtype} {list(t.shape)}"
            )
        ids = t.cpu().long().flatten()
    else:
        try:
            ids = torch.tensor([operator.index(i) for i in gpu_experts], dtype=torch.long)
        except TypeError:
            raise ValueError(
                f"{where}: gpu_experts must be a bool mask [E={E}], a sequence of int expert "
                f"ids or an int count, got {type(gpu_experts).__name__}"
            ) from None
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= E):
        raise ValueError(f"{where}: gpu_experts has expert ids outside [0, E={E}): {ids.tolist()}")
    if ids.unique().numel() != ids.numel():
        raise ValueError(f"{where}: gpu_experts has repeated expert ids: {ids.tolist()}")
    return ids.sort().values


class GpuResidentExperts:
    """Mixin of :class:`kt_ops.nn.MoEExperts`: its GPU-resident experts.

    The host class provides ``num_experts``, ``hidden_size``,
    ``intermediate_size``, ``activation``, ``expert_weights()``,
    ``lora_weights()`` and ``_cpu_experts(x, ids, weights, mask)`` (the op on
    the experts not on the GPU), and calls :meth:`_init_gpu_experts` in its
    constructor.
    """

    def _init_gpu_experts(self) -> None:
        for name in _GPU_BUFFERS:
            self.register_buffer(name, None, persistent=False)
        self._all_gpu = False
        self._gpu_id_list: list[int] = []

    #: With CUDA hidden states and GPU experts, run the op on a side stream so that it
    #: overlaps with the GPU experts (``False``: both on the current stream, in order).
    cuda_overlap: bool = True

    #: How the GPU experts are computed: ``True`` gathers the weights of every (token,
    #: slot) (no host sync: CUDA graphs, decode), ``False`` groups the slots by expert;
    #: ``None`` (default): gather on CUDA when capturing a graph or when ``T*K`` is at
    #: most the number of GPU experts (the copies then stay within the size of the GPU
    #: experts' weights), else group (always on the CPU, where a sync costs nothing).
    gpu_gather: Optional[bool] = None

    @property
    def num_gpu_experts(self) -> int:
        """How many experts are GPU-resident (computed by torch, skipped by the op)."""
        ids = self.gpu_expert_ids
        return 0 if ids is None else int(ids.shape[0])

    def set_gpu_experts(
        self,
        gpu_experts: GpuExperts,
        *,
        routing_counts: Optional[Tensor] = None,
        dense: Optional[tuple[Tensor, Tensor, Tensor]] = None,
        dtype: Optional[torch.dtype] = None,
        device: Optional[Union[str, torch.device]] = None,
    ) -> GpuResidentExperts:
        """Choose the GPU-resident experts (CPU/GPU hybrid); replaces any previous choice.

        The chosen experts' weights are kept as dense buffers
        ``gpu_{gate,up,down}_weight`` (``[n, I, H]``, ``[n, I, H]``,
        ``[n, H, I]``, rows in ascending expert id) that follow ``.to()`` and
        ``.cuda()``; forward computes those experts with plain torch and the op
        skips them (``gpu_experts_mask``). The packed weights are kept whole, so
        the choice can be changed at any time. :attr:`num_gpu_experts` and
        ``extra_repr`` show the count.

        Args:
            gpu_experts: a bool mask ``[E]`` (``True``: GPU-resident), expert
                ids (a sequence of ints or a 1-D integer tensor, distinct, in
                ``[0, E)``), an ``int`` ``n``: the ``n`` most hit experts of
                ``routing_counts`` (:func:`hottest_experts`), or ``None`` / an
                empty selection: no GPU experts (the module is CPU-only again).
            routing_counts: ``[E]`` hits per expert (e.g. one layer's counts of
                :func:`kt_ops.hf.collect_routing_stats`); only with an ``int``
                ``gpu_experts``.
            dense: the layer's dense weights ``(gate [E, I, H], up [E, I, H],
                down [E, H, I])`` to copy the chosen experts from (what
                :meth:`from_dense` and :func:`kt_ops.replace_experts` pass: the
                model's own weights). ``None``: the chosen experts are
                dequantized from the packed weights once
                (:func:`kt_ops.formats.dequantize_weights`, exact).
            dtype: dtype of the dense copies, fp32, bf16 or fp16. Default: that
                of ``dense``, else that of the current GPU experts, else fp32.
            device: their device. Default: that of ``dense``, else that of the
                current GPU experts, else the CPU.

        Returns:
            ``self``.

        Raises:
            ValueError: naming the argument: a mask that is not bool ``[E]``,
                ids out of range or repeated, a float tensor, an ``int`` without
                ``routing_counts`` or outside ``[0, E]``, ``routing_counts``
                that is not ``[E]`` (or given with a mask or ids), ``dense``
                tensors of the wrong shapes, or a ``dtype`` that is not a float
                type the experts compute in.
        """
        where = "MoEExperts.set_gpu_experts"
        ids = parse_gpu_experts(gpu_experts, routing_counts, self.num_experts)
        if ids.numel() and any(self._buffers.get(f"{p}_bias") is not None for p in PROJECTIONS):
            raise ValueError(
                f"{where}: GPU-resident experts of a layer with per-expert biases (gpt-oss) are "
                "not supported yet; keep this layer's experts on the CPU (gpu_experts=None)"
            )
        if dtype is not None and dtype not in _GPU_DTYPES:
            raise ValueError(f"{where}: dtype must be fp32, bf16 or fp16, got {dtype}")
        E, H, inter = self.num_experts, self.hidden_size, self.intermediate_size
        if dense is not None:
            shapes = ((E, inter, H), (E, inter, H), (E, H, inter))
            if (
                not isinstance(dense, (tuple, list))
                or len(dense) != 3
                or not all(isinstance(t, Tensor) and t.is_floating_point() for t in dense)
                or any(tuple(t.shape) != shape for t, shape in zip(dense, shapes))
            ):
                got = (
                    [tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__ for t in dense]
                    if isinstance(dense, (tuple, list))
                    else type(dense).__name__
                )
                raise ValueError(
                    f"{where}: dense must be floating (gate [E, I, H], up [E, I, H], down "
                    f"[E, H, I]) = {list(shapes)}, got {got}"
                )
        old = self.gpu_gate_weight
        if dtype is None:
            dtype = (
                dense[0].dtype if dense is not None else (old.dtype if old is not None else None)
            )
            if dtype not in _GPU_DTYPES:
                dtype = torch.float32
        if device is None:
            device = (
                dense[0].device
                if dense is not None
                else (old.device if old is not None else torch.device("cpu"))
            )
        device = torch.device(device)
        for name in _GPU_BUFFERS:
            setattr(self, name, None)
        self._all_gpu = False
        self._gpu_id_list = []
        if ids.numel() == 0:
            return self
        with torch.no_grad():
            if dense is not None:
                weights = [t.detach().index_select(0, ids.to(t.device)) for t in dense]
            else:
                weights = [
                    dequantize_weights(p.select_experts(ids))
                    for p in self.expert_weights().projections
                ]
            for (name, _), w in zip(_GPU_WEIGHTS, weights):
                setattr(self, name, w.to(device=device, dtype=dtype).contiguous())
        mask = torch.zeros(E, dtype=torch.bool)
        mask[ids] = True
        slot = torch.full((E,), -1, dtype=torch.long)
        slot[ids] = torch.arange(ids.numel())
        self.gpu_experts_mask = mask.to(device)
        self.gpu_expert_ids = ids.to(device)
        self.gpu_expert_slot = slot.to(device)
        self._all_gpu = ids.numel() == E
        self._gpu_id_list = ids.tolist()
        return self

    def _refresh_gpu_weights(self) -> None:
        """Dequantize the current GPU experts again from the packed weights (same dtype/device)."""
        if self.num_gpu_experts:
            self.set_gpu_experts(self.gpu_expert_ids.cpu())

    def _hybrid_forward(self, x: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
        """``[T, H]`` in ``x``'s dtype: the GPU experts in torch plus the op for the rest."""
        self._check_gpu_inputs(x, ids, weights)
        if self._all_gpu:
            return self._gpu_experts(x, ids, weights).to(x.dtype)
        mask = self.gpu_experts_mask
        if x.is_cuda and self.cuda_overlap:
            # The op (its CUDA-stream bridge) on a side stream, the GPU experts on the
            # current one: both are enqueued at once and overlap.
            current = torch.cuda.current_stream(x.device)
            side = _side_stream(x.device)
            side.wait_stream(current)
            with torch.cuda.stream(side):
                y_cpu = self._cpu_experts(x, ids, weights, mask)
            y_gpu = self._gpu_experts(x, ids, weights)
            current.wait_stream(side)
            y_cpu.record_stream(current)
        else:
            y_cpu = self._cpu_experts(x, ids, weights, mask)
            y_gpu = self._gpu_experts(x, ids, weights)
        return (y_gpu + y_cpu).to(x.dtype)

    def _check_gpu_inputs(self, x: Tensor, ids: Tensor, weights: Tensor) -> None:
        device = self.gpu_gate_weight.device
        if x.device != device:
            raise ValueError(
                f"MoEExperts: hidden_states is on {x.device} but the GPU experts' weights "
                f"(gpu_gate_weight ...) are on {device}; move the module (module.to(device)) "
                "or the hidden states"
            )
        for name, t in (("top_k_index", ids), ("top_k_weights", weights)):
            if t.device != device:
                raise ValueError(
                    f"MoEExperts: {name} is on {t.device} but hidden_states is on {x.device}"
                )
        if ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"MoEExperts: top_k_index must be int32 or int64, got {ids.dtype}")
        if ids.shape[0] != x.shape[0] or weights.shape != ids.shape:
            raise ValueError(
                f"MoEExperts: top_k_index {list(ids.shape)} and top_k_weights "
                f"{list(weights.shape)} must both be [T={x.shape[0]}, K]"
            )
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        if self._all_gpu and ids.numel() and not capturing:
            # The op, which checks the ids otherwise, is not called (no check, which
            # would sync, inside CUDA-graph capture).
            lo, hi = int(ids.min()), int(ids.max())
            if lo < -1 or hi >= self.num_experts:
                raise ValueError(
                    f"MoEExperts: top_k_index has expert ids outside [-1, E={self.num_experts}) "
                    f"(min {lo}, max {hi})"
                )

    def _gpu_experts(self, x: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
        """fp32 ``[T, H]``: the GPU-resident experts' share of the output, in plain torch.

        Two ways, same result (:attr:`gpu_gather`): ``gather`` copies each
        (token, slot)'s expert weights (``index_select``) and runs batched
        matrix-vector products: no host sync and no data-dependent shapes, at
        the cost of a weight copy per slot. ``grouped`` groups the slots by
        expert and runs each GPU expert once on its tokens (one host sync for
        the group sizes, free on the CPU).
        """
        T, K = ids.shape
        slot = self.gpu_expert_slot
        ids64 = ids.long()
        # Ids outside [0, E) index no slot (clamped: on CUDA an out-of-range index is a
        # device-side assert that ends the context); the op's range check names them.
        E = slot.shape[0]
        local = torch.where((ids64 >= 0) & (ids64 < E), slot[ids64.clamp(0, E - 1)], -1)  # [T, K]
        lora = self.lora_weights()
        has_lora = lora.any()
        # With LoRA, fp32 throughout (as the op's LoRA path); else the weights' and
        # activations' common dtype.
        cdtype = (
            torch.float32 if has_lora else torch.promote_types(x.dtype, self.gpu_gate_weight.dtype)
        )
        gather = self.gpu_gather
        if gather is None:
            gather = x.is_cuda and (
                T * K <= self.num_gpu_experts or torch.cuda.is_current_stream_capturing()
            )
        if gather:
            sel = (local >= 0).reshape(-1)  # [S], S = T*K
            j = local.clamp(min=0).reshape(-1)
            xs = x.to(cdtype).repeat_interleave(K, dim=0)  # [S, H]
            y = self._expert_mlp(xs, j, cdtype, lora, batched=True)  # [S, H]
            w = torch.where(sel, weights.reshape(-1).to(torch.float32), 0.0)
            y = torch.where(sel[:, None], y.float() * w[:, None], 0.0)
            return y.view(T, K, self.hidden_size).sum(dim=1)
        tok, k = (local >= 0).nonzero(as_tuple=True)
        j = local[tok, k]
        order = torch.argsort(j, stable=True)
        tok, k, j = tok[order], k[order], j[order]
        counts = torch.bincount(j, minlength=self.num_gpu_experts).tolist()
        xs = x.to(cdtype)[tok]
        parts, start = [], 0
        for e, c in enumerate(counts):
            if c:
                parts.append(self._expert_mlp(xs[start : start + c], e, cdtype, lora))
                start += c
        out = x.new_zeros((T, self.hidden_size), dtype=torch.float32)
        if not parts:
            return out
        y = torch.cat(parts).float() * weights[tok, k].to(torch.float32)[:, None]
        return out.index_add(0, tok, y)

    def _expert_mlp(self, v: Tensor, j, cdtype: torch.dtype, lora: LoRAWeights, batched=False):
        """SwiGLU of GPU expert(s) ``j`` on rows ``v`` (``batched``: one expert per row)."""
        ids = self.gpu_expert_ids

        def proj(name: str, buffer: str, u: Tensor) -> Tensor:
            w = getattr(self, buffer)
            if batched:
                y = torch.bmm(w.index_select(0, j).to(cdtype), u.unsqueeze(-1)).squeeze(-1)
            else:
                y = u @ w[j].to(cdtype).t()
            pair = getattr(lora, name)
            if pair is not None:
                a, b = pair
                if batched:
                    e = ids.index_select(0, j)
                    r = torch.bmm(a.index_select(0, e).float(), u.float().unsqueeze(-1))
                    d = torch.bmm(b.index_select(0, e).float(), r).squeeze(-1)
                else:
                    e = self._gpu_id_list[j]
                    d = (u.float() @ a[e].float().t()) @ b[e].float().t()
                y = y + lora.scaling * d
            return y

        h = torch_glu(self.activation)(
            proj("gate", "gpu_gate_weight", v), proj("up", "gpu_up_weight", v)
        )
        return proj("down", "gpu_down_weight", h)


_SIDE_STREAMS: dict = {}


def _side_stream(device: torch.device):
    """One side CUDA stream per device for the op of hybrid layers (created once)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _SIDE_STREAMS.get(index)
    if stream is None:
        stream = _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return stream
