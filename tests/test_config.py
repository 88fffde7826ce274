"""kt_ops.config: the process-wide settings as one object (issue #25).

* Each knob reads, sets and restores through ``kt_ops.config`` (attribute access), and the
  older ``set_*`` / ``get_*`` / ``use_*`` aliases see the same value both ways.
* ``config.override(...)`` sets several knobs for a block and restores them, on an exception
  too, and when a later value of the same call is invalid.
* An invalid value raises ``ValueError`` naming the knob and its valid values, and leaves
  the setting as it was; an unknown knob name is refused.
* ``as_dict()`` reports every knob; the class docstring names every ``KT_OPS_*`` variable
  that csrc/ reads, and the variables give the knobs their initial values.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import kt_ops
from kt_ops import config

KNOBS = (
    "num_threads",
    "parallel_backend",
    "isa",
    "compute_path",
    "quant_activations",
    "brgemm_bf16_kernel",
    "numa",
)


def knob_values(knob: str) -> list:
    """Every value of ``knob`` that can be set on this machine."""
    return {
        "num_threads": [1, 2, 3],
        "parallel_backend": ["pool", "auto"] + (["openmp"] if OPENMP else []),
        "isa": kt_ops.supported_isas(),
        "compute_path": ["streaming", "brgemm", "auto"],
        "quant_activations": ["q8", "fp32", "auto"],
        "brgemm_bf16_kernel": ["onednn", "kt", "auto"],
        "numa": ["off", "on", "auto"],
    }[knob]


OPENMP = torch.backends.openmp.is_available()

#: knob -> (its getter, setter and context-manager aliases; use_ is None for num_threads).
ALIASES = {
    "num_threads": (kt_ops.get_num_threads, kt_ops.set_num_threads, None),
    "parallel_backend": (
        kt_ops.get_parallel_backend,
        kt_ops.set_parallel_backend,
        kt_ops.use_parallel_backend,
    ),
    "isa": (kt_ops.active_isa, kt_ops.set_isa, kt_ops.use_isa),
    "compute_path": (kt_ops.get_compute_path, kt_ops.set_compute_path, kt_ops.use_compute_path),
    "quant_activations": (
        kt_ops.get_quant_activations,
        kt_ops.set_quant_activations,
        kt_ops.use_quant_activations,
    ),
    "brgemm_bf16_kernel": (
        kt_ops.get_brgemm_bf16_kernel,
        kt_ops.set_brgemm_bf16_kernel,
        kt_ops.use_brgemm_bf16_kernel,
    ),
    "numa": (kt_ops.get_numa, kt_ops.set_numa, kt_ops.use_numa),
}

#: knob -> (invalid values, a pattern of the valid values that the error must name).
INVALID = {
    "num_threads": ([0, -1, 10**6, 2**70], r"must be in \[1, "),
    "parallel_backend": (["threads", "", None, 1], r"'auto', 'pool' or 'openmp'"),
    "isa": (["avx9", "AVX2", ""], r"expected one of ref, avx2, avx512"),
    "compute_path": (["fast", "Brgemm", None, 1], r"'auto', 'streaming' or 'brgemm'"),
    "quant_activations": (["int4", "Q8", ""], r"'auto', 'q8' or 'fp32'"),
    "brgemm_bf16_kernel": (["amx", "oneDNN", None], r"'auto', 'onednn' or 'kt'"),
    "numa": (["yes", "ON", "", None], r"'auto', 'on' or 'off'"),
}


def other_value(knob: str):
    """A value of ``knob`` other than its current one (skips if there is none)."""
    now = getattr(config, knob)
    for v in knob_values(knob):
        if v != now:
            return v
    pytest.skip(f"{knob}: only one value can be set here")


# --------------------------------------------------------------------------
# The object
# --------------------------------------------------------------------------


def test_config_is_exported():
    assert kt_ops.config is kt_ops.runtime.config
    assert isinstance(kt_ops.config, kt_ops.Config)
    assert "config" in kt_ops.__all__ and "Config" in kt_ops.__all__
    assert config.KNOBS == KNOBS
    assert set(KNOBS) == set(ALIASES) == set(INVALID)


def test_as_dict_reports_every_knob():
    report = config.as_dict()
    assert list(report) == list(KNOBS)
    assert report == {k: getter() for k, (getter, _, _) in ALIASES.items()}
    assert isinstance(report["num_threads"], int) and report["num_threads"] >= 1
    assert all(isinstance(v, str) for k, v in report.items() if k != "num_threads")
    assert report["isa"] in kt_ops.supported_isas()
    for k, v in report.items():
        assert f"{k}={v!r}" in repr(config)


@pytest.mark.parametrize("knob", KNOBS)
def test_each_knob_reads_sets_and_restores(knob):
    getter, _, _ = ALIASES[knob]
    before = getattr(config, knob)
    try:
        for value in knob_values(knob):
            setattr(config, knob, value)
            assert getattr(config, knob) == value
            assert getter() == value
            assert config.as_dict()[knob] == value
    finally:
        setattr(config, knob, before)
    assert getattr(config, knob) == before


@pytest.mark.parametrize("knob", KNOBS)
def test_each_knob_is_documented(knob):
    doc = type(config).__dict__[knob].__doc__
    assert doc and doc.strip()
    assert f"``{knob}``" in type(config).__doc__


def test_unknown_attribute_is_refused():
    with pytest.raises(AttributeError, match=r"no setting 'num_thread'.*num_threads, "):
        config.num_thread = 4  # a typo must not create an attribute silently
    with pytest.raises(AttributeError):
        config.KNOBS = ()
    with pytest.raises(AttributeError):
        _ = config.no_such_knob
    assert config.KNOBS == KNOBS


# --------------------------------------------------------------------------
# override()
# --------------------------------------------------------------------------


def test_override_sets_several_and_restores():
    before = config.as_dict()
    isa = kt_ops.supported_isas()[0]
    with config.override(isa=isa, compute_path="streaming", quant_activations="fp32") as cfg:
        assert cfg is config
        assert config.isa == isa
        assert config.compute_path == "streaming"
        assert config.quant_activations == "fp32"
        # knobs the call did not name are untouched
        assert config.num_threads == before["num_threads"]
        assert config.numa == before["numa"]
    assert config.as_dict() == before


def test_override_with_nothing_changes_nothing():
    before = config.as_dict()
    with config.override():
        assert config.as_dict() == before
    assert config.as_dict() == before


def test_override_restores_on_exception():
    before = config.as_dict()
    with pytest.raises(RuntimeError, match="boom"):
        with config.override(compute_path="brgemm", brgemm_bf16_kernel="onednn", num_threads=1):
            assert config.compute_path == "brgemm"
            raise RuntimeError("boom")
    assert config.as_dict() == before


def test_override_restores_what_the_block_changed():
    before = config.as_dict()
    with config.override(quant_activations="q8"):
        config.quant_activations = "fp32"
        config.compute_path = "streaming"  # not overridden: stays as the block left it
    assert config.quant_activations == before["quant_activations"]
    assert config.compute_path == "streaming"
    config.compute_path = before["compute_path"]
    assert config.as_dict() == before


def test_override_nests():
    before = config.as_dict()
    with config.override(compute_path="streaming"):
        with config.override(compute_path="brgemm", quant_activations="q8"):
            assert (config.compute_path, config.quant_activations) == ("brgemm", "q8")
        assert config.compute_path == "streaming"
        assert config.quant_activations == before["quant_activations"]
    assert config.as_dict() == before


def test_override_with_an_invalid_value_restores_the_ones_set_before():
    before = config.as_dict()
    with pytest.raises(ValueError, match="set_quant_activations"):
        with config.override(compute_path="streaming", quant_activations="int4"):
            pytest.fail("the block must not run")
    assert config.as_dict() == before


def test_override_with_an_unknown_name_sets_nothing():
    before = config.as_dict()
    with pytest.raises(TypeError, match=r"unknown setting 'threads'.*num_threads, "):
        with config.override(compute_path="streaming", threads=2):
            pytest.fail("the block must not run")
    assert config.as_dict() == before


# --------------------------------------------------------------------------
# Invalid values
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "knob, bad", [(knob, bad) for knob, (bads, _) in INVALID.items() for bad in bads]
)
def test_invalid_value_raises_naming_the_knob(knob, bad):
    _, setter, _ = ALIASES[knob]
    valid = INVALID[knob][1]
    before = getattr(config, knob)
    with pytest.raises(ValueError, match=rf"kt_ops\.set_{knob}: .*{valid}") as via_config:
        setattr(config, knob, bad)
    assert getattr(config, knob) == before
    with pytest.raises(ValueError) as via_alias:
        setter(bad)
    assert str(via_alias.value) == str(via_config.value)  # the same validated setter
    with pytest.raises(ValueError, match=rf"kt_ops\.set_{knob}: .*{valid}"):
        with config.override(**{knob: bad}):
            pytest.fail("the block must not run")
    assert getattr(config, knob) == before


# --------------------------------------------------------------------------
# The aliases
# --------------------------------------------------------------------------


@pytest.mark.parametrize("knob", KNOBS)
def test_aliases_and_config_agree(knob):
    getter, setter, use = ALIASES[knob]
    before = getattr(config, knob)
    value = other_value(knob)
    try:
        setter(value)  # the alias sets, config reads
        assert getattr(config, knob) == value == getter()
        setattr(config, knob, before)  # config sets, the alias reads
        assert getter() == before
    finally:
        setattr(config, knob, before)
    if use is not None:
        with use(value):
            assert getattr(config, knob) == value
        assert getattr(config, knob) == before
        with pytest.raises(RuntimeError):
            with use(value):
                raise RuntimeError
        assert getattr(config, knob) == before


ALIAS_NAMES = [
    "set_num_threads",
    "get_num_threads",
    "set_parallel_backend",
    "get_parallel_backend",
    "use_parallel_backend",
    "set_isa",
    "active_isa",
    "use_isa",
    "set_compute_path",
    "get_compute_path",
    "use_compute_path",
    "set_quant_activations",
    "get_quant_activations",
    "use_quant_activations",
    "set_brgemm_bf16_kernel",
    "get_brgemm_bf16_kernel",
    "use_brgemm_bf16_kernel",
    "set_numa",
    "get_numa",
    "use_numa",
]


@pytest.mark.parametrize("name", ALIAS_NAMES)
def test_alias_is_exported_and_marked(name):
    assert name in kt_ops.__all__
    fn = getattr(kt_ops, name)
    assert fn is getattr(kt_ops.runtime, name)
    doc = " ".join(fn.__doc__.split())
    assert "Alias of ``kt_ops.config." in doc
    assert "deprecation cycle" in doc


# --------------------------------------------------------------------------
# Environment variables
# --------------------------------------------------------------------------

CSRC = Path(__file__).resolve().parent.parent / "csrc"


@pytest.mark.skipif(not CSRC.is_dir(), reason="csrc/ not found next to tests/")
def test_docstring_names_every_environment_variable():
    read = set()
    for path in CSRC.rglob("*.cpp"):
        read |= set(re.findall(r'getenv\("(KT_OPS_[A-Z0-9_]+)"\)', path.read_text()))
    assert read >= {"KT_OPS_NUM_THREADS", "KT_OPS_ISA", "KT_OPS_NUMA", "KT_OPS_PARALLEL_BACKEND"}
    doc = type(config).__doc__
    assert sorted(v for v in read if f"``{v}``" not in doc) == []


def test_environment_gives_the_initial_values(python_subprocess):
    isa = kt_ops.supported_isas()[0]
    code = "import json, kt_ops; print(json.dumps(kt_ops.config.as_dict()))"
    env = {
        "KT_OPS_NUM_THREADS": "1",
        "KT_OPS_ISA": isa,
        "KT_OPS_NUMA": "off",
        "KT_OPS_PARALLEL_BACKEND": "pool",
    }
    r = python_subprocess(code, env=env)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["num_threads"] == 1
    assert got["isa"] == isa
    assert got["numa"] == "off"
    assert got["parallel_backend"] == "pool"
    assert (got["compute_path"], got["quant_activations"], got["brgemm_bf16_kernel"]) == (
        "auto",
        "auto",
        "auto",
    )


@pytest.mark.parametrize(
    "var, bad, knob, value, settable",
    [
        ("KT_OPS_ISA", "avx9", "isa", "ref", True),
        ("KT_OPS_NUM_THREADS", "many", "num_threads", 1, True),
        ("KT_OPS_NUMA", "sometimes", "numa", "off", False),
    ],
)
def test_malformed_environment_is_an_error(python_subprocess, var, bad, knob, value, settable):
    """Reading the knob names the variable; setting the knob ends the error (not for NUMA)."""
    code = (
        "import kt_ops\n"
        "for step in ('read', 'set'):\n"
        "    try:\n"
        f"        if step == 'set': kt_ops.config.{knob} = {value!r}\n"
        f"        print(step, 'ok', repr(kt_ops.config.{knob}))\n"
        "    except ValueError as e:\n"
        "        print(step, 'error', e)\n"
    )
    r = python_subprocess(code, env={var: bad})
    assert r.returncode == 0, r.stderr
    read, set_ = r.stdout.strip().splitlines()[-2:]
    assert read.startswith("read error")
    assert var in read and bad in read
    if settable:
        assert set_ == f"set ok {value!r}"
    else:
        assert set_.startswith("set error") and var in set_
