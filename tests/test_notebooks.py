"""Every notebook runs top to bottom, headless, and checks at least one prediction exercise."""

import ast
import json
import math
import os
import pathlib
import pkgutil
import re
import time

import nbformat
import pytest
from nbclient import NotebookClient

import autopar_lab as al

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))
# What an exercise's answer check prints (autopar_lab.widgets.exercise.check_answer).
VERDICT = re.compile(r"(✔ Right|✘ Not yet): you predicted")
# Notebooks without a predict-try-check exercise (none now: every notebook has one).
WITHOUT_EXERCISE: set[str] = set()


def _output_text(nb) -> str:
    """Printed text and the plain-text form of every displayed value, over all code cells."""
    parts = []
    for c in nb.cells:
        for o in c.get("outputs", []) if c.cell_type == "code" else []:
            parts.append(o.get("text", "") + o.get("data", {}).get("text/plain", ""))
    return "\n".join(parts)


# A last cell, run only in the test: the kernel's CPU seconds (its own and its reaped children's), for the record.
CPU_CELL = ("import resource as _r\n_s, _c = _r.getrusage(_r.RUSAGE_SELF), _r.getrusage(_r.RUSAGE_CHILDREN)\n"
            "print('kernel cpu s', _s.ru_utime + _s.ru_stime + _c.ru_utime + _c.ru_stime)")
#: Where test_notebook_runs appends each notebook's run time as a JSON line (bench/bench_notebooks.py sets it).
TIMES_ENV = "AUTOPAR_NOTEBOOK_TIMES"


def _record_time(path, nb, wall_s: float, load: tuple[float, float], record_property) -> None:
    """Issue 34 asks each notebook to run in under a minute: a figure to record (bench/RESULTS.md's notebook-times
    table), not a timed assertion (a shared machine's load decides the wall time)."""
    text = "".join(o.get("text", "") for o in nb.cells[-1].get("outputs", []))
    cpu = re.search(r"kernel cpu s ([\d.]+)", text)
    row = {"notebook": path.stem, "wall_s": round(wall_s, 1), "kernel_cpu_s": cpu and round(float(cpu.group(1)), 1),
           "load": [round(x, 1) for x in load]}
    record_property("notebook_time", row)
    if os.environ.get(TIMES_ENV):
        with open(os.environ[TIMES_ENV], "a") as f:
            f.write(json.dumps(row) + "\n")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, tmp_path, record_property):
    nb = nbformat.read(path, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(CPU_CELL))
    load, start = os.getloadavg()[0], time.perf_counter()
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    _record_time(path, nb, time.perf_counter() - start, (load, os.getloadavg()[0]), record_property)
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
    text = _output_text(nb)
    # The tour's Megatron check prints a ratio of 1.0000.
    if path.stem == "01_tour":
        assert "ratio 1.0000" in text
    # Run headless, each exercise checks the notebook's stored default prediction and prints the verdict.
    if path.stem not in WITHOUT_EXERCISE:
        assert VERDICT.search(text), "no exercise printed an answer check"


@pytest.mark.parametrize("path", [p for p in NOTEBOOKS if p.stem not in WITHOUT_EXERCISE],
                         ids=[p.stem for p in NOTEBOOKS if p.stem not in WITHOUT_EXERCISE])
