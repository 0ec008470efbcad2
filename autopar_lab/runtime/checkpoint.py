"""Per-stage checkpoints: the leaves of a stage's (params, opt_state) in an ``.npz``, described by a JSON index.

Never pickle: the ``.npz`` holds plain arrays (loaded with ``allow_pickle=False``) and the JSON index holds each
leaf's path, shape and dtype. The tree's structure comes from a template the caller already has (the stage's freshly
initialised state), so loading checks the file against it leaf by leaf. Layout::

    DIR/stage_0/step_00000004.npz   DIR/stage_0/step_00000004.json   (the .json is written last: it commits)
    DIR/stage_1/...
    DIR/job.json                    (the run's id, and its losses up to the newest complete checkpoint)

A step counts as checkpointed only when every stage committed it (:func:`latest_step`), so a job killed while
writing resumes from the step before. Every file is written atomically (a temporary file renamed over the name).

A directory belongs to one run: :func:`claim` writes the run's id into ``job.json`` when the run starts, refuses a
new run into a directory that holds another run's checkpoints unless told to overwrite them, and refuses to resume
from a directory whose ``job.json`` is missing or damaged (naming the file). :func:`resume_point` goes on from the
newest step whose files every stage can read back, falling back past a damaged (truncated, corrupt) step and saying
so.

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

from ..safeio import probe_writable, write_atomic

__all__ = ["save_stage", "load_stage", "latest_step", "steps_of", "save_job", "load_job", "CheckpointError", "claim",
           "verify_step", "resume_point"]

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


def save_stage(directory, step: int, stage: int, tree) -> Path:
    """Write one stage's state ``tree`` (any pytree of arrays) as checkpoint ``step``; returns the index path."""
    if int(step) < 0 or int(stage) < 0:
        raise ValueError(f"step and stage must be non-negative, got step={step}, stage={stage}.")
    entries, _ = _flatten(tree)
    arrays = [np.asarray(leaf) for _, leaf in entries]
    d = _stage_dir(directory, stage)
    d.mkdir(parents=True, exist_ok=True)
    base = f"step_{int(step):08d}"
    write_atomic(d / f"{base}.npz",
                  lambda f: np.savez(f, **{f"leaf_{i:05d}": _to_storable(a)  # type: ignore[arg-type]
                                           for i, a in enumerate(arrays)}))
    index = {"format": FORMAT, "version": VERSION, "step": int(step), "stage": int(stage),
             "leaves": [{"path": p, "shape": list(a.shape), "dtype": a.dtype.name}
                        for (p, _), a in zip(entries, arrays)]}
    write_atomic(d / f"{base}.json", lambda f: f.write(json.dumps(index, indent=1).encode()))
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


