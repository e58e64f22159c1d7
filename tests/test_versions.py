"""Issue 21: a framework version outside the supported range raises a clear error naming the
range where the integration first leans on it, never a wrong result (versions faked)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from ring_sp.integrations import versions
from ring_sp.integrations.versions import SUPPORTED, require_supported, requirement

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def _fake(monkeypatch: pytest.MonkeyPatch, version: str) -> None:
    monkeypatch.setattr(versions, "installed_version", lambda distribution: version)


@pytest.mark.parametrize("distribution", sorted(SUPPORTED))
def test_range_ends(monkeypatch: pytest.MonkeyPatch, distribution: str) -> None:
    """Inside: the lowest release and anything below the bound; outside: older, the bound and its pre-releases."""
    lowest, below = SUPPORTED[distribution]
    major, minor = (int(p) for p in below.split(".")[:2])
    for inside in (lowest, f"{major}.{minor - 1}.99"):
        _fake(monkeypatch, inside)
        require_supported(distribution, "x")
    for outside in (f"{below}.0", f"{below}.0.dev0", f"{major}.{minor + 3}.1", "0.0.1"):
        _fake(monkeypatch, outside)
        with pytest.raises(RuntimeError, match=f"supports {requirement(distribution)}.*{outside}"):
            require_supported(distribution, "x")


@pytest.mark.parametrize("version", ["5.17.0", "5.25.0", "6.0.0"])
def test_register_names_the_transformers_range(monkeypatch: pytest.MonkeyPatch, version: str) -> None:
    pytest.importorskip("transformers")
    from ring_sp.integrations.transformers import register

    _fake(monkeypatch, version)
    with pytest.raises(RuntimeError, match=rf"register supports transformers>=5\.18\.0,<.* but transformers {version} is installed"):
        register(None)  # the version is checked first, before the arguments


def test_ring_sp_section_names_the_deepspeed_range(monkeypatch: pytest.MonkeyPatch) -> None:
    import ring_sp.integrations.deepspeed as rsp_ds

    _fake(monkeypatch, "0.18.9")
    with pytest.raises(RuntimeError, match=r"supports deepspeed>=0\.19\.8,<0\.20.*0\.18\.9"):
        rsp_ds.build_topology({"ring_sp": {"ulysses_size": 2, "ring_size": 1}})  # before any communication


def test_readme_states_every_range() -> None:
    text = README.read_text(encoding="utf-8")
    for distribution in SUPPORTED:
        assert f"`{requirement(distribution)}`" in text, distribution


def test_newest_end_environment_covers_the_hf_stack() -> None:
    """``make test-newest`` installs the newest release inside each range of transformers, accelerate, trl and peft
    (the quoted requirements ``integrations/versions.py`` prints) and runs the TRL and FSDP2 tests there too."""
    make = (ROOT / "Makefile").read_text(encoding="utf-8").replace("\\\n", " ")
    setting = {name: value.split() for name, value in re.findall(r"^(NEWEST_\w+) \?= (.+)$", make, re.M)}
    assert {"transformers", "accelerate", "trl", "peft"} <= set(setting["NEWEST_DISTRIBUTIONS"]), setting
    assert {"tests/test_trl.py", "tests/test_fsdp2.py", "tests/test_transformers_trainer.py"} <= set(setting["NEWEST_TESTS"])
    assert "$(shell $(PYTHON) integrations/versions.py $(NEWEST_DISTRIBUTIONS))" in make
    printed = subprocess.run([sys.executable, str(ROOT / "integrations" / "versions.py"), "trl", "peft"],
                             capture_output=True, text=True, check=True).stdout.strip()
    assert shlex.split(printed) == [requirement("trl"), requirement("peft")], printed
    assert "'" in printed  # quoted: the Makefile hands it to a shell, where < would redirect
