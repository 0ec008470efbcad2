// Pure layout and view arithmetic of the operator graph (no DOM): what index.js draws, and what the tests check.
//
// The graph arrives from Python (autopar_lab/widgets/views/graph.py) as {overview, detail, legends, ...}:
// - overview: the model's layers left to right, repeated layers collapsed into one group node ("layer_0..23 x24");
// - detail: the operators of one expanded layer with the edges between them, laid out here as a layered DAG by dagre.
import dagre from "@dagrejs/dagre";

export const NODE_H = 22;
export const CHAR_W = 6.6; // average glyph width of the 11px label font
export const PAD_X = 10;
export const MIN_LABEL_PX = 7; // operator names show once the zoom makes their font at least this many pixels tall
export const FONT_PX = 11;

/** Width of a box holding `label`. */
export function boxWidth(label) {
  return Math.max(36, Math.ceil(String(label || "").length * CHAR_W) + 2 * PAD_X);
}

/**
 * A layered (Sugiyama) layout of the detail DAG, top to bottom.
 * nodes: [{key, label}], edges: [{source, target, layout}]. Returns {nodes: {key: {x, y, w, h}},
 * edges: [[{x, y}...] or null], width, height}; x, y are box centres. Edges with `layout: false` do not shape the
 * layout (an edge spanning many ranks adds a dummy node per rank, and those make dagre slow); they are drawn straight
 * from one box to the other. Edges whose ends are not both in `nodes` are left out (null).
 */
export function layoutDag(nodes, edges, opts = {}) {
  const g = new dagre.graphlib.Graph({ multigraph: true });
  // "tight-tree" ranks as well as the default here and is a third faster on 500-operator layers.
  g.setGraph({ rankdir: opts.rankdir || "TB", nodesep: opts.nodesep ?? 14, ranksep: opts.ranksep ?? 28,
               marginx: 8, marginy: 8, ranker: opts.ranker || "tight-tree" });
  g.setDefaultEdgeLabel(() => ({}));
  for (const n of nodes) g.setNode(n.key, { width: boxWidth(n.label), height: NODE_H });
  const laid = [];
  const straight = [];
  edges.forEach((e, i) => {
    if (!g.hasNode(e.source) || !g.hasNode(e.target) || e.source === e.target) return;
    if (e.layout === false) {
      straight.push(i);
    } else {
      g.setEdge(e.source, e.target, {}, String(i));
      laid.push(i);
    }
  });
  dagre.layout(g);
  const out = { nodes: {}, edges: new Array(edges.length).fill(null) };
  for (const n of nodes) {
    const p = g.node(n.key);
    out.nodes[n.key] = { x: p.x, y: p.y, w: p.width, h: p.height };
  }
  for (const i of laid) {
    const e = edges[i];
    out.edges[i] = g.edge(e.source, e.target, String(i)).points.map((p) => ({ x: p.x, y: p.y }));
  }
  for (const i of straight) {
    const a = out.nodes[edges[i].source], b = out.nodes[edges[i].target];
    const down = b.y >= a.y ? 1 : -1;
    out.edges[i] = [{ x: a.x, y: a.y + (down * a.h) / 2 }, { x: b.x, y: b.y - (down * b.h) / 2 }];
  }
  const gg = g.graph();
  out.width = gg.width || 0;
  out.height = gg.height || 0;
  return out;
}

/**
 * Which of `n` evenly spaced labels to draw in `width` pixels so none overlap: every k-th (always the first and the
 * last), where each label needs `labelPx` pixels. Returns the indices.
 */
export function sparseLabels(n, width, labelPx) {
  if (n <= 0) return [];
  const slot = width / n;
  const k = Math.max(1, Math.ceil(labelPx / Math.max(slot, 1e-9)));
  const out = [];
  for (let i = 0; i < n; i += k) out.push(i);
  if (out[out.length - 1] !== n - 1) {
    // the last one, unless it would overlap the one before it: then it replaces that one
    if (out.length > 1 && (n - 1 - out[out.length - 1]) < k) out.pop();
    out.push(n - 1);
  }
  return out;
}

/**
 * The overview strip: nodes [{key, label, count, selected, expanded}] placed left to right in `width` pixels, a group's
 * box wider by its member count (up to 3 slots). Returns [{key, x, w, showLabel}] with x the box's left edge. The
 * selected or expanded node is always named; a neighbour's label it would overlap gives way.
 */
