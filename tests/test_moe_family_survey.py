"""The MoE family survey (scripts/moe_family_survey.py) on a fixed slice of families.

Each family runs in its own subprocess: a tiny random model before and after
``replace_experts``, logits and embedding gradients compared. The slice covers the layouts
and GLUs kt_ops serves (fused SwiGLU, gpt-oss's biased clamped GLU, DeepSeek-V4's clamp,
NemotronH's non-gated relu2, JetMoE's and Llama 4's blocks, MuseSpark's post-expert norm,
Inkling2's softcaps, DBRX's stacked experts, a hybrid linear-attention model); every one
must be SERVED.
``KT_OPS_SURVEY_ALL=1`` runs every MoE family of the installed transformers and fails on
any WRONG or CRASH, or a tiny model the survey cannot build (NOT_BUILT) (minutes).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import moe_family_survey as survey  # noqa: E402

SLICE = [
    "qwen3_moe", "mixtral", "gpt_oss", "deepseek_v4", "nemotron_h", "jetmoe", "olmoe",
    "llama4", "muse_spark", "inkling2", "dbrx", "qwen3_next",
]  # fmt: skip

#: Families kt_ops refuses, with the reason the survey must report.
REFUSED = {
    "switch_transformers": "nn.ModuleDict of non-gated MLPs",
}


def test_survey_slice_is_served():
    results = survey.survey(SLICE, timeout=300)
    bad = [r for r in results if r["outcome"] != "SERVED"]
    assert not bad, bad


def test_survey_refusals_name_their_reason():
    for r in survey.survey(sorted(REFUSED), timeout=300):
        assert r["outcome"] == "REFUSED" and REFUSED[r["family"]] in r["why"], r


@pytest.mark.skipif(os.environ.get("KT_OPS_SURVEY_ALL") != "1", reason="set KT_OPS_SURVEY_ALL=1")
def test_survey_every_family_has_no_wrong_or_crash():
    results = survey.survey(survey.moe_model_types(), timeout=300)
    bad = [r for r in results if r["outcome"] in ("WRONG", "CRASH", "NOT_BUILT")]
    assert not bad, bad
