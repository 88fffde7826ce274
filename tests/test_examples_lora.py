"""examples/lora_sft.py: the dataset, the tokenizer, and a few training steps vs plain PEFT.

The run uses a tiny model (hidden 64, 8 experts) for 4 steps with ``--compare-peft``: the loss
falls, and the first steps' losses match transformers + PEFT within the example's stated
tolerance (``LOSS_RTOL = 1e-4`` relative; both sides fp32 with the same bf16-valued expert
weights and the same initial adapter). On ``backend=reference`` (before ``kt::moe_backward``
lands) the experts compute with the dense reference, which checks the script's plumbing.
"""

# ruff: noqa: F811

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from lora_helpers import backend  # noqa: F401  (a fixture)

pytest.importorskip("peft")
pytest.importorskip("tokenizers")

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("lora_sft", ROOT / "examples" / "lora_sft.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["lora_sft"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


TINY = [
    "--hidden-size", "64", "--moe-intermediate-size", "32", "--num-experts", "8",
    "--top-k", "2", "--num-heads", "4", "--num-kv-heads", "2", "--head-dim", "16",
    "--lr", "1e-2", "--batch-size", "8", "--rank", "4", "--alpha", "8",
]  # fmt: skip


def test_dataset_and_tokenizer(example):
    records = example.load_records()
    assert 50 <= len(records) <= 100
    assert all(set(r) == {"instruction", "input", "output"} and r["output"] for r in records)
    info = json.loads((ROOT / "examples" / "data" / "dataset_info.json").read_text())
    assert info["tiny_sft"]["file_name"] == "tiny_sft.jsonl"  # LLaMA-Factory's view of it
    tok = example.build_tokenizer(records)
    assert len(tok) == 384 and tok.pad_token_id == 0 and tok.eos_token == "<eos>"
    text = example.prompt_of(records[8]) + records[8]["output"]
    assert tok.decode(tok(text)["input_ids"]) == text  # byte-level BPE round-trips
    ids, labels = example.encode(records[8], tok, max_len=64)
    n_prompt = len(tok(example.prompt_of(records[8]))["input_ids"])
    assert labels[:n_prompt] == [-100] * n_prompt and labels[n_prompt:] == ids[n_prompt:]
    assert ids[-1] == tok.eos_token_id
    batches = example.make_batches(records, tok, 8, 10, 64, seed=0)
    assert len(batches) == 10 and batches[0][0].shape[0] == 8


def test_example_trains_and_matches_peft(example, backend, tmp_path, capsys):
    result = example.run(
        [*TINY, "--steps", "4", "--compare-peft", "--output-dir", str(tmp_path / "adapter")]
    )
    out = capsys.readouterr().out
    assert result.ok, out
    assert result.kt.losses[-1] < result.kt.losses[0]
    assert result.max_rel_diff <= example.LOSS_RTOL
    assert "verdict    : PASS" in out and "tok/s" in out and "peak RSS" in out
    assert (tmp_path / "adapter" / "adapter_model.safetensors").exists()
    experts_only = example.run([*TINY, "--steps", "2", "--quiet", "--no-attn-lora"])
    assert len(experts_only.kt.losses) == 2 and experts_only.peft is None
