"""Reading collectives out of XLA's partitioned HLO text: which collective, how many, and the bytes each moves."""

from __future__ import annotations

import math
import re
from typing import Mapping

#: The collective kinds :func:`collectives_in_hlo` reports (always all five keys).
COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "collective_permute")


_OPCODES = {
    "all-reduce": ("all_reduce", "shape"),
    "all-reduce-start": ("all_reduce", "shape"),
    "all-gather": ("all_gather", "shape"),
    "all-gather-start": ("all_gather", "result"),  # shape (operand(s), result(s))
    "reduce-scatter": ("reduce_scatter", "operand"),
    "reduce-scatter-start": ("reduce_scatter", "start_operand"),  # async sugar: ((operands), results, ...)
    "all-to-all": ("all_to_all", "shape"),
    "all-to-all-start": ("all_to_all", "result"),
    "ragged-all-to-all": ("all_to_all", "shape"),
    "collective-permute": ("collective_permute", "shape"),
    "collective-permute-start": ("collective_permute", "result"),  # (operand, result, u32[], u32[])
}
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[^\s=(){}]+)\s*=\s*")
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([^\]]*)\]")
_COMMENT = re.compile(r"/\*.*?\*/")
_OPERAND_NAME = re.compile(r"%?([A-Za-z_][\w.\-]*)\s*$")


def _dtype_bytes(name: str) -> float:
    if name in ("pred",):
        return 1.0
    if name in ("token", "tuple", "opaque"):
        return 0.0
    if name.startswith("c"):  # c64, c128: complex widths count both halves
        digits = "".join(ch for ch in name if ch.isdigit())
        return int(digits) / 8 if digits else 0.0
    match = re.match(r"[a-z]+(\d+)", name)
    return int(match.group(1)) / 8 if match else 0.0


def _shape_bytes(text: str) -> float:
    """Bytes of every array in an HLO shape string (tuples summed): ``(f32[8,32]{1,0}, s32[])`` -> 1028."""
    total = 0.0
    for dtype, dims in _ARRAY.findall(_COMMENT.sub("", text)):
        n = 1
        for d in dims.split(","):
            d = re.sub(r"[^0-9]", "", d)
            if d:
                n *= int(d)
        total += n * _dtype_bytes(dtype)
    return total


def _balanced(text: str, start: int) -> int:
    """Index just past the parenthesis group opening at ``text[start] == '('``."""
    depth = 0
    for i in range(start, len(text)):
        ch = text[i]
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth == 0:
                return i + 1
    return len(text)


def _split_top(text: str) -> list[str]:
    """Elements of a tuple shape ``(a, (b, c), d)`` at the top level; a non-tuple is its own single element."""
    text = _COMMENT.sub("", text).strip()
    if not text.startswith("("):
        return [text]
    inner = text[1:_balanced(text, 0) - 1]
    parts: list[str] = []
    depth, cur = 0, []  # type: int, list[str]
    for ch in inner:
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        parts.append("".join(cur).strip())
    return parts


def _group_size(attrs: str) -> int | None:
    """Devices per replica group from ``replica_groups=`` in its three spellings."""
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attrs)
    if m:
        sizes = dict(re.findall(r"'?([\w.]+)'?\s*=\s*(\d+)", m.group(1)))
        names = re.findall(r"'?([\w.]+)'?", m.group(2))
        return math.prod(int(sizes[n]) for n in names if n in sizes) if names else None
    m = re.search(r"replica_groups=\[([\d,\s]+)\]<=", attrs)
    if m:
        dims = [int(d) for d in m.group(1).split(",") if d.strip()]
        return dims[-1] if dims else None
    m = re.search(r"replica_groups=\{\{([\d,\s]*)\}", attrs)
    if m:
        return len([d for d in m.group(1).split(",") if d.strip()])
    return None


def _parse_instruction(line: str):
    """``(name, shape_text, opcode, operands_text, attrs_text)`` of one HLO instruction line, or None."""
    m = _INSTR.match(line)
    if not m:
        return None
    pos = m.end()
    if pos < len(line) and line[pos] == "(":
        end = _balanced(line, pos)
    else:
        end = pos
        while end < len(line) and not line[end].isspace():
            end += 1
    shape = line[pos:end]
    m2 = re.compile(r"\s+([\w\-]+)\(").match(line, end)
    if not m2:
        return None
    op_start = m2.end() - 1
    op_end = _balanced(line, op_start)
    return m.group("name"), shape, m2.group(1), line[op_start + 1:op_end - 1], line[op_end:]


