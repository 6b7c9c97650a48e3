import gc
import os
import sys

# Inductor's CPU kernels compile as scalar C++ in the suite (its children inherit this): the compiled cases check what
# the project asks of the compiler (one graph per layer, no breaks, eager's numbers), not Inductor's SIMD C++ (GPU
# training runs Triton), and the vectorised C++ took a third more CPU to compile (a compiled two-rank layout case:
# 203 -> 129 CPU-s, test_compile.py: 570 -> 386, cold caches). Set it to 1 to test the vectorised kernels.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")

# Tests import the packages from the checkout even before `pip install -e .`.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pytest


# Under xdist, the longest groups start first (seconds on 2 cores, cold compile caches, in brackets), so that no
# long one starts last; the rest follow in collection order.
LONGEST_FIRST = ("layouts_w2_text",  # (330) the text families' layouts on two ranks, five of them compiled
                 "tests/test_compile.py",  # (220)
                 "tests/test_recipes.py",  # (210)
                 "layouts_w2_dit", "layouts_w4_dit",  # (220, 180)
                 "tests/test_soak.py", "tests/test_reliability.py", "tests/test_plan_memory.py",  # (135, 125, 115)
                 "tests/test_flat_adam.py", "tests/test_training.py", "tests/test_generate.py",  # (100, 70, 65)
                 "layouts_w4_text", "tests/test_generate_quality.py")  # (70, 50)


def pytest_configure(config):
    """Keep the order below: xdist (3.x) otherwise queues the groups by their number of tests, most first, so a
    long group of one test (the soak) started last and ran alone at the end (a fresh-clone run: 83 s of one idle
    worker)."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_finish(session):
    """What collection imported lives as long as the process: frozen, the collector's passes skip it (each full
    pass rescanned ~0.5M objects of torch, megatron-core and the project; as the launchers do, dit_mcore/startup.py)."""
    gc.freeze()


@pytest.hookimpl(tryfirst=True)  # (before xdist's own hook reads the groups)
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (``--dist loadgroup``: ``bash tests/run_tests.sh`` runs two workers), a module's tests
    stay on one worker, so its module-scoped fixtures (a multi-process world, a trained run) run once. A test that
    names its own ``xdist_group`` (the layout suite's spawns: world 2 and 4, DiT and text families) keeps it."""
    def group(item):
        mark = item.get_closest_marker("xdist_group")
        return mark.args[0] if mark else item.nodeid.split("::", 1)[0]
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(group(item)))
    if hasattr(config, "workerinput"):  # an xdist worker: the controller schedules in its workers' order
        rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
        items.sort(key=lambda item: rank.get(group(item), len(rank)))  # (stable: the rest keep their order)