export function overviewLayout(nodes, width, gap = 6) {
  const weights = nodes.map((n) => (n.count > 1 ? Math.min(3, 1 + Math.log2(n.count) / 2) : 1));
  const total = weights.reduce((a, b) => a + b, 0) || 1;
  const usable = Math.max(width - gap * (nodes.length + 1), nodes.length);
  let x = gap;
  const out = nodes.map((n, i) => {
    const w = (usable * weights[i]) / total;
    const box = { key: n.key, x, w, showLabel: false };
    x += w + gap;
    return box;
  });
  // Labels that fit their box are drawn; the others are drawn every k-th (hover names them all).
  const fits = out.map((b, i) => boxWidth(nodes[i].label) <= b.w + gap);
  if (fits.every(Boolean)) {
    out.forEach((b) => { b.showLabel = true; });
  } else {
    const widest = Math.max(...nodes.map((n) => boxWidth(n.label)));
    for (const i of sparseLabels(nodes.length, width, widest)) out[i].showLabel = true;
    out.forEach((b, i) => { if (nodes[i].count > 1 && fits[i]) b.showLabel = true; });
  }
  const centre = (i) => out[i].x + out[i].w / 2;
  nodes.forEach((n, i) => {
    if (!(n.selected || n.expanded)) return;
    out[i].showLabel = true;
    out.forEach((o, j) => {
      const mine = nodes[j].selected || nodes[j].expanded;
      if (j !== i && !mine && o.showLabel &&
          Math.abs(centre(j) - centre(i)) < (boxWidth(n.label) + boxWidth(nodes[j].label)) / 2) {
        o.showLabel = false;
      }
    });
  });
  return out;
}

/** The transform {k, x, y} that fits a `w` x `h` drawing into a `vw` x `vh` viewport (never above `maxK`). */
export function fitTransform(w, h, vw, vh, maxK = 1.5) {
  if (!(w > 0) || !(h > 0)) return { k: 1, x: 0, y: 0 };
  const k = Math.min(maxK, (vw - 16) / w, (vh - 16) / h);
  return { k, x: (vw - w * k) / 2, y: Math.max(8, (vh - h * k) / 2) };
}

/**
 * Where the view of a freshly expanded layer starts: the whole drawing when its names are legible that way; else at
 * a legible scale `k`, with the box `focus` (the layer's first operator: where its data comes in) at the top centre.
 */
export function initialTransform(layout, vw, vh, focus, k = 0.9, top = 12) {
  const fit = fitTransform(layout.width, layout.height, vw, vh);
  if (labelsVisible(fit.k)) return fit;
  const b = layout.nodes[focus] || Object.values(layout.nodes)[0];
  if (!b) return fit;
  // `top` pixels down from the top of the drawing (the pane's caption sits above it).
  return { k, x: vw / 2 - b.x * k, y: top - (b.y - NODE_H / 2) * k };
}

/** `t` zoomed by `factor` about the viewport point (px, py), the scale kept within [minK, maxK]. */
export function zoomAt(t, factor, px, py, minK = 0.02, maxK = 8) {
  const k = Math.min(maxK, Math.max(minK, t.k * factor));
  const f = k / t.k;
  return { k, x: px - (px - t.x) * f, y: py - (py - t.y) * f };
}

/** Whether operator names are legible at scale `k` (see MIN_LABEL_PX). */
export function labelsVisible(k) {
  return k * FONT_PX >= MIN_LABEL_PX;
}

/** A key that changes only when the detail DAG's structure does (a new layout is needed only then). */
export function structureKey(detail) {
  if (!detail || !detail.nodes) return "";
  const n = detail.nodes.map((x) => x.key + ":" + x.label).join("|");
  const e = (detail.edges || []).map((x) => x.source + ">" + x.target).join("|");
  return n + "#" + e;
}

/** SVG path text through `points` (a polyline; dagre's points already bend around the ranks). */
export function pathOf(points) {
  if (!points || points.length === 0) return "";
  return points.map((p, i) => (i ? "L" : "M") + p.x.toFixed(1) + "," + p.y.toFixed(1)).join("");
}