def test_notebook_has_a_prediction_exercise(path):
    """A question with a prediction box (an Exercise with a stored default) and an answer check with a hint."""
    source = "\n".join(c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code")
    assert re.search(r"Exercise\(.*default=my_prediction", source, re.S)
    assert "hint=" in source and re.search(r"\.check\(", source)


def _imports_and_names(source: str) -> tuple[list[str], set[str]]:
    """What a notebook's code imports (``"from M"`` for ``from M import ...``, ``"M"`` for ``import M``), and the
    names it reads off the package (``al.NAME``)."""
    tree = ast.parse("\n".join(ln for ln in source.splitlines() if not ln.lstrip().startswith(("%", "!"))))
    modules, names = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            modules.append("from " + "." * node.level + (node.module or ""))
        elif isinstance(node, ast.Import):
            modules += [alias.name for alias in node.names]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "al":
            names.add(node.attr)
    return modules, names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_uses_only_the_public_api(path):
    """Issue 34: a learner's code imports `autopar_lab as al` and nothing under it (a module's inside may change;
    the package's names are the contract, ../shared/DESIGN.md), and every `al.NAME` it reads is one of them."""
    modules, names = _imports_and_names(_code(path.stem))
    inside = [m for m in modules if m.startswith(("autopar_lab.", "from autopar_lab", "from ."))]
    assert not inside, f"{path.stem} imports {inside}: use the package's public names (al.NAME)"
    names = {n for n in names if not n.startswith("__")}                  # a module's own: al.__file__
    assert names <= set(al.__all__), f"{path.stem} reads {sorted(names - set(al.__all__))} that al does not export"


def test_a_notebook_importing_an_inside_module_is_caught():
    code = "import autopar_lab as al\nfrom autopar_lab import planner\nal.models.get('x')\n%time 1"
    assert _imports_and_names(code) == (["autopar_lab", "from autopar_lab"], {"models"})


def test_no_exported_function_or_class_is_named_like_a_module_of_the_package():
    """Python sets a package's attribute to a submodule when the submodule is first imported, so a lazily exported
    function named like a module (`al.simulate` beside autopar_lab/simulate.py) would turn into that module once
    anything imported it: the notebooks' `al.simulate_pipeline` is named apart for this. Only namespaces (`models`,
    `validate`: the module itself) may share a module's name."""
    modules = {m.name for m in pkgutil.iter_modules(al.__path__)}
    clashes = [name for name, (_, attr) in al._LAZY.items() if name in modules and attr is not None]
    assert not clashes
    assert {"models", "validate"} <= modules and all(al._LAZY[n][1] is None for n in ("models", "validate"))


def test_there_is_a_tour():
    assert any(p.stem == "01_tour" for p in NOTEBOOKS)


def test_every_teaching_notebook_is_there():
    expected = {"01_tour", "02_concepts", "03_alpa_walkthrough", "04_overrides", "05_bring_your_own_model",
                "06_open_questions", "07_rooflines_mfu", "08_modern_schedules_and_hardware", "09_memory_anatomy",
                "10_capstone_llama3_70b"}
    assert expected <= {p.stem for p in NOTEBOOKS}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_stored_clean(path):
    """Notebooks are stored without outputs (the tests execute them): small diffs, no stale figures."""
    nb = nbformat.read(path, as_version=4)
    assert not [c for c in nb.cells if c.cell_type == "code" and (c.get("outputs") or c.get("execution_count"))]


def test_capstone_checks_a_prediction_at_each_design_step():
    """Issue 34 item 3: every step of the Llama 3 70B design (parameters, ZeRO-1 bytes, fits, microbatches, bubble,
    step time) asks a prediction and checks it against the library; the planner and the published figures are
    asserted, not just printed."""
    nb = nbformat.read(NOTEBOOKS[0].parent / "10_capstone_llama3_70b.ipynb", as_version=4)
    source = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    asks = re.findall(r"^(ask_\w+) = al\.Exercise\(", source, re.M)
    assert len(asks) >= 6
    assert all(f"{ask}.check(" in source for ask in asks)
    for call in ("al.megatron_plan(table=table", "al.fsdp_plan(table=table", "al.auto_plan(table=table",
                 "memory_breakdown(", "published_mfu"):
        assert call in source, call


def _stems_in(text: str) -> list[str]:
    return re.findall(r"`(\d\d_\w+)`", text)


def test_reading_order_is_in_the_readme_and_at_the_top_of_every_notebook():
    """Issue 34 item 6: one reading order (fundamentals ... capstone), in the README and repeated in each notebook's
    first cell with the notebook's own place marked."""
    readme = (NOTEBOOKS[0].parent.parent / "README.md").read_text()
    course = readme.split("## The course", 1)[1].split("\n## ", 1)[0]
    order = _stems_in(course)
    assert sorted(order) == sorted(p.stem for p in NOTEBOOKS)          # every notebook, once
    assert order[0] == "02_concepts" and order[-1] == "10_capstone_llama3_70b"
    for path in NOTEBOOKS:
        first = nbformat.read(path, as_version=4).cells[0].source
        line = next(ln for ln in first.splitlines() if ln.startswith("*Reading order, step "))
        assert _stems_in(line) == order, path.stem
        assert f"**`{path.stem}`**" in line


def _code(stem: str) -> str:
    nb = nbformat.read(NOTEBOOKS[0].parent / f"{stem}.ipynb", as_version=4)
    return "\n".join(c.source for c in nb.cells if c.cell_type == "code")


def _text(stem: str) -> str:
    nb = nbformat.read(NOTEBOOKS[0].parent / f"{stem}.ipynb", as_version=4)
    return "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")


