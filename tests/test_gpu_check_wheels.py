"""Issue 40 item 2: a carried wheel replaces an installed distribution outside ring_sp's supported
range (or outside what another carried wheel requires) for the run; the card says which.

Installed versions and supported ranges are faked, the wheels are small files made here, so the
rules run on the CPU exactly as they will on the GPU image (transformers 5.17 there, 5.18 carried).
"""

from __future__ import annotations

import importlib.metadata
import sys
import zipfile
from pathlib import Path

import pytest

from benchmarks.gpu_check.preflight import card_markdown
from benchmarks.gpu_check.wheels import Wheel, install_wheels, plan_wheels

SUPPORTED = {"fakeframework": ("5.18.0", "5.25")}


def _write_wheel(folder: Path, name: str, version: str, answer: int, *requires: str) -> Path:
    info = f"{name}-{version}.dist-info"
    path = folder / f"{name}-{version}-py3-none-any.whl"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    meta += "".join(f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(path, "w") as whl:
        whl.writestr(f"{name}/__init__.py", f"ANSWER = {answer}\n")
        whl.writestr(f"{info}/METADATA", meta)
        whl.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        whl.writestr(f"{info}/RECORD", f"{name}/__init__.py,,\n{info}/METADATA,,\n{info}/WHEEL,,\n{info}/RECORD,,\n")
    return path


def _wheel(folder: Path, name: str, version: str, *requires: str) -> Wheel:
    return Wheel.of(_write_wheel(folder, name, version, 0, *requires))


def _installed(versions: dict[str, str]):
    return lambda name: versions.get(name)


def test_an_out_of_range_framework_and_the_hub_it_needs_are_replaced(tmp_path) -> None:
    """The GPU image's case: framework 5.17 installed (supported from 5.18), the carried 5.18
    needs fakehub >= 1.31 where 1.20 is installed; a requirement nothing meets is named."""
    wheels = [_wheel(tmp_path, "fakeframework", "5.18.0", "fakehub<3.0,>=1.31.0", "fakedep>=2",
                     "fakeos; sys_platform == 'nope'"),
              _wheel(tmp_path, "fakehub", "1.31.0"), _wheel(tmp_path, "fakeaccel", "1.15.0"),
              _wheel(tmp_path, "fakemissing", "0.1")]
    here = {"fakeframework": "5.17.0", "fakehub": "1.20.0", "fakeaccel": "1.15.0", "fakedep": "1.0"}
    plan = plan_wheels(wheels, _installed(here), SUPPORTED)
    assert set(plan.install) == {"fakeframework", "fakehub", "fakemissing"}
    why = {name: reason for name, (_, reason) in plan.install.items()}
    assert "fakeframework 5.17.0 is outside ring_sp's supported fakeframework>=5.18.0,<5.25" in why["fakeframework"]
    assert "fakehub 1.20.0 does not meet fakeframework 5.18.0's requirement fakehub<3.0,>=1.31.0" in why["fakehub"]
    assert why["fakemissing"] == "missing here"
    assert plan.kept == {"fakeaccel": "1.15.0"}
    assert plan.unmet == ["fakeframework 5.18.0 needs fakedep>=2; here 1.0 (no wheel of the folder meets it)"]


def test_an_in_range_framework_is_left_and_its_hub_with_it(tmp_path) -> None:
    """Negative control: the machine's supported copy runs; nothing it needs is replaced."""
    wheels = [_wheel(tmp_path, "fakeframework", "5.18.0", "fakehub>=1.31.0"), _wheel(tmp_path, "fakehub", "1.31.0")]
    plan = plan_wheels(wheels, _installed({"fakeframework": "5.20.1", "fakehub": "1.20.0"}), SUPPORTED)
    assert plan.install == {} and plan.kept == {"fakeframework": "5.20.1", "fakehub": "1.20.0"} and plan.unmet == []


def test_a_carried_wheel_that_does_not_meet_the_requirement_is_not_taken(tmp_path) -> None:
    wheels = [_wheel(tmp_path, "fakeframework", "5.18.0", "fakehub>=1.31.0"), _wheel(tmp_path, "fakehub", "1.25.0")]
    plan = plan_wheels(wheels, _installed({"fakeframework": "5.17.0", "fakehub": "1.20.0"}), SUPPORTED)
    assert set(plan.install) == {"fakeframework"}
    assert plan.unmet == ["fakeframework 5.18.0 needs fakehub>=1.31.0; here 1.20.0 (no wheel of the folder meets it)"]


def test_install_replaces_for_the_run_and_the_card_says_so(tmp_path, monkeypatch) -> None:
    """End to end with real wheel files: the carried copy is the one imported and the one
    ``importlib.metadata`` reports (what ``require_supported`` reads); the card names it."""
    name = "gpu_check_override_probe"
    folder = tmp_path / "wheels"
    folder.mkdir()
    _write_wheel(folder, name, "5.18.0", 518, "packaging>=1")
    wheel = Wheel.of(next(folder.glob("*.whl")))
    assert (wheel.distribution, wheel.version, wheel.modules()) == ("gpu-check-override-probe", "5.18.0", (name,))
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", "")
    fake = {"gpu-check-override-probe": "5.17.0"}
    record = install_wheels(folder, lambda d: fake.get(d) or importlib.metadata.version(d),
                            {"gpu-check-override-probe": ("5.18.0", "5.25")})
    try:
        assert record["installed"] == [f"{name}-5.18.0-py3-none-any.whl"] and record["unmet"] == []
        assert record["replaced"]["gpu-check-override-probe"]["installed"] == "5.17.0"
        assert __import__(name).ANSWER == 518 and importlib.metadata.version(name) == "5.18.0"
        lines = "\n".join(card_markdown({**_CARD, "wheels": record}, {}))
        assert "Replaced for this run: gpu-check-override-probe 5.17.0 by the carried 5.18.0 (" in lines
        # a distribution this process has imported already cannot be replaced: the run stops, naming it
        with pytest.raises(SystemExit, match="has imported"):
            install_wheels(folder, lambda d: fake.get(d), {"gpu-check-override-probe": ("5.18.0", "5.25")})
    finally:
        sys.modules.pop(name, None)


_CARD = {"started": "now", "command": "x", "mode": "dry", "commit": None, "device": "CPU", "memory_bytes": None,
         "capability": None, "torch": "2", "cuda": None, "cudnn": None, "python": "3", "dtype": "float32",
         "kernel": "torch", "flash_attn": "-", "deepspeed": None, "alloc_conf": None}
