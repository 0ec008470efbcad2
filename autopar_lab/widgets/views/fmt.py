"""One number format for every view: times, bytes, FLOPs, rates, changes, ratios and percentages.

Times keep 4 significant digits (a step-time change of a fraction of a percent must show), everything else 3. Units
scale with the value (no "8.38e+03 GiB": that is "8.18 TiB"). A relative change is written only where it means
something: when the value it is relative to is at least 1% of the reference the reader compares against (a term of
the step time that grows from 2 µs to 80 µs is "+78 µs", not "+4063.1%").

    >>> fmt_s(0.00123), fmt_s(2.5), fmt_s(0)
    ('1.23 ms', '2.5 s', '0 s')
    >>> fmt_bytes(8380 * 2**30), fmt_bytes(512)
    ('8.18 TiB', '512 B')
    >>> fmt_delta_s(0.5, 0.45), fmt_delta_s(2e-6, 8e-5, reference=0.5), fmt_delta_s(1.0, 1.0)
    ('-50 ms, -10.0%', '+78 µs', '=')
    >>> fmt_delta_s(17.3, 17.3 - 1.735e-9)  # rounding noise, not a change
    '='
    >>> strategy_text("RS1 = RS1 x ''")
    'output RS1 from RS1 × scalar'
"""

from __future__ import annotations

import math

__all__ = ["fmt_s", "fmt_bytes", "fmt_flops", "fmt_count", "fmt_rate", "fmt_pct", "fmt_ratio", "fmt_delta_s",
           "fmt_delta_bytes", "strategy_text", "MEANINGFUL"]

#: A relative change is shown only when its base is at least this fraction of the reference.
MEANINGFUL = 0.01

#: Changes below this fraction of the values compared are rounding noise (sums taken in another order, float32
#: arrays in the stage DP): shown as "=" rather than "-1.735e-09 ns".
NOISE = 1e-7


def _sig(x: float, digits: int) -> str:
    return f"{x:.{digits}g}"


def fmt_s(x: float) -> str:
    """Seconds with a unit that fits: ``fmt_s(0.00123) == '1.23 ms'``."""
    a = abs(x)
    if a == 0 or not math.isfinite(a):
        return f"{x:g} s"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if a >= scale * 0.9995:
            return f"{_sig(x / scale, 4)} {unit}"
    return f"{_sig(x * 1e9, 4)} ns"


def fmt_bytes(b: float) -> str:
    """Bytes in binary units up to PiB, 3 significant digits."""
    for unit, size in (("PiB", 2**50), ("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(b) >= size:
            return f"{_sig(b / size, 3)} {unit}"
    return f"{b:.0f} B"


def fmt_flops(f: float) -> str:
    for unit, size in (("EFLOP", 1e18), ("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6),
                       ("kFLOP", 1e3)):
        if abs(f) >= size:
            return f"{_sig(f / size, 3)} {unit}"
    return f"{f:.0f} FLOP"


def fmt_count(n: float) -> str:
    """A count with k / M / G: ``fmt_count(12345) == '12.3k'``."""
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= size:
            return f"{_sig(n / size, 3)}{unit}"
    return _sig(n, 3)


def fmt_rate(per_s: float | None, what: str = "samples") -> str:
    """``fmt_rate(1234.5) == '1.23k samples/s'``; None: an em dash."""
    return "—" if per_s is None else f"{fmt_count(per_s)} {what}/s"


def fmt_pct(x: float) -> str:
    """A fraction as a percentage: ``fmt_pct(0.1234) == '12.3%'``; below a thousandth, ``'<0.1%'``."""
    if 0 < abs(x) < 0.001:
        return "<0.1%" if x > 0 else "-<0.1%"
    return f"{x * 100:.3g}%" if abs(x) < 10 else f"{x * 100:.0f}%"


def fmt_ratio(x: float | None) -> str:
    """3 significant digits, trailing zeros kept so ratios line up: ``fmt_ratio(3) == '3.00×'``,
    ``fmt_ratio(123.4) == '123×'``; None: an em dash."""
    if x is None:
        return "—"
    return f"{x:.0f}×" if abs(x) >= 100 else f"{x:#.3g}×"


def _rel(before: float, d: float, reference: float | None) -> str:
    ref = abs(reference) if reference is not None else abs(before)
    if before and ref and abs(before) >= MEANINGFUL * ref:
        return f", {d / before:+.1%}"
    return ""


def _delta(before: float | None, after: float, reference: float | None, fmt) -> str:
    if before is None:
        return ""
    d = after - before
    scale = max(abs(before), abs(after), abs(reference) if reference is not None else 0.0)
    if abs(d) <= NOISE * scale:
        return "="
    return f"{'+' if d > 0 else '-'}{fmt(abs(d))}{_rel(before, d, reference)}"


def fmt_delta_s(before: float | None, after: float, reference: float | None = None) -> str:
    """The change ``after - before`` in seconds, signed, with the relative change when it is meaningful (see the
    module docstring; ``reference`` defaults to ``before``). ``=`` when nothing changed, "" without a before."""
    return _delta(before, after, reference, fmt_s)


def fmt_delta_bytes(before: float | None, after: float, reference: float | None = None) -> str:
    """As :func:`fmt_delta_s`, for bytes."""
    return _delta(before, after, reference, fmt_bytes)


def strategy_text(name: str) -> str:
    """A strategy's name (``"S0R = S0R x RR"``: output spec = input specs) said in words, scalars named."""
    out, sep, ins = name.partition(" = ")
    if not sep:
        return name
    if ins in ("()", ""):  # no inputs: a parameter, a batch input, a constant
        return f"output {out}"
    parts = [("scalar" if p in ("''", "") else p) for p in ins.split(" x ")]
    return f"output {out} from {' × '.join(parts)}"
