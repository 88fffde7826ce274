"""One description of an MoE layer's experts, and the op arguments built from it.

:class:`ExpertWeights` holds the three packed projections of one layer (gate,
up, down as :class:`~kt_ops.formats.PackedProjection`), :class:`LoRAWeights`
its optional LoRA factors. :func:`layer_args` turns them into the layer
arguments that every ``kt::`` op takes, and :meth:`ExpertWeights.from_op_args`
parses them back (the fake kernels use it). This module is the one place in
Python that knows that argument list; the C++ twin is ``csrc/moe/moe_layer.h``.

The op's layer arguments (``csrc/ops/registration.cpp``)::

    weights       [gate_weight, gate_scales, gate_zeros, up_..., down_...]  (None where absent),
                  then [gate_bias, up_bias, down_bias] when some projection has a bias,
                  then [gate_backward_panels, up_..., down_...] when the weights carry
                  them (ExpertWeights.with_backward_panels; the biases None where absent)
    weight_format 'int4' or 'gate,up,down' names ('q4_k,q4_k,q6_k')
    sizes         [hidden_size, intermediate_size]
    group_sizes   [gate, up, down] group sizes along K (0: per output channel)
    lora          [] or [gate_a, gate_b, up_a, up_b, down_a, down_b] ([0]-shaped where absent)
    lora_scaling  float
    activation    the GLU, h = act(gate(x)) * up(x): one of ACTIVATIONS ('silu', 'gelu',
                  'gelu_tanh'), optionally with parameters (activation_spec):
                  'silu(alpha=1.702,limit=7.0,up_offset=1.0)' is gpt-oss's clamped SwiGLU
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import Tensor

from kt_ops import _C
from kt_ops.formats import format_spec
from kt_ops.formats.packed import PackedProjection, cat_experts
from kt_ops.formats.quantize import quantize_chunk
from kt_ops.formats.spec import FORMATS

__all__ = [
    "ACTIVATIONS",
    "DEFAULT_ACTIVATION",
    "activation_spec",
    "parse_activation",
    "torch_glu",
    "PROJECTIONS",
    "ExpertWeights",
    "LoRAWeights",
    "layer_args",
    "torch_activation",
    "split_weight_format",
    "join_weight_format",
]

#: The projections of a gated (GLU) expert, in op order.
PROJECTIONS = ("gate", "up", "down")

#: The GLU activations of the experts, ``h = act(gate(x)) * up(x)``, by the name the ops
#: take (``activation=``): ``'silu'`` (SwiGLU), ``'gelu'`` (GeGLU, erf), ``'gelu_tanh'``
#: (GeGLU with PyTorch's tanh approximation), ``'relu'`` (ReGLU; with the gate a copy of
#: up, NemotronH's relu^2). Read from the C++ table,
#: csrc/kernels/activations.h, which defines each (formulas and sources there).
ACTIVATIONS: tuple[str, ...] = tuple(_C.activations())

#: The activation of the ops and modules unless told otherwise: SwiGLU's ``'silu'``,
#: the first entry of the C++ table (``kernels::Activation::kSilu``).
DEFAULT_ACTIVATION: str = ACTIVATIONS[0]

#: Each activation in PyTorch (the GPU-resident experts' path and the dense references).
_TORCH_ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "silu": torch.nn.functional.silu,
    "gelu": torch.nn.functional.gelu,
    "gelu_tanh": functools.partial(torch.nn.functional.gelu, approximate="tanh"),
    "relu": torch.relu,
}


def torch_activation(name: str) -> Callable[[Tensor], Tensor]:
    """The PyTorch function of the activation ``name`` (one of :data:`ACTIVATIONS`).

    Raises ``ValueError`` for another name.
    """
    fn = _TORCH_ACTIVATIONS.get(name)
    if fn is None:
        raise ValueError(f"activation must be one of {list(ACTIVATIONS)}, got {name!r}")
    return fn


def parse_activation(spec: str) -> dict:
    """The parts of an ``activation`` argument, read by the ops' own parser (C++).

    Returns ``{'name', 'alpha', 'limit', 'act_limit', 'up_offset', 'gate_softcap',
    'up_softcap'}`` (``limit`` / ``act_limit`` / the softcaps None when absent; values as
    the kernels hold them, fp32).
    Raises ``ValueError`` naming what is wrong.
    """
    if not isinstance(spec, str):
        raise ValueError(f"activation must be a str, got {type(spec).__name__}")
    return _C.parse_activation(spec)


def activation_spec(
    name: str = DEFAULT_ACTIVATION,
    *,
    alpha: Optional[float] = None,
    limit: Optional[float] = None,
    act_limit: Optional[float] = None,
    up_offset: Optional[float] = None,
    gate_softcap: Optional[float] = None,
    up_softcap: Optional[float] = None,
) -> str:
    """The ``activation`` argument of a GLU with parameters (csrc/kernels/activations.h)::

        g' = min(g, limit)                      (limit: before act)
        u' = clamp(u, -limit, limit)            (limit or act_limit)
        a  = act(g'), silu: g' * sigmoid(alpha * g')
        a' = min(a, act_limit)                  (act_limit: after act)
        h  = a' * (u' + up_offset)

    gpt-oss (and MiniMax-M3): ``activation_spec('silu', alpha=1.702, limit=7.0,
    up_offset=1.0)``; DeepSeek-V4, GLM-5-Next, HY-V4: ``limit`` alone;
    Step-3.7: ``act_limit``. Inkling2's softcapped SwiGLU: ``activation_spec('silu',
    gate_softcap=cg, up_softcap=cu)``, ``h = cg tanh(g / cg) * sigmoid(g) * cu tanh(u /
    cu)`` (not combined with the others). With no parameter: ``name`` itself.

    Raises ``ValueError`` for an unknown name, ``alpha`` on another activation,
    both limits, or a non-positive / non-finite value.
    """
    params = {"alpha": alpha, "limit": limit, "act_limit": act_limit, "up_offset": up_offset}
    params.update(gate_softcap=gate_softcap, up_softcap=up_softcap)
    given = {k: float(v) for k, v in params.items() if v is not None}
    spec = name if not given else f"{name}({','.join(f'{k}={v!r}' for k, v in given.items())})"
    parse_activation(spec)
    return spec


@torch.compiler.assume_constant_result
def _glu_params(spec: str) -> tuple:
    """``parse_activation(spec)`` as a tuple: a constant to torch.compile (the C++ parser is
    not traceable), evaluated once per spec when a graph is traced."""
    p = parse_activation(spec)
    return (
        p["name"], p["alpha"], p["limit"], p["act_limit"], p["up_offset"], p["gate_softcap"],
        p["up_softcap"],
    )  # fmt: skip


def torch_glu(spec: str) -> Callable[[Tensor, Tensor], Tensor]:
    """``h = glu(g, u)`` of the ``activation`` argument ``spec`` in PyTorch (the GPU-resident
    experts and the dense references): :func:`activation_spec`'s formula.

    Raises ``ValueError`` for a spec the ops refuse.
    """
    name, alpha, limit, act_limit, offset, gate_cap, up_cap = _glu_params(spec)
    act = _TORCH_ACTIVATIONS[name]
    if gate_cap is not None or up_cap is not None:  # Inkling2's softcapped SwiGLU

        def softcapped(g: Tensor, u: Tensor) -> Tensor:
            gc = g if gate_cap is None else torch.tanh(g / gate_cap) * gate_cap
            uc = u if up_cap is None else torch.tanh(u / up_cap) * up_cap
            return gc * torch.sigmoid(g) * uc

        return softcapped
    if alpha == 1.0 and limit is None and act_limit is None and offset == 0.0:
        return lambda g, u: act(g) * u
    bound = limit if limit is not None else act_limit

    def glu(g: Tensor, u: Tensor) -> Tensor:
        if limit is not None:
            g = g.clamp(max=limit)
        if bound is not None:
            u = u.clamp(min=-bound, max=bound)
        a = g * torch.sigmoid(alpha * g) if alpha != 1.0 else act(g)
        if act_limit is not None:
            a = a.clamp(max=act_limit)
        return a * (u + offset) if offset != 0.0 else a * u

    return glu


def split_weight_format(weight_format: str) -> tuple[str, str, str]:
    """The (gate, up, down) format names of a ``weight_format`` argument.

    ``weight_format`` is one name for all three projections (``'q4_k'``) or
    three comma-separated names ``'gate,up,down'`` (``'q4_k,q4_k,q6_k'``, as
    GGUF Q4_K_M files store some layers; any formats may be mixed). Raises
    ``ValueError`` for another count of names or an unknown name.
    """
    names = weight_format.split(",") if isinstance(weight_format, str) else [weight_format]
    if len(names) == 1:
        names = names * 3
    if len(names) != 3:
        raise ValueError(
            f"weight_format={weight_format!r} must be one format name or three comma-separated "
            "names 'gate,up,down' (e.g. 'q4_k,q4_k,q6_k')"
        )
    for n in names:
        if n not in FORMATS:
            raise ValueError(f"unknown weight_format {n!r}; expected one of {FORMATS}")
    return names[0], names[1], names[2]


def join_weight_format(gate: str, up: str, down: str) -> str:
    """The ``weight_format`` argument for per-projection formats (one name when they agree)."""
    return gate if gate == up == down else f"{gate},{up},{down}"


@dataclass(frozen=True)
class ExpertWeights:
    """The packed routed experts of one MoE layer: three projections of ``E`` experts.

    ``gate`` and ``up`` hold dense ``[E, I, H]`` weights, ``down`` ``[E, H, I]``
    (``nn.Linear`` convention), each in its own weight format and group size
    (per-projection formats: GGUF Q4_K_M keeps some ``ffn_down`` in ``q6_k``).
    Each :class:`~kt_ops.formats.PackedProjection` records its true ``n`` and
    ``k``, so sizes inside the packing's padding are caught.

    Build it with :meth:`from_dense` (quantize online), from the loaders /
    converter's PackedProjections, or from a :class:`kt_ops.nn.MoEExperts`
    (``module.expert_weights()``).

    Raises:
        ValueError: the projections disagree on ``E``, ``H`` or ``I``
            (``gate``/``up`` must be ``[E, I, H]`` and ``down`` ``[E, H, I]``).
    """

    gate: PackedProjection
    up: PackedProjection
    down: PackedProjection
    #: The LoRA backward's transposed weights, ``(gate, up, down)`` bf16
    #: ``[E, k/w, w n]`` (``w`` = 16 or 64) or None each: made by
    #: :meth:`with_backward_panels`.
    backward_panels: Optional[tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]] = field(
        default=None, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        g, u, d = self.gate, self.up, self.down
        if (u.n, u.k) != (g.n, g.k) or (d.n, d.k) != (g.k, g.n):
            raise ValueError(
                "ExpertWeights: expected gate and up [E, I, H] and down [E, H, I]; got "
                f"gate [{g.n}, {g.k}], up [{u.n}, {u.k}], down [{d.n}, {d.k}]"
            )
        experts = {int(p.weight.shape[0]) for p in (g, u, d)}
        if len(experts) != 1:
            raise ValueError(
                f"ExpertWeights: gate, up and down hold different expert counts {sorted(experts)}"
            )

    def __getstate__(self) -> dict:
        # kt_ops.ops keeps a prepared layer here (cannot be pickled; rebuilt on use).
        state = self.__dict__.copy()
        state.pop("_prepared_layers", None)
        # The backward panels are derived (as much memory again as a bf16 base): not
        # pickled; with_backward_panels makes them again.
        state["backward_panels"] = None
        state.pop("_panel_versions", None)
        return state

    @property
    def num_experts(self) -> int:
        """``E``."""
        return int(self.gate.weight.shape[0])

    @property
    def hidden_size(self) -> int:
        """``H``."""
        return self.gate.k

    @property
    def intermediate_size(self) -> int:
        """``I``, the expert MLP width."""
        return self.gate.n

    @property
    def projections(self) -> tuple[PackedProjection, PackedProjection, PackedProjection]:
        """``(gate, up, down)``."""
        return self.gate, self.up, self.down

    @property
    def weight_format(self) -> str:
        """One format name, or ``'gate,up,down'`` when the projections differ."""
        return join_weight_format(*(p.weight_format for p in self.projections))

    @property
    def group_sizes(self) -> tuple[int, int, int]:
        """Group size of each projection along K (0: per output channel; fp8: 128)."""
        return tuple(int(p.group_size) for p in self.projections)

    @property
    def has_bias(self) -> bool:
        """Whether some projection carries a per-expert bias."""
        return any(p.bias is not None for p in self.projections)

    def tensors(self) -> list[Optional[Tensor]]:
        """The op's ``weights``: (weight, scales, zeros) of gate, up, down, None where
        absent, then the three biases when some projection has one (or the weights
        carry backward panels), then the three backward panels when they do.

        Raises ``ValueError`` when the backward panels were made from weights changed
        in place since (:meth:`with_backward_panels`)."""
        packed = [t for p in self.projections for t in (p.weight, p.scales, p.zeros)]
        if self.backward_panels is not None:
            if not self.backward_panels_fresh():
                raise ValueError(
                    "ExpertWeights: the backward panels were made from weights that have "
                    "been changed in place since; call with_backward_panels() again"
                )
            return packed + [p.bias for p in self.projections] + list(self.backward_panels)
        return packed + [p.bias for p in self.projections] if self.has_bias else packed

    @property
    def backward_panels_nbytes(self) -> int:
        """Bytes of host memory the backward panels hold (0 without them)."""
        panels = [t for t in self.backward_panels or () if t is not None]
        return sum(t.numel() * t.element_size() for t in panels)

    def _weight_versions(self) -> tuple:
        return tuple(
            (t.data_ptr(), t._version) if t is not None else None
            for p in self.projections
            for t in (p.weight, p.scales)
        )

    def backward_panels_fresh(self) -> bool:
        """Whether the backward panels (if any) still match the packed weights and
        scales: none of them was changed in place or moved since
        :meth:`with_backward_panels` (True without panels)."""
        made_from = self.__dict__.get("_panel_versions")
        return made_from is None or made_from == self._weight_versions()

    def with_backward_panels(self, width: Optional[int] = None) -> ExpertWeights:
        """A copy carrying the LoRA backward's transposed weights, made once.

        The LoRA backward's products with the frozen base (``go @ W_down`` and
        ``dg @ W_gate + du @ W_up``) reduce over each projection's output rows, so
        kt_ops' bf16 kernel needs the weights paired along ``n`` while the
        forward's blocks pair them along ``k``: every backward transposes each
        routed expert's three projections into 16-column panels. These panels,
        made here once and passed with the weights (the op's ``weights`` entries
        12-14), are read as they are instead. They hold the same values (the
        results are bit for bit the same) and cost 2 bytes per weight of host
        memory: as much again as a bf16 base, twice an int8 one. Measured on Zen 4
        (Qwen3-30B-A3B layer, T = 512, 2 threads): backward 135 -> 124 ms on a
        bf16 base, 192 -> 155 ms on int8 (docs/lora.md).

        Read where the backward's products with the base run on bf16 panels: bf16
        hidden states and gradients on an AVX-512 BF16 CPU, by kt_ops' own kernel
        (without AMX, or ``kt_ops.config.brgemm_bf16_kernel = 'kt'``) in panels 16
        columns wide, and by oneDNN's brgemm (AMX, or ``'onednn'``) in either width,
        one call per panel (64 wide: N = 64 calls, the width AMX tiles run best at; 16
        wide: four N = 16 calls). kt_ops' kernel ignores 64-wide panels (it makes its
        own per call, as without panels), and so does every other path. Made for
        bf16, int8 (per channel, no zeros), the fp8 formats and mxfp4 (whose values
        are bf16 values: 4x an mxfp4 base's bytes) with ``n`` and ``k`` multiples of
        16, on an AVX-512 CPU; a projection without them gets None (all three None:
        ``backward_panels`` is None). The base weights are frozen: after
        an in-place change of a projection's weights or scales, :meth:`tensors` (so
        every op call) raises ``ValueError`` until this is called again. Not pickled,
        and not moved by :meth:`to`.

        Args:
            width: output columns of ``W`` per panel, 16 or 64 (64 needs ``k`` a
                multiple of 64, else that projection gets 16). None (default): 16
                where the backward runs on kt_ops' kernel, else 64 (the kernel chosen
                now, from the CPU and ``kt_ops.config.brgemm_bf16_kernel``).

        Returns:
            A copy of these weights with :attr:`backward_panels`, each bf16
            ``[E, k/w, w n]`` (panel ``s``: columns ``[w s, w s + w)`` of ``W`` as
            ``[n/2][w][2]`` pairs of rows) or None.

        Raises:
            ValueError: weights not on the CPU, or a width other than 16 and 64.
            RuntimeError: weights the op would refuse (its message).
        """
        if any(p.weight.device.type != "cpu" for p in self.projections):
            raise ValueError(
                "ExpertWeights.with_backward_panels: the packed weights must be on the CPU, "
                f"got {self.gate.weight.device}"
            )
        if width is not None and (
            not isinstance(width, int) or isinstance(width, bool) or width not in (16, 64)
        ):
            raise ValueError(
                f"ExpertWeights.with_backward_panels: width must be 16 or 64 (or None), got "
                f"{width!r}"
            )
        base = dataclasses.replace(self, backward_panels=None)
        panels = tuple(
            _C.make_backward_panels(
                base.tensors(),
                self.weight_format,
                [self.hidden_size, self.intermediate_size],
                list(self.group_sizes),
                width,
            )
        )
        if all(t is None for t in panels):
            return base
        out = dataclasses.replace(self, backward_panels=panels)
        object.__setattr__(out, "_panel_versions", self._weight_versions())
        return out

    def validate(self) -> ExpertWeights:
        """Check every projection against its format's layout (``PackedProjection.validate``)."""
        for name, p in zip(PROJECTIONS, self.projections):
            try:
                p.validate()
            except ValueError as err:
                raise ValueError(f"ExpertWeights.{name}: {err}") from None
        return self

    def with_biases(
        self, gate: Optional[Tensor], up: Optional[Tensor], down: Optional[Tensor]
    ) -> ExpertWeights:
        """A copy with per-expert biases (any float dtype, stored fp32 contiguous on the
        weights' device): ``gate``/``up`` ``[E, I]``, ``down`` ``[E, H]``, None for none.
        Raises ``ValueError`` for a wrong shape (``PackedProjection.validate``)."""

        def fp32(b: Optional[Tensor], like: Tensor) -> Optional[Tensor]:
            return None if b is None else b.detach().to(like.device, torch.float32).contiguous()

        projs = (
            dataclasses.replace(p, bias=fp32(b, p.weight))
            for p, b in zip(self.projections, (gate, up, down))
        )
        out = ExpertWeights(*projs, backward_panels=self.backward_panels).validate()
        if "_panel_versions" in self.__dict__:  # the same weights: their panels still fit
            object.__setattr__(out, "_panel_versions", self.__dict__["_panel_versions"])
        return out

    def to(self, device: torch.device | str) -> ExpertWeights:
        """A copy with every tensor on ``device`` (without backward panels)."""
        return ExpertWeights(*(p.to(device) for p in self.projections))

    @classmethod
    def from_op_args(cls, weights, weight_format: str, sizes, group_sizes) -> ExpertWeights:
        """Parse the op's layer arguments back (see the module docstring).

        Raises ``ValueError`` naming the argument for a wrong count of
        entries or an unknown format.
        """
        if len(weights) not in (9, 12, 15):
            raise ValueError(
                f"weights must hold 9 entries (gate, up, down x weight, scales, "
                f"zeros), 12 with the gate, up, down biases, or 15 with the biases and the "
                f"backward panels, got {len(weights)}"
            )
        biases = list(weights[9:12]) or [None] * 3
        panels = tuple(weights[12:15]) if len(weights) == 15 else None
        if len(sizes) != 2 or len(group_sizes) != 3:
            raise ValueError(
                f"sizes must be [hidden_size, intermediate_size] and group_sizes 3 values, got "
                f"{list(sizes)} and {list(group_sizes)}"
            )
        H, inter = (int(s) for s in sizes)
        names = split_weight_format(weight_format)
        dims = ((inter, H), (inter, H), (H, inter))
        projs = [
            PackedProjection(
                *weights[3 * i : 3 * i + 3], names[i], int(group_sizes[i]), *dims[i], biases[i]
            )
            for i in range(3)
        ]
        if panels is not None and all(t is None for t in panels):
            panels = None
        return cls(*projs, backward_panels=panels)

    @classmethod
    def from_dense(
        cls,
        gate: Tensor,
        up: Tensor,
        down: Tensor,
        weight_format: str = "bf16",
        *,
        group_size: Optional[int] = None,
        symmetric: bool = True,
    ) -> ExpertWeights:
        """Pack (and quantize) dense expert weights with :func:`kt_ops.formats.quantize_weights`.

        ``gate``/``up`` ``[E, I, H]``, ``down`` ``[E, H, I]``, any floating dtype
        and device (copied to the CPU a few experts at a time, so the fp32
        temporaries stay small). ``weight_format`` is one name or
        ``'gate,up,down'``. ``group_size`` (``None``: each format's default)
        must suit the format; with per-projection formats, a format that has a
        single group size (int8, fp8, mxfp4, the GGUF types) keeps its own.
        Raises what ``quantize_weights`` raises.
        """
        names = split_weight_format(weight_format)
        mixed = len(set(names)) > 1

        def group_for(fmt: str) -> Optional[int]:
            return None if mixed and len(format_spec(fmt).group_sizes) == 1 else group_size

        return cls(
            *(
                _quantize_in_chunks(w.detach(), fmt, group_for(fmt), symmetric)
                for fmt, w in zip(names, (gate, up, down))
            )
        )