def test_modern_notebook_prices_zero_and_the_global_batch():
    """Issue 34 item 4: 08's grid prices ZeRO-1 and FSDP data parallelism with the library's planners, the global
    batch's two-step exercise is checked, and the planner is asked whether tensor parallelism pays on 16 and 64
    GPUs; the old reason ('pays when a layer does not fit') is no longer the one given."""
    source, text = _code("08_modern_schedules_and_hardware"), _text("08_modern_schedules_and_hardware")
    for call in ("al.megatron_plan(table=table, dp=16 // tp, tp=tp, pp=1, zero=1",
                 "al.fsdp_plan(table=table, tp=tp", "al.fsdp_plan(table=table8, tp=8)", "ask_batch.check(",
                 "memory_breakdown(plan)"):
        assert call in source, call
    assert "global batch" in text and "tensor parallelism pays when a layer does not fit" not in text.lower()


def test_running_examples_are_todays_hardware():
    """Issue 34 item 5: 02 runs on DGX H100s and 07 prices its MFU section there in bf16, with the H200 and B200
    presets beside; 03 keeps Alpa's V100 testbed and says why; 01's and 04's small models are bf16; 09's memory
    anatomy is Llama 3 8B in bf16 on DGX H100s, no GPT in its running example; 07 names the A100 only for
    Megatron-LM's published runs."""
    assert 'Cluster.preset("dgx-h100", hosts=2)' in _code("02_concepts")
    assert "p3.16xlarge" not in _code("02_concepts")
    seven = _code("07_rooflines_mfu")
    assert all(f'"dgx-{gpu}"' in seven for gpu in ("h100", "h200", "b200")) and 'peak("bfloat16")' in seven
    assert "On Alpa's testbed, on purpose" in _text("03_alpa_walkthrough")
    # the workbench notebooks' small models: traced in bfloat16 and planned in the bf16 recipe, every model they plan
    for stem in ("01_tour", "04_overrides"):
        code = _code(stem)
        gets = re.findall(r'al\.models\.get\("(?:gpt-tiny|mlp)"[^)]*\)', code)
        plans = re.findall(r"al\.(?:compare|auto_plan|megatron_plan)\((?:[^()]|\([^()]*\))*\)", code)
        assert gets and all('dtype="bfloat16"' in g for g in gets), stem
        assert plans and all('precision="bf16"' in p for p in plans), stem
    # 09: every model traced in bfloat16, every table and plan priced in bf16, on DGX H100 hosts
    nine = _code("09_memory_anatomy")
    gets = re.findall(r"al\.models\.get\((?:[^()]|\([^()]*\))*\)", nine)
    plans = re.findall(r"al\.(?:CostTable\.build|data_parallel_plan|megatron_plan)\((?:[^()]|\([^()]*\))*\)", nine)
    assert gets and all('dtype="bfloat16"' in g for g in gets)
    assert len(plans) >= 5 and all('precision="bf16"' in p for p in plans)
    assert 'al.Cluster.preset("dgx-h100"' in nine and "a100" not in nine.lower()
    assert 'MODEL = "llama3-8b"' in nine and "gpt-" not in nine.lower()
    # 07: the A100 only where it is Megatron-LM's published 2021 runs (Narayanan et al., SC21): every paragraph and
    # code cell that names it cites them
    nb7 = nbformat.read(NOTEBOOKS[0].parent / "07_rooflines_mfu.ipynb", as_version=4)
    blocks = [b for cell in nb7.cells for b in (cell.source.split("\n\n") if cell.cell_type == "markdown"
                                                 else [cell.source])]
    a100 = [b for b in blocks if "a100" in b.lower()]
    assert a100 and all("SC21" in b for b in a100), [b[:80] for b in a100 if "SC21" not in b]


def _run_until(stem: str, heading: str) -> dict:
    """The namespace of `stem`'s code cells run in this process, up to the markdown cell with a line that starts with
    `heading`: the notebook's own numbers, for a test to check against hand formulas."""
    nb = nbformat.read(NOTEBOOKS[0].parent / f"{stem}.ipynb", as_version=4)
    ns: dict = {}
    for cell in nb.cells:
        if cell.cell_type == "markdown" and re.search(f"^{re.escape(heading)}", cell.source, re.M):
            return ns
        if cell.cell_type == "code":
            exec(compile(cell.source, f"{stem}.ipynb", "exec"), ns)
    raise AssertionError(f"{stem} has no cell starting {heading!r}")


