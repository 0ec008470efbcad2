"""Per-stage checkpoints: the leaves of a stage's (params, opt_state) in an ``.npz``, described by a JSON index.

Never pickle: the ``.npz`` holds plain arrays (loaded with ``allow_pickle=False``) and the JSON index holds each
leaf's path, shape and dtype. The tree's structure comes from a template the caller already has (the stage's freshly
initialised state), so loading checks the file against it leaf by leaf. Layout::

    DIR/stage_0/step_00000004.npz   DIR/stage_0/step_00000004.json   (the .json is written last: it commits)
    DIR/stage_1/...
    DIR/job.json                    (the job's losses up to the newest complete checkpoint)

A step counts as checkpointed only when every stage committed it (:func:`latest_step`), so a job killed while
writing resumes from the step before.

    >>> import tempfile, numpy as np
    >>> d = tempfile.mkdtemp()
    >>> state = {"w": np.ones((2, 3), np.float32)}
    >>> _ = save_stage(d, step=2, stage=0, tree=state)
    >>> latest_step(d, num_stages=1)
    2
    >>> load_stage(d, 2, 0, template=state)["w"].shape
    (2, 3)
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np

__all__ = ["save_stage", "load_stage", "latest_step", "steps_of", "save_job", "load_job", "CheckpointError"]

FORMAT = "autopar-lab-stage-checkpoint"
VERSION = 1
_STEP_RE = re.compile(r"^step_(\d{8})\.json$")


class CheckpointError(ValueError):
    """A checkpoint that is missing, corrupt, or does not fit the stage it is loaded into."""


def _stage_dir(directory, stage: int) -> Path:
    return Path(directory) / f"stage_{int(stage)}"


def _flatten(tree):
    import jax

    leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return [(jax.tree_util.keystr(p), leaf) for p, leaf in leaves_with_path], treedef


def _to_storable(arr: np.ndarray) -> np.ndarray:
    # numpy cannot store bfloat16 & co. natively (they would come back as opaque void): keep their bits as uints.
    if arr.dtype.kind in "biufc":
        return arr
    return arr.view(np.dtype(f"uint{8 * arr.dtype.itemsize}"))


def _write_atomic(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_stage(directory, step: int, stage: int, tree) -> Path:
    """Write one stage's state ``tree`` (any pytree of arrays) as checkpoint ``step``; returns the index path."""
    if int(step) < 0 or int(stage) < 0:
        raise ValueError(f"step and stage must be non-negative, got step={step}, stage={stage}.")
    entries, _ = _flatten(tree)
    arrays = [np.asarray(leaf) for _, leaf in entries]
    d = _stage_dir(directory, stage)
    d.mkdir(parents=True, exist_ok=True)
    base = f"step_{int(step):08d}"
    _write_atomic(d / f"{base}.npz",
                  lambda f: np.savez(f, **{f"leaf_{i:05d}": _to_storable(a) for i, a in enumerate(arrays)}))
    index = {"format": FORMAT, "version": VERSION, "step": int(step), "stage": int(stage),
             "leaves": [{"path": p, "shape": list(a.shape), "dtype": a.dtype.name}
                        for (p, _), a in zip(entries, arrays)]}
    _write_atomic(d / f"{base}.json", lambda f: f.write(json.dumps(index, indent=1).encode()))
    return d / f"{base}.json"


def steps_of(directory, stage: int) -> list[int]:
    """The steps stage ``stage`` has committed checkpoints for, ascending."""
    d = _stage_dir(directory, stage)
    if not d.is_dir():
        return []
    return sorted(int(m.group(1)) for m in map(_STEP_RE.match, os.listdir(d)) if m)


def latest_step(directory, num_stages: int) -> int | None:
    """The newest step every one of ``num_stages`` stages has committed, or None."""
    common = None
    for k in range(num_stages):
        steps = set(steps_of(directory, k))
        common = steps if common is None else common & steps
    return max(common) if common else None


def load_stage(directory, step: int, stage: int, template):
    """Checkpoint ``step`` of stage ``stage``, as a tree shaped like ``template`` (arrays as numpy).

    Raises CheckpointError when the files are missing or corrupt, or their leaves differ from the template's in
    number, path, shape or dtype (say, a checkpoint of another plan or model).
    """
    import jax

    d = _stage_dir(directory, stage)
    base = f"step_{int(step):08d}"
    where = f"checkpoint {d / base}"
    try:
        index = json.loads((d / f"{base}.json").read_text())
    except OSError:
        raise CheckpointError(f"{where} does not exist; pick a step from {steps_of(directory, stage)}.") from None
    except ValueError as e:
        raise CheckpointError(f"{where} has a corrupt index ({e}).") from None
    if index.get("format") != FORMAT or index.get("version") != VERSION:
        raise CheckpointError(f"{where} is not a version-{VERSION} autopar-lab stage checkpoint.")
    entries, treedef = _flatten(template)
    saved = index["leaves"]
    if len(saved) != len(entries):
        raise CheckpointError(f"{where} holds {len(saved)} arrays but stage {stage} has {len(entries)}; it was "
                              "written for another plan or model; use another checkpoint directory.")
    try:
        npz = np.load(d / f"{base}.npz", allow_pickle=False)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{where} has an unreadable array file ({e}).") from None
    leaves = []
    with npz:
        for i, ((path, ref), meta) in enumerate(zip(entries, saved)):
            ref_shape, ref_dtype = tuple(np.shape(ref)), np.dtype(getattr(ref, "dtype", np.asarray(ref).dtype))
            if meta["path"] != path or tuple(meta["shape"]) != ref_shape or meta["dtype"] != ref_dtype.name:
                raise CheckpointError(
                    f"{where}: leaf {i} is {meta['path']} {meta['shape']} {meta['dtype']} but stage {stage} expects "
                    f"{path} {list(ref_shape)} {ref_dtype.name}; it was written for another plan or model.")
            try:
                arr = npz[f"leaf_{i:05d}"]
            except (KeyError, ValueError, OSError) as e:
                raise CheckpointError(f"{where} lacks array {i} ({e}).") from None
            if arr.dtype != ref_dtype:
                arr = arr.view(ref_dtype)
            if arr.shape != ref_shape:
                raise CheckpointError(f"{where}: array {i} has shape {list(arr.shape)}, its index says "
                                      f"{list(ref_shape)}.")
            leaves.append(arr)
    return jax.tree_util.tree_unflatten(treedef, leaves)


def save_job(directory, step: int, losses) -> None:
    """Record the job's losses up to checkpoint ``step`` (so a resumed job reports every step)."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    data = {"format": FORMAT, "version": VERSION, "step": int(step), "losses": [float(x) for x in losses[:step]]}
    _write_atomic(Path(directory) / "job.json", lambda f: f.write(json.dumps(data).encode()))


def load_job(directory) -> dict | None:
    """The last :func:`save_job` record, or None."""
    try:
        return json.loads((Path(directory) / "job.json").read_text())
    except (OSError, ValueError):
        return None
