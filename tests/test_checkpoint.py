"""Per-stage checkpoints: round trip (bfloat16 included), commit rule, refusal of foreign or corrupt files, no
pickle."""

import json
import zipfile

import jax.numpy as jnp
import numpy as np
import pytest

from autopar_lab.runtime.checkpoint import (CheckpointError, latest_step, load_job, load_stage, save_job, save_stage,
                                            steps_of)


def _state(seed=0):
    rng = np.random.default_rng(seed)
    params = {"dense": {"w": rng.normal(size=(3, 4)).astype(np.float32), "b": np.zeros(4, np.float32)},
              "emb": jnp.asarray(rng.normal(size=(5, 2)), jnp.bfloat16)}
    opt = ({"count": np.array(7, np.int32)}, [rng.normal(size=(2,)).astype(np.float32)])
    return params, opt


def test_round_trip_keeps_structure_values_and_dtypes(tmp_path):
    tree = _state(1)
    save_stage(tmp_path, 3, 1, tree)
    back = load_stage(tmp_path, 3, 1, template=_state(2))  # template: same structure, other values
    import jax
    a, b = jax.tree_util.tree_leaves(tree), jax.tree_util.tree_leaves(back)
    assert len(a) == len(b) == 5
    for x, y in zip(a, b):
        assert np.asarray(x).dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), y)
    assert back[0]["emb"].dtype == jnp.bfloat16
    assert int(back[1][0]["count"]) == 7


def test_files_hold_no_pickle(tmp_path):
    save_stage(tmp_path, 0, 0, _state())
    npz = tmp_path / "stage_0" / "step_00000000.npz"
    with zipfile.ZipFile(npz) as z:
        for name in z.namelist():
            header = z.read(name)[:128]
            assert b"'descr': '|O'" not in header  # no object arrays
    np.load(npz, allow_pickle=False)["leaf_00000"]  # loads with pickle off
    index = json.loads((tmp_path / "stage_0" / "step_00000000.json").read_text())
    assert [leaf["dtype"] for leaf in index["leaves"]] == ["float32", "float32", "bfloat16", "int32", "float32"]
    assert index["leaves"][0]["path"] == "[0]['dense']['b']"


def test_latest_step_needs_every_stage(tmp_path):
    assert latest_step(tmp_path, 2) is None
    for step in (2, 4):
        save_stage(tmp_path, step, 0, _state())
    save_stage(tmp_path, 2, 1, _state())
    assert steps_of(tmp_path, 0) == [2, 4]
    assert latest_step(tmp_path, 2) == 2  # stage 1 never committed step 4
    save_stage(tmp_path, 4, 1, _state())
    assert latest_step(tmp_path, 2) == 4
    # an index not yet written (a crash while saving) does not count
    (tmp_path / "stage_1" / "step_00000004.json").unlink()
    assert latest_step(tmp_path, 2) == 2


def test_foreign_or_corrupt_checkpoints_are_refused(tmp_path):
    save_stage(tmp_path, 1, 0, _state())
    other = ({"w": np.zeros((3, 5), np.float32)},)
    with pytest.raises(CheckpointError, match="another plan or model"):
        load_stage(tmp_path, 1, 0, template=other)
    bigger = _state()
    bigger[0]["dense"]["w"] = np.zeros((3, 8), np.float32)
    with pytest.raises(CheckpointError, match=r"expects .*\[3, 8\]"):
        load_stage(tmp_path, 1, 0, template=bigger)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_stage(tmp_path, 9, 0, template=_state())
    (tmp_path / "stage_0" / "step_00000001.npz").write_bytes(b"not a zip")
    with pytest.raises(CheckpointError, match="unreadable"):
        load_stage(tmp_path, 1, 0, template=_state())


def test_job_record(tmp_path):
    assert load_job(tmp_path) is None
    save_job(tmp_path, 2, [3.0, 2.5, 2.25])
    assert load_job(tmp_path)["losses"] == [3.0, 2.5] and load_job(tmp_path)["step"] == 2
