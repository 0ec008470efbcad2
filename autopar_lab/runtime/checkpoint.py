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

from ..safeio import loads_json, open_regular, probe_writable, read_text_file, write_atomic

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


#: What a checkpoint file that is not a regular file (a symlink to /dev/zero, a FIFO) is told: the run wrote none.
_NOT_OURS = "a checkpoint is regular files only, so this is not one autopar-lab wrote"


def _read_index(path: Path, what: str = "checkpoint index"):
    """The parsed JSON of a checkpoint's index (or the run's job.json), read as plan files are: a regular file, of
    bounded size, nested and numbered as JSON we wrote. ValueError (naming the file) otherwise."""
    return loads_json(read_text_file(path, what, hint=_NOT_OURS), f"{what} {os.fspath(path)!r}")


def _stored_dtype_fits(stored: np.dtype, name: str) -> bool:
    """Whether an array stored with dtype ``stored`` holds leaves of dtype ``name`` (see :func:`_to_storable`)."""
    try:
        want = np.dtype(name)
    except TypeError:  # bfloat16 & co. unknown to numpy here: stored as their bits
        return stored.kind == "u"
    return stored == (want if want.kind in "biufc" else np.dtype(f"uint{8 * want.itemsize}"))


def _index_problem(index, step: int, stage: int) -> str | None:
    """Why a parsed index is not checkpoint ``step`` of ``stage`` (None when it is): its format, the step and stage
    it names (stage files swapped or copied between steps name another), and its list of leaves."""
    if not isinstance(index, dict) or index.get("format") != FORMAT or index.get("version") != VERSION:
        return f"it is not a version-{VERSION} autopar-lab stage checkpoint index"
    if index.get("step") != int(step) or index.get("stage") != int(stage):
        return (f"it holds step {index.get('step')!r} of stage {index.get('stage')!r}, not step {int(step)} of stage "
                f"{int(stage)} (its files were moved)")
    leaves = index.get("leaves")
    if not isinstance(leaves, list) or not all(
            isinstance(x, dict) and isinstance(x.get("path"), str) and isinstance(x.get("dtype"), str)
            and isinstance(x.get("shape"), list) and all(isinstance(n, int) and n >= 0 for n in x["shape"])
            for x in leaves):
        return "its list of leaves is damaged"
    return None


def _member_problem(z, i: int, meta: dict) -> str | None:
    """Why array ``i`` of an open ``.npz`` zip does not hold the leaf its index describes (None when it does): read
    from the array's header only (its shape and dtype), no data."""
    name = f"leaf_{i:05d}.npy"
    try:
        with z.open(name) as f:
            version = np.lib.format.read_magic(f)
            if version == (1, 0):
                shape, _, dtype = np.lib.format.read_array_header_1_0(f)
            else:
                shape, _, dtype = np.lib.format.read_array_header_2_0(f)
    except KeyError:
        return f"it lacks array {i}"
    except (ValueError, OSError, EOFError) as e:
        return f"array {i} is damaged ({' '.join(str(e).split())[:80]})"
    if list(shape) != meta["shape"] or not _stored_dtype_fits(dtype, meta["dtype"]):
        return (f"array {i} ({meta['path']}) has shape {list(shape)} and dtype {dtype.name}, but its index says "
                f"{meta['shape']} {meta['dtype']}")
    return None


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
    if not os.path.lexists(d / f"{base}.json"):
        raise CheckpointError(f"{where} does not exist; pick a step from {steps_of(directory, stage)}.")
    try:
        index = _read_index(d / f"{base}.json")
    except ValueError as e:
        raise CheckpointError(f"{where} has an unusable index ({str(e).rstrip('.')}).") from None
    problem = _index_problem(index, step, stage)
    if problem:
        raise CheckpointError(f"{where} cannot be loaded: {problem}.")
    entries, treedef = _flatten(template)
    saved = index["leaves"]
    if len(saved) != len(entries):
        raise CheckpointError(f"{where} holds {len(saved)} arrays but stage {stage} has {len(entries)}; it was "
                              "written for another plan or model; use another checkpoint directory.")
    try:
        fh = open_regular(d / f"{base}.npz", "array file", hint=_NOT_OURS)
    except ValueError as e:
        raise CheckpointError(f"{where} has an unusable array file ({str(e).rstrip('.')}).") from None
    try:
        npz = np.load(fh, allow_pickle=False)
    except (OSError, ValueError) as e:
        fh.close()
        raise CheckpointError(f"{where} has an unreadable array file ({e}).") from None
    leaves = []
    with fh, npz:
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
                try:
                    arr = arr.view(ref_dtype)
                except ValueError:
                    raise CheckpointError(f"{where}: array {i} is stored as {arr.dtype.name}, which cannot hold "
                                          f"{ref_dtype.name}.") from None
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
    if not os.path.lexists(path):
        return None
    try:
        text = read_text_file(path, "run index", hint=_NOT_OURS)
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    try:
        rec = loads_json(text, f"run index {os.fspath(path)!r}")
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
    refused (the run cannot be resumed safely), and so is a directory that does not exist or holds no run (a typo in
    the path must not quietly start training over). The directory must be writable: a probe file is created and
    removed (which works for root and read-only file systems alike).
    """
    import shutil

    d = Path(directory)
    if resume and not os.path.lexists(d):
        raise CheckpointError(f"cannot resume from {d}: it does not exist; check the path, or leave out resume "
                              "(--resume) to start a new run.")
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
            raise CheckpointError(f"{d} holds no checkpoint to resume from (no run wrote there); check the path, or "
                                  "leave out resume (--resume) to start a new run.")
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
    """Why checkpoint ``step`` of ``stage`` cannot be read back (None when it can): its index must be a regular file
    that parses and names this step and stage, and its array file a regular file and a whole zip (every member's CRC
    checked) holding one array per leaf of the index, of the shape and dtype the index gives it."""
    import zipfile

    d = _stage_dir(directory, stage)
    base = d / f"step_{int(step):08d}"
    try:
        index = _read_index(Path(f"{base}.json"))
    except ValueError as e:
        return str(e).rstrip(".")
    problem = _index_problem(index, step, stage)
    if problem:
        return f"{base}.json: {problem}"
    leaves = index["leaves"]
    try:
        with open_regular(f"{base}.npz", "array file", hint=_NOT_OURS) as fh, zipfile.ZipFile(fh) as z:
            broken = z.testzip()
            names = z.namelist()
            problem = None if broken else next(
                (p for p in (_member_problem(z, i, meta) for i, meta in enumerate(leaves)) if p), None)
    except ValueError as e:
        return str(e).rstrip(".")
    except (OSError, zipfile.BadZipFile, EOFError) as e:
        return f"{base}.npz is damaged ({' '.join(str(e).split())[:120]})"
    if broken is not None:
        return f"{base}.npz is damaged (member {broken} fails its CRC)"
    if len(names) != len(leaves):
        return f"{base}.npz holds {len(names)} arrays, its index lists {len(leaves)}"
    if problem:
        return f"{base}.npz: {problem}"
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
