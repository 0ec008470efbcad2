"""FLOPs and bytes of one operator, from its primitive, parameters and shapes.

The counts follow the usual conventions (XLA's cost analysis, Megatron-LM's FLOP formula): a multiply-add is two
FLOPs; an elementwise operator costs one FLOP per output element; a reduction one per input element; data movement
(reshape, transpose, broadcast, slicing, gathers, converts) costs no FLOPs, only bytes.

Example:
    >>> op_flops("dot_general", [(8, 4), (4, 16)], [(8, 16)], {"dimension_numbers": (((1,), (0,)), ((), ()))})
    1024.0
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

Shape = tuple[int, ...]

# Elementwise arithmetic: one FLOP per output element.
ELEMENTWISE = frozenset(
    """
    add sub mul div rem pow max min neg sign floor ceil round abs exp exp2 log log1p expm1 tanh logistic sin cos tan
    asin acos atan atan2 sinh cosh asinh acosh atanh sqrt rsqrt cbrt integer_pow erf erfc erf_inv lgamma digamma
    igamma nextafter is_finite select_n clamp and or xor not eq ne lt le gt ge shift_left shift_right_logical
    shift_right_arithmetic add_any square reciprocal imag real conj complex population_count clz
    """.split()
)
# Reductions and scans: one FLOP per input element.
REDUCTIONS = frozenset(
    """
    reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or reduce_xor argmax argmin reduce_precision
    cumsum cumprod cummax cummin cumlogsumexp reduce_and
    """.split()
)
# Pure data movement and bookkeeping: no FLOPs.
DATA_MOVEMENT = frozenset(
    """
    reshape transpose broadcast_in_dim squeeze expand_dims slice dynamic_slice dynamic_update_slice gather pad
    concatenate rev convert_element_type bitcast_convert_type iota copy copy_p select_and_gather_add
    stop_gradient optimization_barrier device_put sharding_constraint mesh_cast split full_like
    random_bits random_seed random_wrap random_unwrap random_fold_in random_split threefry2x32
    pjit_sharding pvary name pipeline_boundary scan_slice scan_stack parameter output
    """.split()
)
# Windowed reductions: one FLOP per input element per window position (priced as output x window).
WINDOWED = frozenset(["reduce_window_sum", "reduce_window_max", "reduce_window_min", "reduce_window", "select_and_scatter_add"])
SCATTERS = frozenset(["scatter", "scatter-add", "scatter_add", "scatter_mul", "scatter_min", "scatter_max"])
SORTS = frozenset(["sort", "top_k", "approx_top_k"])
CONTRACTIONS = frozenset(["dot_general", "conv_general_dilated"])

KNOWN_PRIMITIVES = ELEMENTWISE | REDUCTIONS | DATA_MOVEMENT | WINDOWED | SCATTERS | SORTS | CONTRACTIONS


def _prod(xs: Sequence[int]) -> int:
    return math.prod(int(x) for x in xs)


def dot_general_flops(lhs: Shape, rhs: Shape, dimension_numbers) -> float:
    """2 x batch x lhs-free x rhs-free x contracting.

    >>> dot_general_flops((2, 8, 4), (2, 4, 16), (((2,), (1,)), ((0,), (0,))))  # 2 x 2 x 8 x 16 x 4
    2048.0
    """
    (lhs_contract, _rhs_contract), (lhs_batch, _rhs_batch) = dimension_numbers
    contract = _prod(lhs[d] for d in lhs_contract)
    lhs_free = _prod(lhs[d] for d in range(len(lhs)) if d not in lhs_contract and d not in lhs_batch)
    batch = _prod(lhs[d] for d in lhs_batch)
    rhs_used = set(_rhs_contract) | set(_rhs_batch)
    rhs_free = _prod(rhs[d] for d in range(len(rhs)) if d not in rhs_used)
    return 2.0 * batch * lhs_free * rhs_free * contract


def gemm_dims(primitive: str, in_shapes: Sequence[Shape], out_shapes: Sequence[Shape], params: Mapping[str, Any]
              ) -> tuple[int, int, int, float]:
    """(batch, m, n, k) of a contraction as the GEMM a library runs: batch x (m x k) @ (k x n).

    A convolution is its implicit GEMM: m the output positions, n the output features, k the rest.

    >>> gemm_dims("dot_general", [(2, 8, 4), (2, 4, 16)], [(2, 8, 16)], {"dimension_numbers": (((2,), (1,)), ((0,), (0,)))})
    (2, 8, 16, 4.0)
    """
    if primitive == "dot_general":
        lhs, rhs = in_shapes[0], in_shapes[1]
        (lc, rc), (lb, rb) = params["dimension_numbers"]
        batch = _prod(lhs[d] for d in lb)
        m = _prod(lhs[d] for d in range(len(lhs)) if d not in lc and d not in lb)
        n = _prod(rhs[d] for d in range(len(rhs)) if d not in rc and d not in rb)
        return int(batch), int(m), int(n), float(_prod(lhs[d] for d in lc))
    out = out_shapes[0] if out_shapes else ()
    elems = max(_prod(out), 1)
    dn = params.get("dimension_numbers")
    feat = 1
    if dn is not None and hasattr(dn, "out_spec") and out:
        feat = int(out[dn.out_spec[1]])
    flops = op_flops(primitive, in_shapes, out_shapes, params)
    return 1, int(elems // max(feat, 1)), int(feat), flops / (2.0 * elems)


def conv_flops(out: Shape, rhs: Shape, dimension_numbers) -> float:
    """2 x output elements x (kernel elements per output feature).

    Each output element is a dot product over the kernel's input features (already divided by the feature group
    count) and spatial window, so the count holds for grouped convolutions and for the weight-gradient convolutions
    that autodiff produces.

    >>> conv_flops((1, 8, 8, 16), (16, 3, 3, 3), None)  # NHWC out, OIHW kernel: 2*1024*27
    55296.0
    """
    out_feature_dim = 0
    if dimension_numbers is not None and hasattr(dimension_numbers, "rhs_spec"):
        out_feature_dim = dimension_numbers.rhs_spec[0]
    per_output = _prod(rhs) // max(int(rhs[out_feature_dim]), 1)
    return 2.0 * _prod(out) * per_output


def op_flops(primitive: str, in_shapes: Sequence[Shape], out_shapes: Sequence[Shape], params: Mapping[str, Any]) -> float:
    """FLOPs of one operator; 0 for data movement and unknown primitives."""
    out_elems = sum(_prod(s) for s in out_shapes)
    if primitive == "dot_general":
        return dot_general_flops(in_shapes[0], in_shapes[1], params["dimension_numbers"])
    if primitive == "conv_general_dilated":
        return conv_flops(out_shapes[0], in_shapes[1], params.get("dimension_numbers"))
    if primitive in ELEMENTWISE:
        return float(out_elems)
    if primitive in REDUCTIONS:
        return float(sum(_prod(s) for s in in_shapes[:1]))
    if primitive in WINDOWED:
        window = params.get("window_dimensions") or ()
        return float(out_elems * max(_prod(window), 1))
    if primitive in SCATTERS:
        return float(_prod(in_shapes[-1])) if in_shapes else 0.0  # one op per update element
    if primitive in SORTS:
        n = _prod(in_shapes[0]) if in_shapes else 0
        return float(n * max(math.log2(max(n, 2)), 1.0))
    return 0.0


def op_bytes(
    primitive: str,
    in_bytes: Sequence[int],
    out_bytes: Sequence[int],
) -> tuple[float, float]:
    """(bytes read, bytes written) of one operator, as a roofline model needs them.

    Gathers and dynamic slices read only what they return (plus indices), not the whole operand.
    """
    written = float(sum(out_bytes))
    if primitive in ("gather", "dynamic_slice", "scan_slice") and in_bytes:
        return written + float(sum(in_bytes[1:])), written
    if primitive in ("dynamic_update_slice",) and len(in_bytes) >= 2:
        return float(sum(in_bytes[1:])), float(in_bytes[1])
    if primitive in ("parameter", "output"):
        return 0.0, 0.0
    return float(sum(in_bytes)), written
