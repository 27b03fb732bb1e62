"""Builds the compiled prefix index (`kvsched.core._holdings`), per-instance scoring
(`kvsched.core._scoring`) and engines' prefix cache (`kvsched.cache._cache`);
everything else about the package is in pyproject.toml. pip runs this on `pip install .`,
`pip install -e .` and wheel builds: it needs a C compiler and the Python headers, and says so
plainly when one is missing."""

from __future__ import annotations

import shutil
import sysconfig

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CCompilerError, ExecError, PlatformError

HINT = (
    "kvsched's compiled prefix index, scoring and prefix cache (kvsched/core/_holdings.c, "
    "_scoring.c, kvsched/cache/_cache.c) need a C compiler and the Python headers: install "
    "them (Debian/Ubuntu: apt-get install gcc python3-dev) and run pip again"
)


class BuildExt(build_ext):  # type: ignore[misc]  # setuptools ships no types
    """build_ext that names the missing compiler instead of failing deep in a subprocess."""

    def build_extensions(self) -> None:
        compiler = getattr(self.compiler, "compiler_so", None) or []
        if compiler and shutil.which(compiler[0]) is None:
            raise SystemExit(f"error: C compiler {compiler[0]!r} not found. {HINT}")
        headers = sysconfig.get_paths()["include"]
        try:
            super().build_extensions()
        except (CCompilerError, ExecError, PlatformError) as exc:
            raise SystemExit(
                f"error: {exc}. {HINT} (Python headers expected in {headers})"
            ) from exc


C_FLAGS = [
    "-O2",
    "-std=c11",
    "-Wall",
    "-Wextra",
    "-Wno-missing-field-initializers",
    "-Wno-unused-parameter",
    "-Wno-cast-function-type",
]

# The hash tables' shared mixing step; `depends` also puts it in the sdist.
HASH_MIX = {"include_dirs": ["kvsched"], "depends": ["kvsched/hash_mix.h"]}

setup(
    ext_modules=[
        Extension(
            "kvsched.core._holdings",
            ["kvsched/core/_holdings.c"],
            extra_compile_args=C_FLAGS,
            **HASH_MIX,
        ),
        # The scoring must match numpy's arithmetic bit for bit: no fused multiply-adds, no
        # reassociation (-O2 alone never reassociates; -ffp-contract=off keeps a*b+c two
        # roundings, as numpy's separate ufuncs make it).
        Extension(
            "kvsched.core._scoring",
            ["kvsched/core/_scoring.c"],
            extra_compile_args=[*C_FLAGS, "-ffp-contract=off", "-fno-fast-math"],
        ),
        Extension(
            "kvsched.cache._cache",
            ["kvsched/cache/_cache.c"],
            extra_compile_args=C_FLAGS,
            **HASH_MIX,
        ),
    ],
    cmdclass={"build_ext": BuildExt},
)
