"""``torch.nn`` modules that run the routed experts of an MoE layer with ``kt.moe_forward``.

:class:`MoEExperts` is a drop-in replacement for the experts module of a
transformers-v5 MoE block: it is called as ``experts(hidden_states,
top_k_index, top_k_weights)`` after the router has picked the experts, and it
holds the packed expert weights as buffers (so ``state_dict``, ``deepcopy`` and
``torch.compile`` see plain tensors). :class:`MoEExpertList` adds
``len``/indexing for code that loops over ``self.experts[i](x)`` itself.

The modules compute the forward pass only: the backward of ``kt.moe_forward``
raises ``NotImplementedError`` until ``kt::moe_backward`` lands, so use them
for inference (``torch.no_grad`` / ``inference_mode``).
"""

from __future__ import annotations

import operator
from typing import Callable

import torch
from torch import Tensor, nn

from kt_ops.ops import moe_forward, pack_weights

__all__ = ["MoEExperts", "MoEExpertList"]

_PACKED = ("gate_weight", "up_weight", "down_weight")


def _packed_shape(num_experts: int, n: int, k: int, weight_format: str) -> tuple[int, ...]:
    """Shape of ``pack_weights`` applied to ``[num_experts, n, k]``, computed on the meta device."""
    return tuple(pack_weights(torch.empty(num_experts, n, k, device="meta"), weight_format).shape)


#: Elements of dense weights packed per step by ``from_dense`` (a few experts of a large model).
_PACK_CHUNK_ELEMS = 1 << 24


def _pack_in_chunks(weight: Tensor, weight_format: str) -> Tensor:
    """``pack_weights(weight)`` for a CPU result, a few experts at a time.

    Packing is independent per expert, so slices of experts are packed into
    one preallocated tensor: the temporaries stay small (tens of MB instead of
    several copies of a whole layer) and are recycled between chunks.
    """
    E, N, K = weight.shape
    step = max(1, _PACK_CHUNK_ELEMS // max(1, N * K))
    if step >= E:
        return pack_weights(weight.cpu(), weight_format)
    first = pack_weights(weight[:step].cpu(), weight_format)
    out = torch.empty((E, *first.shape[1:]), dtype=first.dtype)
    out[:step].copy_(first)
    del first
    for e in range(step, E, step):
        out[e : e + step].copy_(pack_weights(weight[e : e + step].cpu(), weight_format))
    return out


class MoEExperts(nn.Module):
    """The routed experts of one MoE layer, computed on the CPU by ``kt.moe_forward``.

    Every expert ``e`` is a SwiGLU MLP (Mixtral, Qwen-MoE, OLMoE, DeepSeek)::

        expert_e(x) = W_down[e] @ (silu(W_gate[e] @ x) * (W_up[e] @ x))
        out[t]      = sum_k top_k_weights[t, k] * expert_{top_k_index[t, k]}(x[t])

    Build it from dense weights with :meth:`from_dense`, or pass tensors that
    :func:`kt_ops.pack_weights` produced. The packed weights are the buffers
    ``gate_weight``, ``up_weight`` (packed ``[E, I, H]``) and ``down_weight``
    (packed ``[E, H, I]``); they are part of ``state_dict``.

    The packed weights are a storage format of host memory, not values in the
    model's dtype: ``module.to(dtype)``, ``.half()``, ``.cuda()`` leave them as
    they are (bf16, on the CPU), so a model holding this module can be cast or
    moved without touching its experts. The compute dtype follows the input.

    Inference only: backpropagating through this module raises
    ``NotImplementedError`` until ``kt::moe_backward`` lands.

    Args:
        gate_weight: packed gate projections of ``[E, I, H]`` weights.
        up_weight: packed up projections of ``[E, I, H]`` weights.
        down_weight: packed down projections of ``[E, H, I]`` weights.
        hidden_size: ``H``.
        intermediate_size: ``I``, the expert MLP width.
        weight_format: format the tensors were packed in (``'bf16'``).

    Raises:
        ValueError: a packed tensor does not have the shape that
            ``pack_weights`` gives for ``[E, I, H]`` / ``[E, H, I]`` in
            ``weight_format``, the format is unknown, or a size is not positive.
    """

    num_experts: int
    hidden_size: int
    intermediate_size: int
    weight_format: str

    def __init__(
        self,
        gate_weight: Tensor,
        up_weight: Tensor,
        down_weight: Tensor,
        *,
        hidden_size: int,
        intermediate_size: int,
        weight_format: str = "bf16",
    ) -> None:
        super().__init__()
        if hidden_size <= 0 or intermediate_size <= 0:
            raise ValueError(
                f"MoEExperts: hidden_size and intermediate_size must be positive, got "
                f"{hidden_size} and {intermediate_size}"
            )
        num_experts = int(gate_weight.shape[0]) if gate_weight.dim() > 0 else 0
        H, inter = int(hidden_size), int(intermediate_size)
        expected = {
            "gate_weight": _packed_shape(num_experts, inter, H, weight_format),
            "up_weight": _packed_shape(num_experts, inter, H, weight_format),
            "down_weight": _packed_shape(num_experts, H, inter, weight_format),
        }
        for name, t in zip(_PACKED, (gate_weight, up_weight, down_weight)):
            if tuple(t.shape) != expected[name]:
                raise ValueError(
                    f"MoEExperts: {name} has shape {tuple(t.shape)}, expected {expected[name]} "
                    f"(pack_weights of [E={num_experts}, "
                    f"{'H, I' if name == 'down_weight' else 'I, H'}] with H={H}, I={inter}, "
                    f"weight_format={weight_format!r})"
                )
            self.register_buffer(name, t.contiguous())
        self.num_experts = num_experts
        self.hidden_size = H
        self.intermediate_size = inter
        self.weight_format = weight_format

    @classmethod
    def from_dense(
        cls,
        gate: Tensor,
        up: Tensor,
        down: Tensor,
        weight_format: str = "bf16",
    ) -> MoEExperts:
        """Pack dense expert weights (``nn.Linear`` convention: ``[E, out, in]``).

        Args:
            gate: ``[E, I, H]`` gate projections, any floating dtype, any device
                (copied to the CPU).
            up: ``[E, I, H]`` up projections.
            down: ``[E, H, I]`` down projections.
            weight_format: target format (``'bf16'``: rounded to nearest even).

        Returns:
            A new module on the CPU; the dense tensors are not referenced.

        Raises:
            ValueError: the tensors are not 3-D, not floating point, or their
                shapes do not agree (``gate``/``up`` ``[E, I, H]``, ``down``
                ``[E, H, I]``), or ``weight_format`` is unknown.
        """
        for name, t in (("gate", gate), ("up", up), ("down", down)):
            if not isinstance(t, Tensor) or t.dim() != 3:
                shape = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
                raise ValueError(
                    f"MoEExperts.from_dense: {name} must be 3-D [E, N, K], got {shape}"
                )
        E, inter, H = gate.shape
        if tuple(up.shape) != (E, inter, H) or tuple(down.shape) != (E, H, inter):
            raise ValueError(
                f"MoEExperts.from_dense: expected gate and up [E, I, H] and down [E, H, I]; got "
                f"gate {tuple(gate.shape)}, up {tuple(up.shape)}, down {tuple(down.shape)}"
            )
        packed = [_pack_in_chunks(w.detach(), weight_format) for w in (gate, up, down)]
        return cls(*packed, hidden_size=H, intermediate_size=inter, weight_format=weight_format)

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        """Weighted sum of the selected experts' outputs, per token.

        Args:
            hidden_states: ``[T, H]`` or ``[..., H]``; bf16, fp16 or fp32, on the CPU.
            top_k_index: ``[T, K]`` (or ``[..., K]``) int32/int64 expert ids in
                ``[-1, E)``; ``-1`` skips a slot (experts served elsewhere).
            top_k_weights: routing weights of the shape of ``top_k_index``, fp32
                or any floating dtype (converted to fp32 unless it is the
                activation dtype).

        Returns:
            Tensor of the shape and dtype of ``hidden_states``.

        Raises:
            ValueError: the last dimension of ``hidden_states`` is not ``H``.
            RuntimeError: (from the op) a wrong dtype, device, an id outside
                ``[-1, E)``, or ``top_k_index``/``top_k_weights`` with a number
                of rows other than the number of tokens.
        """
        if hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(
                f"MoEExperts: hidden_states has last dimension {hidden_states.shape[-1]}, "
                f"expected hidden_size={self.hidden_size}"
            )
        x = hidden_states.reshape(-1, self.hidden_size)
        ids = top_k_index.reshape(-1, top_k_index.shape[-1])
        weights = top_k_weights.reshape(-1, top_k_weights.shape[-1])
        if weights.dtype != torch.float32 and weights.dtype != x.dtype:
            weights = weights.float()
        out = moe_forward(
            x,
            ids,
            weights,
            self.gate_weight,
            self.up_weight,
            self.down_weight,
            self.intermediate_size,
            self.weight_format,
        )
        return out.view(hidden_states.shape)

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> MoEExperts:
        # Module.to/.half/.cuda/.float go through _apply. The packed weights are a
        # layout in host memory that the CPU kernels read, not values in the
        # model's dtype: casting would corrupt them, and a GPU copy would go unused
        # (the kernels run on the CPU; a CUDA build of the op copies CUDA hidden
        # states to the host and back). So they are left untouched.
        packed = {name: self._buffers.pop(name) for name in _PACKED}
        try:
            return super()._apply(fn, recurse)
        finally:
            self._buffers.update(packed)

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
            f"intermediate_size={self.intermediate_size}, weight_format={self.weight_format!r}"
        )


