"""The wheel built from the sdist, installed next to an existing torch.

scripts/check_package.sh builds both, installs the wheel into a fresh virtual
environment with no package index, and runs these tests there with
COTENANT_SDIST and COTENANT_WHEEL naming the files it checked."""

import os
import subprocess
import sysconfig
import tarfile
import zipfile
from importlib import metadata

import pytest
from packaging.requirements import Requirement

SDIST = os.environ.get("COTENANT_SDIST")
WHEEL = os.environ.get("COTENANT_WHEEL")
if not (SDIST and WHEEL):
    pytest.skip("run by scripts/check_package.sh, against the sdist and wheel it builds", allow_module_level=True)

import cotenant  # noqa: E402

EXTENSION_REQUIRED = os.environ.get("COTENANT_REQUIRE_TORCH_EXTENSION") == "1"


def requirements():
    return [Requirement(text) for text in metadata.requires("cotenant") or []]


def test_the_package_imported_is_the_installed_wheel_not_a_source_tree():
    assert os.path.dirname(cotenant.__file__) == os.path.join(sysconfig.get_path("platlib"), "cotenant")
    assert metadata.version("cotenant") == cotenant.__version__


def test_core_module_imports_and_works():
    from cotenant import _core

    assert _core.parse_size("6GiB") == 6 << 30


@pytest.mark.skipif(not EXTENSION_REQUIRED, reason="no CUDA toolkit where the wheel was built: no cotenant._C")
def test_torch_extension_imports_next_to_the_installed_torch():
    import torch  # noqa: F401

    from cotenant import _C

    assert os.path.dirname(_C.__file__) == os.path.dirname(cotenant.__file__)


def test_console_script_prints_the_version():
    script = os.path.join(sysconfig.get_path("scripts"), "cotenant")
    out = subprocess.run([script, "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"cotenant {cotenant.__version__}\n"


def test_torch_requirement_accepts_every_patch_release_of_the_minor_release_the_abi_needs():
    import torch

    [req] = [r for r in requirements() if r.name == "torch"]
    assert req.marker is None
    installed = torch.__version__.split("+")[0]
    assert req.specifier.contains(installed)
    major, minor = (int(part) for part in installed.split(".")[:2])
    assert req.specifier.contains(f"{major}.{minor}.0") and req.specifier.contains(f"{major}.{minor}.9")
    assert not req.specifier.contains(f"{major}.{minor + 1}.0")
    assert not req.specifier.contains(f"{major}.{minor - 1}.9")


def test_only_torch_is_required_and_the_rest_are_extras():
    unconditional = sorted(r.name for r in requirements() if r.marker is None)
    assert unconditional == ["torch"]
    names = {r.name for r in requirements()}
    assert "numpy" not in names
    by_python = {r.name: str(r.marker) for r in requirements() if r.marker and "extra" not in str(r.marker)}
    assert by_python == {"tomli": 'python_version < "3.11"'}  # tomllib's stand-in for the coordinator's --config
    extras = {}
    for r in requirements():
        if r.marker is not None and "extra" in str(r.marker):
            for extra in metadata.metadata("cotenant").get_all("Provides-Extra"):
                if r.marker.evaluate({"extra": extra}):
                    extras.setdefault(extra, set()).add(r.name)
    assert extras["metrics"] == {"prometheus-client"}
    assert extras["timeline"] == {"matplotlib"}
    assert extras["nvml"] == {"nvidia-ml-py"}
    assert extras["cluster"] == {"ray", "scipy"}
    assert extras["all"] == {"prometheus-client", "matplotlib", "nvidia-ml-py", "ray", "scipy"}


def test_python_requirement_matches_torch():
    assert metadata.metadata("cotenant")["Requires-Python"] == ">=3.10"


def test_wheel_ships_py_typed_and_the_compiled_modules():
    with zipfile.ZipFile(WHEEL) as wheel:
        names = set(wheel.namelist())
    assert "cotenant/py.typed" in names
    assert any(n.startswith("cotenant/_core.") and n.endswith(".so") for n in names)
    assert any(n.startswith("cotenant/_C.") and n.endswith(".so") for n in names) == EXTENSION_REQUIRED
    assert os.path.exists(os.path.join(os.path.dirname(cotenant.__file__), "py.typed"))


def test_sdist_holds_the_build_files_and_no_build_outputs():
    with tarfile.open(SDIST) as sdist:
        names = {name.split("/", 1)[1] for name in sdist.getnames() if "/" in name}
    for needed in ("CMakeLists.txt", "setup.py", "pyproject.toml", "MANIFEST.in", "README.md", "LICENSE",
                   "CHANGELOG.md", "csrc/torch/CMakeLists.txt", "python/cotenant/py.typed"):
        assert needed in names
    assert any(n.startswith("include/cotenant/") for n in names)
    assert any(n.startswith("csrc/core/") for n in names)
    assert not [n for n in names if n.endswith((".so", ".pyc"))]
