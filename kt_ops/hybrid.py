"""CPU/GPU hybrid MoE: the kt:: ops on CUDA tensors (the CUDA bridge).

On a CUDA build of torch, kt_ops is built with a CUDA kernel for each op
(``cmake/cuda_bridge.cmake``; :func:`cuda_bridge_built`). When
``hidden_states`` (and ``topk_ids``, ``topk_weights``, the LoRA factors,
``gpu_experts_mask``) are CUDA tensors and the packed expert weights are CPU
tensors, a call enqueues on the current CUDA stream and returns at once:

1. ``cudaMemcpyAsync`` of the inputs into page-locked host staging memory,
2. ``cudaLaunchHostFunc``: the CPU experts (the same driver as the CPU op)
   on the staged inputs, writing staged outputs,
3. ``cudaMemcpyAsync`` of the outputs into CUDA tensors.

The calling thread never waits; the GPU runs ahead until the copy back needs
the CPU result. The result is bit-identical to the CPU op on the same inputs.

**CUDA graphs.** The sequence is stream work, so ``torch.cuda.graph`` captures
it (two memcpy nodes per input, a host node, memcpy nodes back) and replays it.
Rules, as for any captured op:

* Warm up first: run the captured code once eagerly (PyTorch's own rule; it
  also settles lazy initialisation).
* Use static inputs: replays read the captured ``hidden_states``,
  ``topk_ids``, ``topk_weights`` tensors (copy new values into them).
* Each captured call gets its own staging memory and keeps its layer (the
  packed weights) alive, for as long as a graph may replay it. A CUDA graph
  tells no one when it dies, so call :func:`release_graph_staging` after
  deleting the graphs that captured kt:: calls, or let it be held until exit.
* A bad expert id cannot raise inside a host function: the call's outputs are
  filled with NaN and the next kt:: call on CUDA raises the error (as CUDA's
  device-side asserts surface later). :func:`take_bridge_error` reads it.

Eager calls on one stream share one staging block (grown by doubling, the old
block freed once the stream has passed it).
"""

from __future__ import annotations

from typing import Optional

from kt_ops import _C

__all__ = ["cuda_bridge_built", "staging_stats", "release_graph_staging", "take_bridge_error"]


def cuda_bridge_built() -> bool:
    """True when this build runs the kt:: ops on CUDA tensors (a CUDA torch with libcudart)."""
    return bool(_C.cuda_bridge_built())


def staging_stats() -> dict:
    """Host staging memory held by the bridge: ``eager_blocks``/``eager_bytes`` (one block
    per stream) and ``captured_blocks``/``captured_bytes`` (one per captured call)."""
    return dict(_C.staging_stats())


def release_graph_staging() -> None:
    """Free the staging memory and layer state of every captured kt:: call.

    Only after every CUDA graph that captured a kt:: call is destroyed (or will
    never replay again): a later replay would read freed memory.
    """
    _C.release_captured_staging()


def take_bridge_error() -> Optional[str]:
    """The error of a bridged call that failed in its CPU part and has not been raised
    yet (its outputs were filled with NaN), or None; clears it."""
    msg = _C.take_bridge_error()
    return msg or None
