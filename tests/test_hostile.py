"""Hostile and careless input (issue 19): each case once failed late, read what it should not, or ran code.

Plan files are untrusted (a colleague's file, a file from the internet): they never make the loader read another
path, never block or exhaust memory, and no string in them can become code in ``to_jax_code``. Bad values are refused
where they enter, with one sentence that names the field; the CLI exits 2 with that sentence, never a traceback.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading

import pytest

import autopar_lab as al
from autopar_lab.cli import main


@pytest.fixture(scope="module")
def model():
    return al.models.get("gpt-tiny", batch_size=8, num_layers=2)


@pytest.fixture(scope="module")
def cluster():
    return al.Cluster.preset("p3.16xlarge").with_(devices_per_host=4)


@pytest.fixture(scope="module")
def plan(model, cluster):
    return al.megatron_plan(model, cluster, dp=1, tp=2, pp=2, microbatches=2)


@pytest.fixture()
def saved(plan, tmp_path):
    path = tmp_path / "plan.json"
    al.save_plan(plan, path)
    return path, json.loads(path.read_text())


def refused(path, plan, data=None, *, cluster=None):
    """The ValueError load_plan raises for ``data`` written to ``path`` (or ``path`` as it is)."""
    if data is not None:
        path.write_text(json.dumps(data))
    with pytest.raises(ValueError) as e:
        al.load_plan(path, plan.graph, cluster)
    msg = str(e.value)
    assert "\n" not in msg and "Traceback" not in msg
    return msg


def within(seconds, fn):
    """``fn()``'s result, or a test failure if it does not return within ``seconds`` (a blocking read)."""
    out = {}
    t = threading.Thread(target=lambda: out.update(r=_call(fn)), daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still running after {seconds} s"
    if isinstance(out["r"], BaseException):
        raise out["r"]
    return out["r"]


def _call(fn):
    try:
        return fn()
    except BaseException as e:  # noqa: BLE001 - handed back to the test's thread
        return e


# ------------------------------------------------------------------------------------------- plan files: security

INJECTION = "auto\nimport os; os.system('touch PWNED')\n#"


def test_a_method_that_would_leave_its_comment_is_refused_on_load(saved, plan):
    path, data = saved
    data["method"] = INJECTION
    assert "line break" in refused(path, plan, data)


def test_exported_code_keeps_any_method_inside_its_comment(plan, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for method in (INJECTION, "x\rimport os; os.system('touch PWNED')", "a\x0cb\u2028import os\x85c", "#'\"\"\"\\"):
        hostile = dataclasses.replace(plan, method=method)
        code = hostile.to_jax_code()
        header = code.splitlines()[0]
        assert header.startswith("# autopar-lab plan: ") and method.split("\n")[0][:1] in header  # escaped, in it
        assert all(not ln.startswith("import os") for ln in code.splitlines())
        scope: dict = {}
        exec(compile(code, "exported", "exec"), scope)  # needs no devices beyond the first stage's 2
        assert not (tmp_path / "PWNED").exists()


def test_a_cluster_in_a_plan_file_is_data_never_a_path(saved, plan, tmp_path):
    path, data = saved
    fifo = tmp_path / "cluster.fifo"
    os.mkfifo(fifo)
    for where in ("/dev/zero", str(fifo), "cpu:1"):
        data["cluster"] = where
        msg = within(20, lambda: refused(path, plan, data))
        assert "must be a JSON object" in msg and "never names a cluster file" in msg


def test_plan_paths_that_are_not_regular_files_are_refused_at_once(plan, tmp_path):
    link = tmp_path / "zero.json"
    link.symlink_to("/dev/zero")
    assert "not a regular file" in within(20, lambda: refused(link, plan))
    fifo = tmp_path / "plan.fifo"
    os.mkfifo(fifo)
    assert "not a regular file" in within(20, lambda: refused(fifo, plan))  # no writer: a plain open would block
    assert "is a directory" in refused(tmp_path, plan)
    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate(65 * 2**20)  # sparse: costs no disk
    assert "more than the" in refused(big, plan)


def test_binary_and_deeply_nested_plan_files_name_their_path(plan, tmp_path):
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")
    msg = refused(binary, plan)
    assert "binary.json" in msg and "not text" in msg
    nested = tmp_path / "nested.json"
    nested.write_text("[" * 100_000 + "]" * 100_000)
    msg = refused(nested, plan)
    assert "nested.json" in msg and "nests deeper" in msg
    inf = tmp_path / "inf.json"
    inf.write_text('{"version": 2, "microbatches": 1e400}')
    assert "finite" in refused(inf, plan)


# ------------------------------------------------------------------------------------------- plan files: values

@pytest.mark.parametrize("edit, needle", [
    (lambda d: d["stages"][0].update(remat="false"), "remat must be true or false"),
    (lambda d: d.update(mem_limit_bytes=1), "mem_limit_bytes"),
    (lambda d: d.update(microbatches=0), "microbatches must be between 1"),
    (lambda d: d.update(microbatches=3), "does not divide the batch size 8"),
    (lambda d: d.update(microbatches=True), "microbatches must be a whole number"),
    (lambda d: d["pins"].update({"99999": {"strategy": "RR", "scope": "shared"}}), "operator 99999"),
    (lambda d: d["pins"].update({"007": {"strategy": "RR", "scope": "shared"}}), "not an operator id"),
    (lambda d: d["pins"].update({"3": {"strategy": "NOPE", "scope": "shared"}}), "pins[3] is 'NOPE'"),
    (lambda d: d["pins"].update({"3": "NOPE"}), "pins[3] must be an object with a strategy and a scope"),
    (lambda d: d["pins"].update({"3": {"strategy": "NOPE", "scope": "all"}}), "scope must be 'shared' or 'layer'"),
    (lambda d: d.update(stage_pins={"boundaries": [7]}), "names layer 7"),
    (lambda d: d.update(stage_pins={"remat": [True]}), "one entry per stage (2)"),
    (lambda d: [st.update(submesh=[1, 4], logical_mesh=[2, 2], devices=[0, 1, 2, 3]) for st in d["stages"]],
     "do not tile"),
    (lambda d: d["stages"][0].update(submesh=[1, 3]), "not a submesh shape"),
    (lambda d: d["stages"][0].update(logical_mesh=[2, 2]), "logical mesh [2, 2] is not a view"),
    (lambda d: d.update(schedule="NOPE"), "schedule must be"),
    (lambda d: d.update(layer_names=["embed", 5, "head"]), "layer_names[1] must be a string"),
    (lambda d: d["choices"].update({"0": "NOPE"}), "'NOPE'"),
    (lambda d: d.update(version=True), "version"),
])
def test_wrong_values_are_refused_on_load_naming_the_field(saved, plan, edit, needle):
    path, data = saved
    edit(data)
    msg = refused(path, plan, data)
    assert needle in msg and "plan file" in msg


def test_nan_memory_limit_is_refused(saved, plan):
    path, data = saved
    path.write_text(json.dumps(data).replace('"mem_limit_bytes": ', '"mem_limit_bytes": NaN, "x": '))
    assert "finite" in refused(path, plan)


def test_a_plan_with_pins_round_trips_and_loads_with_its_own_cluster(plan, tmp_path):
    op = next(o for o in plan.graph.ops if plan.graph.op(o).primitive == "dot_general")
    pinned = plan.with_choice(op, plan.alternatives(op)[-1].strategy)
    path = tmp_path / "pinned.json"
    al.save_plan(pinned, path)
    back = al.load_plan(path, plan.graph)  # no cluster given: the one the file describes
    assert back.pins == pinned.pins and back.cost.step_time_s == pinned.cost.step_time_s
    assert [p.name for p in tmp_path.iterdir()] == ["pinned.json"]  # the atomic write left no temporary file


# ------------------------------------------------------------------------------------------- API entry points

def test_api_values_are_checked_where_they_enter(model, cluster, plan):
    with pytest.raises(ValueError, match="stage must be a stage index 0..1 .* got -1"):
        plan.with_remat(-1)
    with pytest.raises(ValueError, match="got the string '113'; pass 113"):
        plan.with_choice("113", "S0R")
    with pytest.raises(ValueError, match="dp must be a whole number, got True"):
        al.megatron_plan(model, cluster, dp=True, tp=2, pp=2)
    with pytest.raises(ValueError, match="remat must be True or False, got 'false'"):
        al.data_parallel_plan(model, cluster, remat="false")
    with pytest.raises(ValueError, match="stage must be a stage index .* got '0'"):
        plan.to_jax_code(stage="0")
    with pytest.raises(ValueError, match=r"al.execute takes a Plan, got the path 'plan.json'; load it first"):
        al.execute("plan.json", model)
    with pytest.raises(ValueError, match="al.launch takes a Plan"):
        al.launch(None, model, 2)
    with pytest.raises(ValueError, match="load_plan takes the path"):
        al.load_plan(b"plan.json", plan.graph)
    with pytest.raises(ValueError, match="cannot be trained"):
        al.models.get("gpt-tiny", dtype="int8")
    with pytest.raises(ValueError, match="num_layers must be between 1 and 1,024"):
        al.models.get("gpt-tiny", num_layers=100_000)
    with pytest.raises(ValueError, match="hosts is 1000000000, more than the 4096"):
        al.Cluster.preset("dgx-a100", hosts=1_000_000_000)
    big = dict(cluster.to_dict(), devices_per_host=1099511627776)
    with pytest.raises(ValueError, match="devices_per_host is 1099511627776, more than"):
        al.Cluster.from_json(big)


# ------------------------------------------------------------------------------------------- CLI: one sentence

def one_sentence(capsys, argv, *needles):
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def test_cli_refuses_sizes_that_would_hang_or_overflow(capsys, tmp_path):
    one_sentence(capsys, ["graph", "gpt-tiny", "--layers", "100000"], "num_layers", "1,024")
    one_sentence(capsys, ["graph", "gpt-tiny", "--batch", "99999999999999999999"], "batch_size")
    one_sentence(capsys, ["graph", "gpt-tiny", "--dtype", "int8"], "int8", "float32")
    one_sentence(capsys, ["plan", "gpt-tiny", "--cluster", "dgx-a100:1000000000"], "hosts", "4096")
    one_sentence(capsys, ["validate", "mlp", "--devices", "1024"], "--devices", "64")
    cfile = tmp_path / "c.json"
    cfile.write_text('{"hosts": 1, "devices_per_host": 8, "device": {"peak_flops": {"float32": 1e400}}}')
    one_sentence(capsys, ["plan", "gpt-tiny", "--cluster", str(cfile)], "finite", "c.json")
    cfile.write_text(json.dumps(dict(al.Cluster.preset("dgx-a100").to_dict(), devices_per_host=1099511627776)))
    one_sentence(capsys, ["plan", "gpt-tiny", "--cluster", str(cfile)], "devices_per_host")
    one_sentence(capsys, ["plan", "gpt-tiny", "--cluster", "/dev/zero"], "not a regular file")


def test_cli_checks_out_and_method_arguments_before_planning(capsys, tmp_path):
    one_sentence(capsys, ["plan", "gpt-tiny", "--cluster", "p3.16xlarge:1", "--out", f"{tmp_path}/"],
                 "is a directory")
    one_sentence(capsys, ["plan", "gpt-tiny", "--cluster", "p3.16xlarge:1", "--out", str(tmp_path / "no" / "p.json")],
                 "cannot write --out")
    one_sentence(capsys, ["plan", "gpt-tiny", "--cluster", "p3.16xlarge:1", "--method", "data", "--dp", "3"],
                 "--dp applies to --method megatron only")


def test_cli_train_refuses_hostile_plan_files_in_one_sentence(capsys, tmp_path):
    nested = tmp_path / "nested.json"
    nested.write_text("[" * 100_000 + "]" * 100_000)
    one_sentence(capsys, ["train", "gpt-tiny", "--plan", str(nested), "--steps", "1"], "nests deeper")
    one_sentence(capsys, ["train", "gpt-tiny", "--plan", str(tmp_path), "--steps", "1"], "is a directory")
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\xff\xfe\x00")
    one_sentence(capsys, ["train", "gpt-tiny", "--plan", str(binary), "--steps", "1"], "binary.json", "not text")


def test_cli_plan_out_then_train_reads_the_cluster_from_the_file(tmp_path):
    """Issue 15's bug as a user meets it: `plan --out` in one folder, `train --plan` from another. The file holds
    the cluster itself, so 'cpu:1' is never looked up as a path. (Training itself runs in test_readme.)"""
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="8")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    r = subprocess.run([sys.executable, "-m", "autopar_lab", "plan", "gpt-tiny", "--cluster", "cpu:1", "--method",
                        "megatron", "--dp", "2", "--tp", "2", "--pp", "2", "--microbatches", "2", "--out", "cpu.json",
                        "--json"], cwd=tmp_path / "a", env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    data = json.loads((tmp_path / "a" / "cpu.json").read_text())
    assert isinstance(data["cluster"], dict) and data["cluster"]["name"] == "cpu"
    model = al.models.get("gpt-tiny")
    plan = al.load_plan(tmp_path / "a" / "cpu.json", model.trace(), model=model)
    assert [st.logical_mesh for st in plan.stages] == [(2, 2), (2, 2)]
    # from another folder: a wrong --steps is the only complaint (the plan file was read and understood)
    r = subprocess.run([sys.executable, "-m", "autopar_lab", "train", "gpt-tiny", "--plan", "../a/cpu.json",
                        "--steps", "0", "--json"], cwd=tmp_path / "b", env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 2 and "--steps" in r.stderr and "cluster file" not in r.stderr, r.stderr


def test_cli_train_refuses_checkpoint_dirs_it_may_not_use_before_ray_starts(capsys, plan, tmp_path):
    path = tmp_path / "plan.json"
    al.save_plan(plan, path)
    argv = ["train", "gpt-tiny", "--batch", "8", "--layers", "2", "--plan", str(path), "--steps", "2"]
    (tmp_path / "file").write_text("x")
    one_sentence(capsys, [*argv, "--checkpoint-dir", str(tmp_path / "file" / "ck")], "cannot write checkpoints")
    used = tmp_path / "used"
    used.mkdir()
    (used / "job.json").write_text('{"format": "autopar-lab-stage-checkpoint", "version": 1, "run_id": "r1", '
                                   '"step": 5, "losses": [1, 2, 3, 4, 5]}')
    one_sentence(capsys, [*argv, "--checkpoint-dir", str(used)], "run r1 (step 5)", "--overwrite")
    (used / "job.json").write_text("{")
    one_sentence(capsys, [*argv, "--checkpoint-dir", str(used), "--resume"], "job.json is damaged")
    one_sentence(capsys, [*argv, "--checkpoint-dir", str(used), "--resume", "--overwrite"], "pass one")
    assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()  # refused before Ray started