#: Elements of dense weights quantized per step by ``from_dense`` (a few experts of a large model).
_QUANTIZE_CHUNK_ELEMS = 1 << 24


def _quantize_in_chunks(
    weight: Tensor, weight_format: str, group_size: Optional[int], symmetric: bool
) -> PackedProjection:
    """``quantize_weights(weight)`` a few experts at a time (packing is per expert), the
    chunks concatenated into huge pages."""
    E, N, K = weight.shape
    step = max(1, _QUANTIZE_CHUNK_ELEMS // max(1, N * K))
    parts = [
        quantize_chunk(weight[e : e + step].cpu(), weight_format, group_size, symmetric)
        for e in range(0, E, step)
    ]

    def cat(name: str) -> Optional[Tensor]:  # into huge pages (one part: copied there)
        ts = [getattr(p, name) for p in parts]
        return None if ts[0] is None else cat_experts(ts)

    first = parts[0]
    return PackedProjection(
        cat("weight"), cat("scales"), cat("zeros"), first.weight_format, first.group_size, N, K
    )


@dataclass(frozen=True)
class LoRAWeights:
    """LoRA factors of the experts (Hu et al. 2021; PEFT's convention).

    Projection ``p`` of expert ``e`` computes ``W_p[e] x + scaling * B_p[e] (A_p[e] x)``.
    Each field is ``None`` or ``(A, B)``: gate/up ``A [E, r, H]``, ``B [E, I, r]``;
    down ``A [E, r, I]``, ``B [E, H, r]``; one float dtype for all; ``scaling``
    is ``alpha / r``.

    The op (not this container) checks them at each call, RuntimeError naming the
    factor: rank ``r >= 1`` (each B's rank that of its A), fp32 / bf16 / fp16,
    contiguous, on the device of the hidden states, ``scaling`` finite.
    """

    gate: Optional[tuple[Tensor, Tensor]] = None
    up: Optional[tuple[Tensor, Tensor]] = None
    down: Optional[tuple[Tensor, Tensor]] = None
    scaling: float = 1.0

    def factors(self) -> list[Optional[Tensor]]:
        """``[gate_a, gate_b, up_a, up_b, down_a, down_b]``, None where absent."""
        out: list[Optional[Tensor]] = []
        for p in PROJECTIONS:
            ab = getattr(self, p)
            out.extend(ab if ab is not None else (None, None))
        return out

    def any(self) -> bool:
        """True when some projection carries LoRA."""
        return any(getattr(self, p) is not None for p in PROJECTIONS)

    def op_args(self, like: Tensor) -> list[Tensor]:
        """The op's ``lora`` list: ``[]``, or 6 tensors with ``[0]``-shaped placeholders."""
        if not self.any():
            return []
        return [t if t is not None else like.new_empty((0,)) for t in self.factors()]

    @classmethod
    def from_op_args(cls, lora, scaling: float) -> LoRAWeights:
        """Parse the op's ``lora`` list (``[0]``-shaped entries are absent factors)."""
        if len(lora) == 0:
            return cls(scaling=scaling)
        if len(lora) != 6:
            raise ValueError(f"lora must be empty or hold 6 tensors, got {len(lora)}")

        def present(t: Tensor) -> bool:
            return not (t.dim() == 1 and t.shape[0] == 0)

        pairs = {}
        for i, p in enumerate(PROJECTIONS):
            a, b = lora[2 * i], lora[2 * i + 1]
            pairs[p] = (a, b) if present(a) or present(b) else None
        return cls(**pairs, scaling=scaling)

    def with_factors(self, factors) -> LoRAWeights:
        """A copy whose factors are ``factors`` (6 entries ``[gate_a, gate_b, up_a, up_b,
        down_a, down_b]``, None where absent). ValueError for an A without its B or a B
        without its A."""
        for i, p in enumerate(PROJECTIONS):
            if (factors[2 * i] is None) != (factors[2 * i + 1] is None):
                raise ValueError(f"LoRAWeights.with_factors: {p} has one of A and B, not both")
        pairs = {
            p: (factors[2 * i], factors[2 * i + 1]) if factors[2 * i] is not None else None
            for i, p in enumerate(PROJECTIONS)
        }
        return dataclasses.replace(self, **pairs)


def layer_args(
    experts: ExpertWeights,
    lora: Optional[LoRAWeights],
    activation: str,
    like: Optional[Tensor],
    gpu_experts_mask: Optional[Tensor] = None,
) -> tuple:
    """The layer arguments of every ``kt::`` op, in schema order (module docstring).

    ``like`` supplies the device and dtype of the ``[0]``-shaped placeholders
    of absent LoRA factors (unused, and may be None, without LoRA);
    ``gpu_experts_mask`` (bool ``[E]`` or None) marks the experts the op skips.
    """
    lora = lora if lora is not None else LoRAWeights()
    return (
        experts.tensors(),
        experts.weight_format,
        [experts.hidden_size, experts.intermediate_size],
        list(experts.group_sizes),
        lora.op_args(like),
        float(lora.scaling),
        activation,
        gpu_experts_mask,
    )
