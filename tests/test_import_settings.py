"""What `import ember` sets for the process: numpy's huge-page advice off unless the
environment chose (ember/__init__.py says why)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# _set_madvise_hugepage returns the setting it replaces: the one in force after the imports
PROBE = "{imports}; core = getattr(numpy, '_core', None) or numpy.core; print(core.multiarray._set_madvise_hugepage(True))"


@pytest.mark.parametrize(("imports", "env", "advice"), [("import numpy, ember", None, "False"),
                                                       ("import ember, numpy", None, "False"),
                                                       ("import numpy, ember", "1", "True")])
def test_numpy_huge_page_advice_is_off_unless_the_environment_chose(imports, env, advice):
    environ = {k: v for k, v in os.environ.items() if k != "NUMPY_MADVISE_HUGEPAGE"}
    if env is not None:
        environ["NUMPY_MADVISE_HUGEPAGE"] = env
    out = subprocess.run([sys.executable, "-c", PROBE.format(imports=imports)], env=environ, capture_output=True,
                         text=True, check=True)
    assert out.stdout.split() == [advice]
