"""Builds cotenant's compiled modules through CMake.

    pip install --no-build-isolation .        # or -e . for a development install
    pip wheel --no-build-isolation --no-deps -w dist .   # a wheel
    scripts/check_package.sh                  # an sdist, a wheel built from it, checked

CMake builds cotenant._core (the allocator core for Python) and, when the CUDA
toolkit and torch are found, cotenant._C (the torch extension). Every module
CMake puts in <build>/python/cotenant/ is copied into the package. fmt comes
from Debian's libfmt-dev, or else from the headers the torch wheel ships;
tsl::robin_map from Debian's robin-map-dev, or a prefix on CMAKE_PREFIX_PATH
(CMakeLists.txt). MANIFEST.in lists what the sdist holds besides the package.

Environment:
  CMAKE_BUILD_PARALLEL_LEVEL   parallel compile jobs (default: the CPU count)
  COTENANT_CMAKE_ARGS          extra arguments for the CMake configure step
  COTENANT_CMAKE_BUILD_DIR     the CMake build directory (default: under setuptools' build_temp)
  COTENANT_BUILD_TORCH=0       skip the torch extension even when CUDA is found
"""

import glob
import os
import re
import shlex
import shutil
import subprocess
import sys

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))


def read_version() -> str:
    with open(os.path.join(HERE, "python", "cotenant", "__init__.py"), encoding="utf-8") as f:
        match = re.search(r'^__version__\s*=\s*"([^"]+)"', f.read(), re.MULTILINE)
    if not match:
        raise RuntimeError("python/cotenant/__init__.py must define __version__")
    return match.group(1)


class CMakeExtension(Extension):
    """A module CMake builds; setuptools only copies it into place."""

    def __init__(self, name: str):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def run(self):
        cmake = shutil.which("cmake")
        if cmake is None:
            raise RuntimeError("building cotenant needs CMake >= 3.25: apt-get install cmake, or pip install cmake")
        build_dir = os.path.abspath(os.environ.get("COTENANT_CMAKE_BUILD_DIR") or os.path.join(self.build_temp, "cmake"))
        os.makedirs(build_dir, exist_ok=True)
        configure = [
            cmake, "-S", HERE, "-B", build_dir,
            f"-DPython3_EXECUTABLE={sys.executable}",
            "-DCMAKE_BUILD_TYPE=Release",
            "-DCOTENANT_BUILD_PYTHON=ON",
            "-DCOTENANT_BUILD_TESTS=OFF",
            f"-DCOTENANT_BUILD_TORCH={'OFF' if os.environ.get('COTENANT_BUILD_TORCH') == '0' else 'ON'}",
        ]
        if shutil.which("ninja") and not os.path.exists(os.path.join(build_dir, "CMakeCache.txt")):
            configure += ["-G", "Ninja"]
        configure += shlex.split(os.environ.get("COTENANT_CMAKE_ARGS", ""))
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL") or str(os.cpu_count() or 1)
        subprocess.run(configure, check=True)
        subprocess.run([cmake, "--build", build_dir, "--parallel", jobs], check=True)

        # Every compiled module of the package (_core, and _C where it was built).
        built = sorted(glob.glob(os.path.join(build_dir, "python", "cotenant", "*.so")))
        if not built:
            raise RuntimeError(f"CMake built no Python module in {build_dir}/python/cotenant")
        destinations = [os.path.dirname(self.get_ext_fullpath("cotenant._core"))]
        if getattr(self, "editable_mode", False):
            # pip install -e: the package is imported from python/cotenant itself.
            destinations.append(os.path.join(HERE, "python", "cotenant"))
        for destination in destinations:
            os.makedirs(destination, exist_ok=True)
            for module in built:
                shutil.copy2(module, destination)
                print(f"cotenant: installed {os.path.basename(module)} into {destination}")


def read_readme() -> str:
    with open(os.path.join(HERE, "README.md"), encoding="utf-8") as f:
        return f.read()


# cotenant._C links against torch's C++ ABI, which holds within a minor release
# (2.11.0, 2.11.1, ...) and not across them: the wheel built against one minor
# release runs with any patch release of it. pyproject.toml's build requirement
# says the same.
TORCH_REQUIREMENT = "torch>=2.11,<2.12"

# Optional features and what they need; the code imports these lazily and
# names the extra when one is missing (cotenant._extras).
EXTRAS = {
    "metrics": ["prometheus-client"],   # cotenant coordinator --metrics-port
    "timeline": ["matplotlib"],         # cotenant timeline
    "nvml": ["nvidia-ml-py"],           # the coordinator lists the node's GPUs (UUIDs) through NVML
    "cluster": ["ray>=2.60", "scipy"],  # cotenant cluster; AlloX's matching in cotenant simulate --cluster
}
EXTRAS["all"] = sorted({requirement for requirements in EXTRAS.values() for requirement in requirements})
EXTRAS["test"] = ["pytest", "hypothesis", "packaging"]

setup(
    name="cotenant",
    version=read_version(),
    description="Share one NVIDIA GPU between PyTorch jobs without hurting the one that matters",
    long_description=read_readme(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    classifiers=[
        "License :: OSI Approved :: Apache Software License",
        "Operating System :: POSIX :: Linux",
        "Programming Language :: C++",
        "Programming Language :: Python :: 3",
        "Environment :: GPU :: NVIDIA CUDA",
        "Typing :: Typed",
    ],
    package_dir={"": "python"},
    packages=find_packages(where="python"),
    package_data={"cotenant": ["py.typed"]},
    ext_modules=[CMakeExtension("cotenant._core")],
    cmdclass={"build_ext": CMakeBuild},
    python_requires=">=3.10",  # as torch 2.11
    install_requires=[TORCH_REQUIREMENT, "tomli>=1.1; python_version < \"3.11\""],  # the coordinator's --config
    extras_require=EXTRAS,
    entry_points={
        "console_scripts": [
            "cotenant = cotenant.cli:main",
            "cotenant-replay = cotenant.replay:main",
        ]
    },
    zip_safe=False,
)