def save_job(directory, step: int, losses, run_id: str | None = None) -> None:
    """Record the job's losses up to checkpoint ``step`` (so a resumed job reports every step), under ``run_id``
    (default: the id already recorded)."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    if run_id is None:
        run_id = (load_job(directory) or {}).get("run_id")
    data = {"format": FORMAT, "version": VERSION, "run_id": run_id, "step": int(step),
            "losses": [float(x) for x in losses[:step]]}
    write_atomic(Path(directory) / "job.json", json.dumps(data).encode())


def load_job(directory) -> dict | None:
    """The last :func:`save_job` record, or None (missing or unreadable: :func:`read_job` tells which)."""
    try:
        return read_job(directory)
    except CheckpointError:
        return None


def read_job(directory) -> dict | None:
    """``job.json`` of ``directory``: None when there is none, CheckpointError (naming the file) when it is damaged."""
    path = Path(directory) / "job.json"
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"the run index {path} cannot be read ({getattr(e, 'strerror', None) or e}).") from None
    try:
        rec = json.loads(text)
        ok = (isinstance(rec, dict) and rec.get("format") == FORMAT and isinstance(rec.get("step"), int)
              and rec["step"] >= 0 and isinstance(rec.get("losses"), list))
    except ValueError:
        ok = False
    if not ok:
        raise CheckpointError(f"the run index {path} is damaged (not an autopar-lab job record); the checkpoints "
                              "beside it cannot be trusted to resume from.")
    return rec


def _has_checkpoints(directory) -> bool:
    d = Path(directory)
    return d.is_dir() and any(p.name.startswith("stage_") and p.is_dir() and any(p.iterdir()) for p in d.iterdir())


def claim(directory, run_id: str, *, resume: bool = False, overwrite: bool = False) -> tuple[str, dict | None]:
    """Make ``directory`` this run's checkpoint directory; returns (the run id to record, the job record resumed).

    A new run (``resume=False``) into a directory holding another run's ``job.json`` or stage checkpoints is refused
    unless ``overwrite=True`` (then that run's files are removed: ``job.json`` and the ``stage_*`` folders, nothing
    else). ``resume=True`` keeps the directory's run id; a missing or damaged ``job.json`` beside checkpoints is
    refused (the run cannot be resumed safely); an empty or new directory starts a fresh run. The directory must be
    writable: a probe file is created and removed (which works for root and read-only file systems alike).
    """
    import shutil

    d = Path(directory)
    try:
        d.mkdir(parents=True, exist_ok=True)
        probe_writable(d)
    except OSError as e:
        raise CheckpointError(f"cannot write checkpoints to {d} ({e.strerror or e}); pick a folder you can write "
                              "to.") from None
    try:
        rec = read_job(d)
    except CheckpointError:
        if resume:
            raise
        rec = {"run_id": "(unknown: its job.json is damaged)", "step": "?"}
    if resume:
        if rec is None:
            if _has_checkpoints(d):
                raise CheckpointError(f"{d} holds stage checkpoints but no job.json, so which run and step they "
                                      "belong to is unknown; resume from the directory the run wrote, or start a "
                                      "new run without resume.")
            rec = {"run_id": run_id, "step": 0, "losses": []}
            save_job(d, 0, [], run_id)
            return run_id, None
        return str(rec.get("run_id") or run_id), rec
    if rec is not None and rec.get("run_id") == run_id:
        return run_id, None  # this run claimed it already (the driver claims again what launch claimed)
    if rec is not None or _has_checkpoints(d):
        if not overwrite:
            other = f"run {rec['run_id']} (step {rec['step']})" if rec else "another run"
            raise CheckpointError(f"{d} holds the checkpoints of {other}; resume it (resume=True, --resume), "
                                  "replace them (overwrite=True, --overwrite) or pick an empty directory.")
        for p in d.iterdir():
            if p.name.startswith("stage_") and p.is_dir():
                shutil.rmtree(p)
        (d / "job.json").unlink(missing_ok=True)
    save_job(d, 0, [], run_id)
    return run_id, None


def verify_step(directory, step: int, stage: int) -> str | None:
    """Why checkpoint ``step`` of ``stage`` cannot be read back (None when it can): its index must parse and its
    array file must be a whole zip (every member's CRC checked) with one array per leaf of the index."""
    import zipfile

    d = _stage_dir(directory, stage)
    base = d / f"step_{int(step):08d}"
    try:
        index = json.loads(Path(f"{base}.json").read_text())
        leaves = index["leaves"]
        if index.get("format") != FORMAT or not isinstance(leaves, list):
            return f"{base}.json is not a stage checkpoint index"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{base}.json cannot be read ({type(e).__name__})"
    try:
        with zipfile.ZipFile(f"{base}.npz") as z:
            broken = z.testzip()
            names = z.namelist()
    except (OSError, zipfile.BadZipFile, ValueError, EOFError) as e:
        return f"{base}.npz is damaged ({' '.join(str(e).split())[:120]})"
    if broken is not None:
        return f"{base}.npz is damaged (member {broken} fails its CRC)"
    if len(names) != len(leaves):
        return f"{base}.npz holds {len(names)} arrays, its index lists {len(leaves)}"
    return None


def resume_point(directory, num_stages: int, upto: int | None = None) -> tuple[int, list[float], str]:
    """(step, losses up to it, a note) to go on from: the newest step at or before ``upto`` (default: the one
    ``job.json`` records) that every stage committed and can read back. A damaged newer step is skipped and the
    note says which and why; no readable step means step 0."""
    rec = read_job(directory) or {"step": 0, "losses": []}
    last = int(rec["step"]) if upto is None else min(int(upto), int(rec["step"]))
    common = None
    for k in range(num_stages):
        steps = {s for s in steps_of(directory, k) if s <= last}
        common = steps if common is None else common & steps
    skipped: list[tuple[int, str]] = []
    for step in sorted(common or (), reverse=True):
        reasons = [r for r in (verify_step(directory, step, k) for k in range(num_stages)) if r]
        if not reasons:
            which = (f"step {skipped[0][0]} is" if len(skipped) == 1 else
                     f"steps {', '.join(str(s) for s, _ in skipped)} are")
            note = (f"checkpoint {which} damaged ({skipped[0][1]}); resuming from step {step}, the newest complete "
                    "one") if skipped else ""
            return step, [float(x) for x in rec["losses"]][:step], note
        skipped.append((step, reasons[0]))
    note = (f"no checkpoint up to step {last} can be read back ({skipped[0][1]}); starting from step 0"
            if skipped else "")
    return 0, [], note