def _ring_all_reduce(nbytes: float, n: int, link) -> tuple[float, float]:
    """A ring all-reduce of nbytes over n devices by hand (Patarasuk and Yuan 2009): 2 (n-1)/n nbytes at the bus
    bandwidth, plus at most 2 (n-1) steps' latency (the library may take a tree's smaller latency)."""
    wire = 2 * (n - 1) / n * nbytes / link.bandwidth
    return wire, wire + 2 * (n - 1) * link.latency


def test_rooflines_sections_1_to_3_are_llama3_on_h100_in_bf16_and_match_hand_formulas():
    """Issue 34 item 5: 07's sections 1-3 run one Llama 3 8B layer (sequence 4,096) in bf16 on DGX H100s, the V100
    beside it in float16, and every number they state matches a formula counted here by hand: the ridge points from
    the data sheets, the layer's parameters and gradient bytes, the backward's time per sequence from its matmul
    FLOPs, data parallelism's crossover from a ring all-reduce, and Megatron's formula T(1)/t + 4 all-reduces."""
    ns = _run_until("07_rooflines_mfu", "## 4.")
    cfg, seq = ns["cfg"], ns["seq"]
    # Llama 3 8B as released (Grattafiori et al. 2024, Table 3; the HF config), Llama 3's first pre-training length.
    assert (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.ffn_hidden, cfg.vocab_size) == \
        (4096, 32, 8, 14336, 128256) and seq == 4096 and cfg.dtype == "bfloat16"
    assert ns["DTYPE"] == {"V100": "float16", "H100": "bfloat16"}
    # Section 1: ridge points from the data sheets (H100 SXM: 989.4 TFLOP/s dense bf16, 3.35 TB/s; V100 SXM2: 125
    # TFLOP/s float16 tensor cores, 900 GB/s).
    assert math.isclose(ns["ridge"]["H100"], 989.4e12 / 3.35e12, rel_tol=1e-3)
    assert math.isclose(ns["ridge"]["V100"], 125e12 / 900e9, rel_tol=1e-3)
    assert ns["share"]["H100"] > ns["share"]["V100"] and ns["alone_total"]["V100"] > 2 * ns["fused_total"]["V100"]
    # The layer's parameters: Q, K, V (GQA: 8 KV heads of 128), the output projection, SwiGLU's three, two norms.
    H, heads, kv, F, V = 4096, 32, 8, 14336, 128256
    hd = H // heads
    P = H * (heads + 2 * kv) * hd + heads * hd * H + 3 * H * F + 2 * H
    assert ns["params"] == P == 218_112_000 and ns["grad_bytes"] == 2 * P and ns["embedding"] == V * H
    # Section 2: the backward per sequence from its matmuls at the rate the preset fits (two matmuls a weight: 4 P
    # FLOPs a token; flash attention's backward: twice the causal half of the 4 heads S^2 hd forward, at the
    # preset's attention rate). The library's backward also runs the norms' and SwiGLU's elementwise kernels.
    h100 = ns["GPUS"]["H100"]
    d = h100.device
    C = d.peak("bfloat16") * d.efficiency.matmul
    hand_slope = 4 * P * seq / C + 2 * (4 * heads * seq**2 * hd / 2) / (d.peak("bfloat16") * d.efficiency.attention)
    slope, intercept = ns["lines"]["H100"]
    assert 1.0 < slope / hand_slope < 1.25
    for label, sub, shape in ns["MESHES"]:
        mesh = h100.logical_mesh(sub, shape)
        n, link = mesh.axis_size(0), mesh.axis_link(0)
        lo, hi = _ring_all_reduce(2 * P, n, link)
        assert lo < mesh.all_reduce(2 * P, 0) <= hi + 1e-12
        assert math.isclose(ns["rule"]["H100", label], (n - 1) / n * C / link.bandwidth, rel_tol=1e-9)
        # the crossover: the all-reduce over the backward per token, the hand slope a little fast (see above)
        hand = lo / hand_slope * seq
        assert 0.75 < ns["crossover"]["H100", label] / hand < 1.0
        assert 0.75 < ns["fp32"][label] / (2 * hand) < 1.0
    assert seq / 4 < ns["crossover"]["H100", "8 GPUs in a host"] < seq
    # Section 3: Megatron's formula, its four all-reduces of one sequence's bf16 activations by hand.
    assert ns["act_bytes"] == seq * H * 2
    T1 = ns["layer_s"]["H100", 1]
    assert 1.0 < T1 / (6 * P * seq / C) < 1.6    # forward and backward matmuls; attention and the rest on top
    for t, sub in ((2, (1, 2)), (4, (1, 4)), (8, (1, 8)), (16, (2, 8))):
        mesh = h100.logical_mesh(sub, (1, t))
        lo, hi = _ring_all_reduce(seq * H * 2, t, mesh.axis_link(1))
        assert 4 * lo <= ns["formula_s"]["H100", t] - T1 / t <= 4 * hi + 1e-12
    assert ns["worth"] == {"V100": 8, "H100": 8}
    assert ns["formula_s"]["H100", 16] < ns["formula_s"]["H100", 8] < ns["layer_s"]["H100", 16]


