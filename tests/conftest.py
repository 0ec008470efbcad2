"""Fixtures several test files share (each is module-scoped: every test module gets its own, as when it defined
them itself). A test module may still define a fixture of the same name for a different model or cluster; its own
definition wins there."""

import os
import pathlib

import pytest

import autopar_lab as al

# XLA's compiles are most of the suite's time on CPU, and many tests (and the CLI processes, Ray actors and notebook
# kernels they start, which inherit this environment) compile the same programs: the same small GPT's one-device
# reference step, the same plan's stage programs. JAX's persistent compilation cache keeps each executable on disk
# under its HLO, compile options and devices, so a repeat loads the same executable instead of compiling it again:
# identical programs, identical numbers. Every compile is kept (no minimum compile time). A test that counts compiles
# counts the cache's hits too (tests/test_update_sharding.py). Set JAX_COMPILATION_CACHE_DIR to use another folder;
# `make clean` removes this one.
CACHE_DIR = pathlib.Path(__file__).resolve().parent.parent / ".jax-cache"
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(CACHE_DIR))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

# `make test` runs the suite on pytest-xdist workers with `--dist loadgroup`. Each test file is one group, so it runs
# whole on one worker and its module-scoped fixtures are built once. The files that start a Ray head or a JupyterLab
# server share one group, so only one of them runs at a time: two Ray clusters (each a handful of processes) or a
# browser beside a cluster would starve a 2-core machine and make their start-up timeouts flaky.
SERIAL_GROUP = "ray-and-servers"
SERIAL_FILES = frozenset({
    "test_browser", "test_browser_ray", "test_execute_schedules", "test_hostile", "test_launch", "test_launch_remote",
    "test_ray_lifecycle", "test_readme", "test_training_panel",
})

# `make test-fast` leaves these out (`-m "not slow and not notebook and not browser"`): a notebook or a browser test
# starts a kernel or Chromium, seconds before its first assertion, whatever it checks.
NOTEBOOK_FILES = frozenset({"test_notebooks"})
BROWSER_FILES = frozenset({"test_browser", "test_browser_ray"})


def pytest_configure(config):
    import jax  # already imported by a plugin or autopar_lab: the environment above came too late for its config

    jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs",
                      float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))
    # Registered here too, so a run without xdist (`make test XDIST=`) does not warn about an unknown mark.
    config.addinivalue_line("markers", "xdist_group(name): pytest-xdist runs a group's tests on one worker")
    config.addinivalue_line("markers", "notebook: runs a notebook end to end")
    config.addinivalue_line("markers", "browser: drives a real browser")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Puts every test in its file's xdist group (see SERIAL_FILES; without xdist those marks do nothing), and marks
    the notebook and browser files' tests (see NOTEBOOK_FILES, BROWSER_FILES)."""
    for item in items:
        stem = item.path.stem
        item.add_marker(pytest.mark.xdist_group(SERIAL_GROUP if stem in SERIAL_FILES else stem))
        if stem in NOTEBOOK_FILES:
            item.add_marker(pytest.mark.notebook)
        if stem in BROWSER_FILES:
            item.add_marker(pytest.mark.browser)


@pytest.fixture(scope="module")
def model():
    """gpt-tiny in float32 with a batch of 8: two layers (four with embedding and head), plans in seconds."""
    return al.models.get("gpt-tiny", dtype="float32", batch_size=8)


@pytest.fixture(scope="module")
def graph():
    """The same gpt-tiny, traced."""
    return al.models.get("gpt-tiny", batch_size=8, num_layers=2, dtype="float32").trace()


@pytest.fixture(scope="module")
def cluster():
    """One host of four devices."""
    return al.Cluster.preset("p3.16xlarge", hosts=1).with_(devices_per_host=4)


@pytest.fixture(scope="module")
def small_cluster():
    """Two hosts of two devices: every submesh shape (1x1, 1x2, 2x2) and both links appear, and the ILPs stay small."""
    return al.Cluster.preset("p3.16xlarge", hosts=2).with_(devices_per_host=2)


@pytest.fixture(scope="module")
def plan(graph, cluster):
    """Two stages of two layers each on 1x2 submeshes: every stage action has room to act."""
    return al.megatron_plan(graph, cluster, dp=1, tp=2, pp=2, microbatches=2)


@pytest.fixture(scope="module")
def small_plan(graph):
    """Two devices: few logical meshes, so solves and the exhaustive optimum run in seconds."""
    c2 = al.Cluster.preset("p3.16xlarge", hosts=1).with_(devices_per_host=2)
    return al.megatron_plan(graph, c2, dp=1, tp=2, pp=1, sharding="ilp")  # the ILP's own choices


@pytest.fixture(scope="module")
def reference(model):
    """The module's ``model`` trained 3 steps by its own step_fn, jitted on one device (XLA's CPU optimisation off,
    as the pipelines it is compared with), on the runner's default batches: ``(losses, params)``."""
    import jax

    dev = jax.devices()[0]
    step = jax.jit(model.step_fn, compiler_options={"xla_backend_optimization_level": 0})
    params, opt_state, _ = jax.device_put(model.init(0), dev)
    losses = []
    for i in range(3):
        params, opt_state, loss = step(params, opt_state, jax.device_put(model.init(i)[2], dev))
        losses.append(float(loss))
    return losses, params


class _RunAtOnce:
    """A stage worker behind Ray's call syntax, run at once in this process (``.remote`` returns the value): the
    actors' contract without Ray."""

    def __init__(self, worker):
        self.worker = worker

    def __getattr__(self, name):
        fn = getattr(self.worker, name)
        return type("M", (), {"remote": staticmethod(lambda *a: fn(*a))})


@pytest.fixture
def run_at_once():
    """Wraps a stage worker so that ``worker.method.remote(...)`` runs it now (see :class:`_RunAtOnce`)."""
    return _RunAtOnce