class _Expert:
    """Expert ``index`` of a :class:`MoEExpertList`, callable like the dense MLP it replaced."""

    def __init__(self, experts: MoEExpertList, index: int) -> None:
        self._experts = experts
        self.index = index

    def __call__(self, hidden_states: Tensor) -> Tensor:
        """Expert MLP of ``hidden_states [..., H]``; returns the same shape and dtype."""
        experts = self._experts
        x = hidden_states.reshape(-1, experts.hidden_size)
        ids = torch.full((x.shape[0], 1), self.index, dtype=torch.int32)
        weights = torch.ones((x.shape[0], 1), dtype=torch.float32)
        return experts(x, ids, weights).view(hidden_states.shape)

    forward = __call__

    def __repr__(self) -> str:
        return f"{type(self._experts).__name__}[{self.index}]"


class MoEExpertList(MoEExperts):
    """:class:`MoEExperts` that also behaves like the ``nn.ModuleList`` of expert MLPs it replaced.

    Code written for a list of experts keeps working: ``len(experts)`` is
    ``E``, and ``experts[i](x)`` (``i`` an int or a one-element integer tensor)
    runs expert ``i`` alone on ``x [..., H]``, returning ``[..., H]`` in the
    dtype of ``x``. That path calls the op once per expert, so it is slower
    than the fused call ``experts(hidden_states, top_k_index, top_k_weights)``.
    """

    def __len__(self) -> int:
        return self.num_experts

    def __getitem__(self, index: int | Tensor) -> _Expert:
        i = operator.index(index)
        if not -self.num_experts <= i < self.num_experts:
            raise IndexError(f"expert index {i} is out of range for {self.num_experts} experts")
        return _Expert(self, i % self.num_experts)

    def __iter__(self):
        return (_Expert(self, i) for i in range(self.num_experts))