def test_grid_sharded_rows_store_the_hand_counted_bytes_a_parameter():
    """Issue 34 item 4: 08's ZeRO-1 and FSDP columns for the tensor-parallel rows of the GPT-6.7B grid (2 x 8 H100s,
    dp = 16 / tp) store, per GPU and part, what a hand count of mixed precision with Adam gives: 2 bytes a parameter
    of float16 weights, 2 of gradients, 4 of float32 master weights and 8 of moments; ZeRO-1 splits the first two by
    tp and the last two by tp x dp = 16, FSDP all four 16 ways."""
    from autopar_lab.memory import memory_breakdown

    gpt67 = al.models.get("gpt-6.7b", batch_size=64)
    table = al.CostTable.build(gpt67, al.Cluster.preset("dgx-h100", hosts=2))
    N = gpt67.param_count
    for tp in (2, 4, 8):
        for plan, split in ((al.megatron_plan(table=table, dp=16 // tp, tp=tp, pp=1, zero=1), (tp, tp, 16, 16)),
                            (al.fsdp_plan(table=table, tp=tp), (16, 16, 16, 16))):
            part = memory_breakdown(plan)[0]
            for key, nbytes, ways in zip(("params_bytes", "grads_bytes", "master_bytes", "optimizer_bytes"),
                                         (2, 2, 4, 8), split):
                # the norms, biases and position embedding tensor parallelism keeps whole: well under 1%
                assert math.isclose(part[key] / N, nbytes / ways, rel_tol=0.01), (plan.method, key)
            assert plan.cost.fits


def test_alpa_walkthrough_examples_in_bf16_on_h100_stay_replicated_as_a_hand_count_says():
    """Issue 34 item 5: 03 keeps Alpa's V100 and float32 examples and shows them in bf16 on 4 H100s, where the ILP
    keeps both matmuls replicated. By hand: the forward's two matmuls at the preset's matmul rate, a batch split
    that still reads both weights whole on every GPU, and the 4-GPU all-reduce of the loss at NVLink's latency; the
    split saves less than that all-reduce costs until the batch doubles to 1,024 rows."""
    ns = _run_until("03_alpa_walkthrough", "## 3.")
    h100 = al.Cluster.preset("dgx-h100", hosts=1)
    d, link = h100.device, h100.logical_mesh((1, 4), (4, 1)).axis_link(0)

    def matmuls_s(rows):                           # x W1 and h W2: 2 x (2 rows 1024 4096) FLOPs
        return 2 * 2 * rows * 1024 * 4096 / (d.peak("bfloat16") * d.efficiency.matmul)

    weights_s = 2 * 1024 * 4096 * 2 / (d.memory_bandwidth * d.efficiency.memory)   # W1 and W2 in bf16, read whole
    whole_s, split_s, allreduce_s = ns["split"]["H100, bf16"]
    assert 1.0 < whole_s / matmuls_s(512) < 1.15                 # the tanh, square and mean on top
    assert weights_s < split_s < matmuls_s(512)                  # every GPU reads W1 and W2 whole
    assert 2 * link.latency <= allreduce_s <= 2 * 3 * link.latency + 1e-7    # a scalar: latency only
    # the split's saving against the all-reduce, by hand: replicated at 512 rows, split at 1,024
    assert matmuls_s(512) - max(matmuls_s(512) / 4, weights_s) < allreduce_s
    assert matmuls_s(1024) - max(matmuls_s(1024) / 4, weights_s) > allreduce_s
    assert ns["on"]["H100 bf16", 512] == ns["on"]["H100 bf16", 8] == ["replicated"] * 2
    assert ns["rows_"] == 1024 and ns["on"]["H100 bf16", 1024] == ["data"] * 2
