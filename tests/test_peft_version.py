"""kt_ops.peft_adapters names the peft it needs instead of failing with a size mismatch."""

import pytest

peft = pytest.importorskip("peft")

from kt_ops import peft_adapters  # noqa: E402


def test_installed_peft_is_supported():
    assert peft_adapters._peft() is peft


@pytest.mark.parametrize("old", ["0.18.1", "0.17.0", "0.0.1+local"])
def test_older_peft_raises_naming_the_version(monkeypatch, old):
    if peft_adapters._version_tuple(old) >= peft_adapters._version_tuple(
        peft_adapters.MIN_PEFT_VERSION
    ):
        pytest.skip("not older than the minimum")
    monkeypatch.setattr(peft, "__version__", old)
    want = f"needs peft>={peft_adapters.MIN_PEFT_VERSION}, found peft {old}"
    with pytest.raises(ImportError, match=want.replace("+", r"\+").replace(".", r"\.")):
        peft_adapters.save_pretrained(object(), "/nonexistent")


def test_version_tuple():
    assert peft_adapters._version_tuple("0.21.2") == (0, 21, 2)
    assert peft_adapters._version_tuple("0.22.0.dev0") == (0, 22, 0)
    assert peft_adapters._version_tuple("1.0+cpu") == (1, 0)