def collective_instructions(hlo_text: str) -> list[dict]:
    """Every collective instruction in an HLO module's text, in order, as
    ``{"kind", "opcode", "name", "computation", "shape", "bytes", "group_size"}``.

    Each instruction is counted once: ``-start`` forms count, ``-done`` forms do not; instructions inside fusion,
    async-wrapped and other called computations count. ``bytes`` is the full buffer the collective works on, per
    device: all-gather its result, reduce-scatter its operand(s), all-reduce / all-to-all / collective-permute
    their result; tuple-shaped (variadic) collectives sum their parts.

    >>> hlo = '''
    ... ENTRY %main (p: f32[8,256]) -> f32[256] {
    ...   %p = f32[8,256]{1,0} parameter(0)
    ...   %r = f32[256]{0} reduce(%p, %c), dimensions={0}, to_apply=%add
    ...   ROOT %all-reduce = f32[256]{0} all-reduce(%r), replica_groups={{0,1,2,3}}, to_apply=%add
    ... }'''
    >>> [(c["kind"], c["bytes"]) for c in collective_instructions(hlo)]
    [('all_reduce', 1024.0)]
    """
    shapes: dict[str, str] = {}
    parsed = []
    computation = ""
    for line in hlo_text.splitlines():
        stripped = line.strip()
        if stripped.endswith("{") and "=" not in stripped.split("(")[0]:
            computation = stripped.split("(")[0].replace("ENTRY", "").strip().lstrip("%")
            # computation parameters: "(param_0: f32[8,256], p1: s32[])"
            for pname, pshape in re.findall(r"([\w.\-]+):\s*([a-z][a-z0-9]*\[[^\]]*\])", stripped):
                shapes.setdefault(pname, pshape)
            continue
        ins = _parse_instruction(line)
        if ins is None:
            continue
        name, shape, opcode, operands, attrs = ins
        shapes[name] = shape
        if opcode in _OPCODES:
            parsed.append((computation, name, shape, opcode, operands, attrs))
    out = []
    for computation, name, shape, opcode, operands, attrs in parsed:
        kind, rule = _OPCODES[opcode]
        group = _group_size(attrs)
        elements = _split_top(shape)
        if rule == "shape":
            nbytes = _shape_bytes(shape)
        elif rule == "result":
            nbytes = _shape_bytes(elements[1]) if len(elements) >= 2 else _shape_bytes(shape)
        elif rule == "start_operand":
            nbytes = _shape_bytes(elements[0])
        else:  # reduce-scatter: its operands' shapes (printed inline, or looked up by name)
            nbytes = 0.0
            found = True
            for operand in _split_top("(" + operands + ")"):
                if _ARRAY.search(operand):
                    nbytes += _shape_bytes(operand)
                    continue
                m = _OPERAND_NAME.search(operand)
                if m and m.group(1) in shapes:
                    nbytes += _shape_bytes(shapes[m.group(1)])
                else:
                    found = False
            if not found or nbytes == 0.0:  # fall back on result x group size
                nbytes = _shape_bytes(shape) * (group or 1)
        out.append({"kind": kind, "opcode": opcode, "name": name, "computation": computation,
                    "shape": _COMMENT.sub("", shape), "bytes": float(nbytes), "group_size": group})
    return out


def collectives_in_hlo(hlo_text: str) -> dict[str, dict[str, float]]:
    """``{kind: {"count": int, "bytes": float}}`` for every kind in :data:`COLLECTIVE_KINDS` (zeros included),
    from partitioned HLO text (``jax.jit(...).lower(...).compile().as_text()``); see :func:`collective_instructions`
    for what counts and how bytes are measured."""
    acc = {k: {"count": 0, "bytes": 0.0} for k in COLLECTIVE_KINDS}
    for c in collective_instructions(hlo_text):
        acc[c["kind"]]["count"] += 1
        acc[c["kind"]]["bytes"] += c["bytes"]
    return acc


def total_bytes(collectives: Mapping[str, Mapping[str, float]] | None) -> float:
    """Sum of ``bytes`` over the kinds of a collectives summary."""
    return float(sum(float(v.get("bytes", 0.0)) for v in (collectives or {}).values()))
