"""One rank of tests/test_distributed.py, launched by ``torchrun --nproc-per-node N``.

    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        tests/distributed_worker.py {ddp|fsdp2|ddp_without_ignore_list} WORKDIR

Every rank: a tiny Qwen3-MoE model (same seed everywhere), its experts from a
``kt-ops convert`` directory that local rank 0 writes once (:func:`kt_ops.distributed.
convert_once`; the files are memory-mapped, one copy per host), LoRA on the experts,
then one training step on its own micro-batch of a fixed batch under DDP or FSDP2
(gloo, CPU). Rank 0 also runs the same step in one process on the whole batch.
Each rank writes ``WORKDIR/rank{r}.json``: its LoRA gradients' relative difference
from the one-process gradients (rank 0 only), the PSS and private bytes of the
expert files' mappings (``/proc/self/smaps``), and its core share and threads.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import kt_ops
from kt_ops.distributed import convert_once, core_share
from kt_ops.lora import lora_parameters

E, H, I, LAYERS, B, S = 8, 64, 32, 2, 4, 6  # noqa: E741


def tiny_model() -> torch.nn.Module:
    import transformers

    cfg = transformers.Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=H,
        intermediate_size=64,
        moe_intermediate_size=I,
        num_hidden_layers=LAYERS,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        num_experts=E,
        num_experts_per_tok=2,
        norm_topk_prob=True,
    )
    torch.manual_seed(0)
    return transformers.Qwen3MoeForCausalLM(cfg).float()


def lora_model(converted: Path) -> torch.nn.Module:
    model = tiny_model()
    kt_ops.replace_experts(model, converted_dir=str(converted), check=False)
    kt_ops.apply_lora(model, rank=4, seed=1)
    # Nonzero B factors so that every factor gets a gradient.
    with torch.no_grad():
        g = torch.Generator().manual_seed(2)
        for name, p in lora_parameters(model):
            if "lora_b" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def batch() -> torch.Tensor:
    return torch.randint(0, 64, (B, S), generator=torch.Generator().manual_seed(3))


def step(model, ids: torch.Tensor) -> None:
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()


def lora_grads(model) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in lora_parameters(model):
        g = p.grad
        if hasattr(g, "full_tensor"):  # FSDP2: DTensor
            g = g.full_tensor()
        out[name.replace("_fsdp_wrapped_module.", "").replace("module.", "")] = g.detach().clone()
    return out


def expert_file_mappings(converted: Path) -> dict[str, int]:
    """Pss, Private_Clean and Private_Dirty (bytes) of this process's mappings of the files
    in ``converted`` (/proc/self/smaps)."""
    root = str(converted.resolve())
    totals = {"Pss": 0, "Private_Clean": 0, "Private_Dirty": 0, "Rss": 0}
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 5 and "-" in fields[0] and ":" not in fields[0]:
                inside = len(fields) >= 6 and fields[5].startswith(root)
                continue
            if inside and fields and fields[0].rstrip(":") in totals:
                totals[fields[0].rstrip(":")] += int(fields[1]) * 1024
    return totals


def main(mode: str, workdir: str) -> int:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    work = Path(workdir)
    converted = work / "experts"
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        src = work / "model"
        if not (src / "config.json").exists():
            tiny_model().save_pretrained(src)
    dist.barrier()
    convert_once(work / "model", converted, "int8", poll=0.1)
    dist.barrier()

    model = lora_model(converted)
    ids = batch()
    mine = ids[rank * B // world : (rank + 1) * B // world]
    if mode in ("ddp", "ddp_without_ignore_list"):
        from torch.nn.parallel import DistributedDataParallel as DDP

        if mode == "ddp_without_ignore_list":  # the control: DDP broadcasts the experts
            del model._ddp_params_and_buffers_to_ignore
        wrapped = DDP(model)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        wrapped = fully_shard(model, mesh=mesh)
    step(wrapped, mine)
    grads = lora_grads(model)
    result = {
        "rank": rank,
        "world": world,
        "mode": mode,
        "experts_mapped": expert_file_mappings(converted),
        "experts_file_bytes": sum(f.stat().st_size for f in converted.glob("*.safetensors")),
        "core_share": core_share(),
        "threads": kt_ops.get_num_threads(),
        "ddp_ignored": len(getattr(model, "_ddp_params_and_buffers_to_ignore", ())),
    }
    if rank == 0:  # the same step in one process, on the whole batch
        single = lora_model(converted)
        step(single, ids)
        want = lora_grads(single)
        assert set(want) == set(grads), (sorted(want)[:3], sorted(grads)[:3])
        result["grad_rel"] = max(
            float((grads[k] - want[k]).norm() / want[k].norm().clamp_min(1e-30)) for k in want
        )
        result["num_lora_grads"] = len(want)
    (work / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
