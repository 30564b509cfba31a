"""The one registry of relax's pluggable parts: built-ins and installed packages' entry points, imported
only when built, a name given twice refused. The entry points are real ones: a distribution's metadata
written to a directory on ``sys.path``, read by :mod:`importlib.metadata` as an installed package's."""

from __future__ import annotations

import sys

import pytest

from relax_core.registry import Registry

GROUP = "relax.test_parts"


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A site directory on ``sys.path``; ``site(dist, module_source, entry_points)`` installs a package."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def install(dist: str, modules: dict[str, str], entry_points: dict[str, str]) -> None:
        for name, source in modules.items():
            (tmp_path / f"{name}.py").write_text(source)
        info = tmp_path / f"{dist}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
        lines = "".join(f"{k} = {v}\n" for k, v in entry_points.items())
        (info / "entry_points.txt").write_text(f"[{GROUP}]\n{lines}")

    return install


def test_a_built_in_is_imported_only_when_loaded(site):
    site("plain", {"regmod_lazy": "class Part:\n    pass\n"}, {})
    reg = Registry("--part", GROUP, {"lazy": "regmod_lazy:Part"})
    assert list(reg) == ["lazy"] and reg["lazy"] == "regmod_lazy:Part"
    assert "regmod_lazy" not in sys.modules
    assert reg.load("lazy").__name__ == "Part" and "regmod_lazy" in sys.modules


def test_an_installed_package_adds_a_part_by_entry_point(site):
    site(
        "third-party",
        {"regmod_theirs": "def make(**kw):\n    return ('made', kw)\n"},
        {"theirs": "regmod_theirs:make"},
    )
    reg = Registry("--part", GROUP, {"ours": "regmod_none:Part"})
    assert list(reg) == ["ours", "theirs"]
    assert reg.load("theirs")(x=1) == ("made", {"x": 1})


def test_a_name_given_twice_is_refused_naming_both(site):
    site("pkg-a", {"regmod_a": "X = 1\n"}, {"same": "regmod_a:X"})
    reg = Registry("--part", GROUP, {"same": "relax_core.registry:Registry"})
    with pytest.raises(RuntimeError) as e:
        list(reg)
    assert "'same' is registered twice" in str(e.value)
    assert "relax_core.registry:Registry" in str(e.value) and "regmod_a:X from pkg-a" in str(e.value)


def test_unknown_names_and_missing_code_say_what_to_do(site):
    site("broken", {"regmod_needs": "import not_installed_lib_xyz\n"}, {})
    reg = Registry(
        "--part",
        GROUP,
        {"needs": "regmod_needs:Part", "gone": "regmod_gone:Part"},
        hints={"needs": "xyz: pip install 'relax-x[xyz]'"},
    )
    with pytest.raises(ValueError, match=r"unknown --part 'nope'; available: \['gone', 'needs'\]"):
        reg.load("nope")
    with pytest.raises(ImportError, match=r"--part needs needs xyz: pip install 'relax-x\[xyz\]'"):
        reg.load("needs")
    with pytest.raises(ImportError, match=r"--part gone = regmod_gone:Part \(from relax\) does not import"):
        reg.load("gone")
