"""The project installs no bare top-level ``kernels`` or ``recipes``: the folders install as
``dit_mcore.kernels`` and ``dit_mcore.recipes`` (``setup.py``'s ``package_dir``), so Hugging Face's
``kernels`` package (installed beside ``transformers`` in many environments) and ours both import."""
from __future__ import annotations

import re
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BARE = re.compile(r"^\s*(from|import) (kernels|recipes)\b", re.M)


def test_no_source_imports_a_bare_kernels_or_recipes():
    found = [f"{path.relative_to(ROOT)}: {m.group(0).strip()}"
             for folder in ("dit_mcore", "energon_data", "kernels", "recipes", "tests", "benchmarks")
             for path in (ROOT / folder).rglob("*.py") for m in BARE.finditer(path.read_text())]
    assert not found, "import these as dit_mcore.kernels / dit_mcore.recipes:\n  " + "\n  ".join(found)


def test_a_bare_import_through_a_checkout_runs_nothing_and_transformers_sees_no_kernels():
    """With the checkout's root on ``sys.path`` (as under pytest here) the folders are reachable as bare
    ``kernels`` / ``recipes``, and ``transformers`` imports ``kernels`` there to read Hugging Face's
    version. That import must run none of our modules: a second copy would register the attention
    operators again, its plans not the ones the operator reads (it failed so in the suite). Our names
    refuse to load through the bare name, and ``transformers`` finds no Hugging Face ``kernels``."""
    probe = ("import sys\n"
             f"sys.path.insert(0, {str(ROOT)!r})\n"
             "import kernels, recipes\n"
             "assert sorted(m for m in sys.modules if m.split('.')[0] in ('kernels', 'recipes')) == "
             "['kernels', 'recipes'], sorted(sys.modules)\n"
             "try:\n"
             "    from kernels import Segments\n"
             "except ImportError as e:\n"
             "    assert 'dit_mcore.kernels' in str(e.__cause__ or e) or 'Segments' in str(e), e\n"
             "else:\n"
             "    raise SystemExit('a bare kernels loaded our modules')\n"
             "assert 'kernels.local_attention' not in sys.modules\n"
             "from transformers.utils.import_utils import is_kernels_available\n"
             "assert not is_kernels_available()\n"
             "from dit_mcore.kernels import Segments, context_parallel_attention\n"
             "import dit_mcore.kernels.planned_attention, dit_mcore.recipes.entry\n")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]


def test_pypis_kernels_package_and_ours_import_side_by_side(tmp_path):
    """A virtual environment over this one (which has the project installed) gets PyPI's ``kernels``;
    run outside the repository (no checkout folder on ``sys.path``), ``import kernels`` is theirs
    and ``import dit_mcore.kernels`` ours."""
    env = tmp_path / "env"
    venv.create(env, system_site_packages=True, with_pip=True)
    python = env / "bin" / "python"
    got = subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--no-input", "--no-deps", "kernels"],
                         capture_output=True, text=True, timeout=300)
    if got.returncode:
        pytest.skip(f"PyPI's kernels package could not be installed here: {got.stderr.strip()[-300:]}")
    probe = ("import kernels, dit_mcore.kernels as ours, dit_mcore.recipes.entry\n"
             "print(kernels.__file__); print(ours.__file__); print(hasattr(kernels, 'get_kernel'))")
    out = subprocess.run([str(python), "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    theirs, ours, has_get_kernel = out.stdout.split()[-3:]
    assert Path(theirs).is_relative_to(env) and has_get_kernel == "True"  # Hugging Face's package
    assert Path(ours) == ROOT / "kernels" / "__init__.py"
