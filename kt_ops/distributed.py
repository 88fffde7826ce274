"""kt_ops experts under data-parallel training engines (torch.distributed DDP, FSDP2,
accelerate): one copy of the packed experts per host, and the host's cores shared out.

**The packed experts are never synchronized.** They are frozen, identical on every
rank (each rank loads the same checkpoint), and large: DeepSeek-V3's int8 experts are
about 650 GB. ``DistributedDataParallel`` broadcasts every buffer from rank 0 when it
is built and, by default, before each forward; the writes would give every rank a
private copy of memory-mapped experts (measured: 48.5 MB per rank after one step where
the mapped files cost 24.2 MB per rank). :func:`keep_packed_experts_out_of_ddp` puts
the kt_ops experts modules' buffers on DDP's ignore list
(``_ddp_params_and_buffers_to_ignore``, the mechanism of
``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model``);
:func:`kt_ops.replace_experts` and :func:`kt_ops.apply_lora` call it on the model they
are given, so a plain ``DistributedDataParallel(model)`` keeps one copy. The LoRA
factors (parameters) stay synchronized: DDP all-reduces their gradients. FSDP2
(``fully_shard``) leaves buffers alone; the LoRA factors may be sharded or replicated.

**One copy per host.** A ``kt-ops convert`` directory is read with memory-mapped
safetensors, so ranks on one host share its pages (the page cache holds one copy);
:func:`convert_once` has local rank 0 convert a checkpoint while the others wait for
its manifest.

**The cores shared out.** Each process's kt_ops thread pool takes its share of the
host's cores: part ``LOCAL_RANK`` of ``LOCAL_WORLD_SIZE`` (torchrun and accelerate set
both; both set but not ``0 <= LOCAL_RANK < LOCAL_WORLD_SIZE`` is an error naming them),
or ``KT_OPS_CORE_SHARE=i/n`` / ``off`` (csrc/runtime/topology.h).
:func:`core_share` reports it; ``kt_ops.print_info()`` prints it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Optional, Union

from torch import nn

__all__ = ["convert_once", "core_share", "keep_packed_experts_out_of_ddp", "packed_buffer_names"]

_IGNORE_ATTR = "_ddp_params_and_buffers_to_ignore"


def packed_buffer_names(model: nn.Module) -> list[str]:
    """Fully qualified names (relative to ``model``) of the buffers of every kt_ops experts
    module in ``model``: the packed weights, scales, zeros and biases (and the GPU-resident
    experts' copies). Their LoRA factors are parameters and are not listed."""
    from kt_ops.nn import MoEExperts

    names = []
    for prefix, module in model.named_modules():
        if isinstance(module, MoEExperts):
            for name, buf in module.named_buffers(recurse=False):
                if buf is not None:
                    names.append(f"{prefix}.{name}" if prefix else name)
    return names


def keep_packed_experts_out_of_ddp(model: nn.Module) -> list[str]:
    """Put the kt_ops experts' buffers of ``model`` on DDP's ignore list; returns the list.

    ``DistributedDataParallel(model)`` then neither broadcasts them at construction nor
    before each forward (``broadcast_buffers``), so memory-mapped experts stay shared.
    Names already on the list are kept. Wrap ``model`` itself: DDP reads the list of
    the module it is given.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"keep_packed_experts_out_of_ddp: expected an nn.Module, got {type(model).__name__}"
        )
    names = sorted(set(getattr(model, _IGNORE_ATTR, ())) | set(packed_buffer_names(model)))
    setattr(model, _IGNORE_ATTR, names)
    return names


def core_share() -> dict:
    """This process's share of the host's cores.

    Returns ``{"index": i, "count": n, "source": ..., "cores": [...], "host_cores": C}``:
    part ``i`` of ``n`` (``n = 1``: the whole host), where it came from
    (``"LOCAL_RANK/LOCAL_WORLD_SIZE"``, ``"KT_OPS_CORE_SHARE"`` or ``"none"``), the
    logical indices of its cores and the host's core count. The default thread count
    is ``len(cores)``.
    """
    from kt_ops import _C

    topo = _C.topology()
    i, n = topo["core_share"]
    return {
        "index": i,
        "count": n,
        "source": topo["core_share_source"],
        "cores": [c["core"] for c in topo["cores"]],
        "host_cores": topo["host_cores"],
    }


def convert_once(
    src: Union[str, Path],
    out_dir: Union[str, Path],
    weight_format: Optional[str] = None,
    *,
    group_size: Optional[int] = None,
    symmetric: bool = True,
    timeout: float = 24 * 3600.0,
    poll: float = 1.0,
) -> Path:
    """Convert ``src`` into ``out_dir`` on local rank 0; the other local ranks wait for it.

    Local rank 0 (``LOCAL_RANK``, 0 when unset) runs :func:`kt_ops.convert.convert`
    (which resumes an interrupted conversion); every other rank waits until
    ``out_dir/manifest.json`` lists every MoE layer with its file present, then
    returns. All ranks can then ``replace_experts(model, converted_dir=out_dir)``:
    the files are memory-mapped, one copy in the page cache for the host.

    Raises:
        TimeoutError: a waiting rank saw no complete manifest within ``timeout`` seconds.
        Whatever ``convert`` raises, on local rank 0.
    """
    out = Path(out_dir)
    if int(os.environ.get("LOCAL_RANK", "0") or 0) == 0:
        from kt_ops.convert import convert

        convert(src, out, weight_format, group_size=group_size, symmetric=symmetric)
        return out
    from kt_ops.convert import read_manifest

    deadline = time.monotonic() + timeout
    while True:
        try:
            m = read_manifest(out)
            done = set(map(int, m.get("layers", {}))) >= set(m.get("moe_layers", [None]))
            files = all((out / e["file"]).is_file() for e in m.get("layers", {}).values())
            if done and files:
                return out
        except (FileNotFoundError, ValueError, KeyError, TypeError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"convert_once: {out} has no complete manifest after {timeout:.0f} s (local "
                "rank 0 converts it; did it fail?)"
            )
        time.sleep(poll)
