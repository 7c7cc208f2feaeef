"""The first ten minutes of a new user (items 13, 14): what the README, Makefile and pyproject promise.

Make recipes are checked with `make -n` (printed, never run): nothing is installed by these tests.
"""

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def _make_n(*args: str) -> str:
    out = subprocess.run(["make", "-n", "-B", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return out.stdout


def _torch_install_line(text: str) -> str:
    (line,) = [ln for ln in text.splitlines() if "pip install" in ln and "torch==" in ln]
    return line


@needs_make
def test_the_torch_index_is_a_make_variable_and_the_readme_says_which_build_you_get():
    """Item 13: plain PyPI gives the CUDA build; TORCH_INDEX chooses the CPU-only one."""
    assert "--index-url" not in _torch_install_line(_make_n(".venv/.installed-stamp"))
    cpu = "https://download.pytorch.org/whl/cpu"
    assert f"--index-url {cpu}" in _torch_install_line(
        _make_n(".venv/.installed-stamp", f"TORCH_INDEX={cpu}")
    )
    assert f"TORCH_INDEX={cpu}" in README and "CUDA build" in README
    assert "pins the CPU build" not in README  # the old, untrue promise


def test_the_readme_mentions_make_env_and_every_section_the_repo_points_at():
    """Item 14: `make env` is documented; references to README sections lead somewhere."""
    assert "make env" in README
    headings = set(re.findall(r"^#+ (.+)$", README, flags=re.M))
    for path in [ROOT / ".ci" / "constraints-cpu.txt", ROOT / "Makefile", ROOT / "pyproject.toml"]:
        for section in re.findall(r'README, (?:section )?"([^"]+)"', path.read_text()):
            assert section in headings, (
                f"{path.name} points at README section {section!r}, which does not exist"
            )


@needs_make
def test_make_pdf_says_what_it_installs_before_installing_and_the_readme_lists_it():
    """Item 14: the TeX packages are named (with why) before apt-get runs, and listed in the README."""
    packages = (
        re.search(r"^TEX_PACKAGES := (.+)$", (ROOT / "Makefile").read_text(), flags=re.M).group(1).split()
    )
    script = _make_n("texdeps")
    announce, install = script.find("Installing these Debian packages"), script.find("apt-get install")
    assert 0 <= announce < install and "xelatex" in script[:announce]
    section = README.split("## System packages", 1)[1].split("\n## ", 1)[0]
    assert all(p in section for p in packages), packages


def test_the_licence_is_an_spdx_string_and_metadata_builds_without_deprecation_warnings(tmp_path):
    """Item 14: `pip install` printed setuptools' licence-table deprecation warning."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert isinstance(project["project"]["license"], str)
    code = (
        "import warnings; warnings.simplefilter('always')\n"
        "from setuptools.build_meta import prepare_metadata_for_build_wheel\n"
        f"prepare_metadata_for_build_wheel({str(tmp_path)!r})\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "DeprecationWarning" not in out.stderr, out.stderr[-2000:]
