// node --test: the graph view's layout and view arithmetic (src/model.js), without a browser.
import { test } from "node:test";
import assert from "node:assert/strict";
import {
  NODE_H, boxWidth, fitTransform, initialTransform, labelsVisible, layoutDag, overviewLayout, pathOf, sparseLabels, structureKey,
  zoomAt,
} from "../src/model.js";

// A layer-like DAG: `n` operators in a chain with a skip edge every 3 (residual connections), plus fan-outs.
function layerDag(n) {
  const nodes = [];
  const edges = [];
  for (let i = 0; i < n; i++) nodes.push({ key: `O:${i}`, label: i % 5 ? "add" : "dot_general" });
  for (let i = 1; i < n; i++) {
    edges.push({ source: `O:${i - 1}`, target: `O:${i}` });
    if (i >= 3 && i % 3 === 0) edges.push({ source: `O:${i - 3}`, target: `O:${i}` });
  }
  return { nodes, edges };
}

test("a layered layout puts every edge's head below its tail and keeps boxes apart", () => {
  const { nodes, edges } = layerDag(40);
  const L = layoutDag(nodes, edges);
  for (const e of edges) assert.ok(L.nodes[e.target].y > L.nodes[e.source].y, `${e.source} -> ${e.target}`);
  const boxes = Object.values(L.nodes);
  for (let i = 0; i < boxes.length; i++) {
    for (let j = i + 1; j < boxes.length; j++) {
      const a = boxes[i], b = boxes[j];
      const apart = Math.abs(a.x - b.x) >= (a.w + b.w) / 2 - 0.5 || Math.abs(a.y - b.y) >= NODE_H - 0.5;
      assert.ok(apart, `boxes ${i} and ${j} overlap`);
    }
  }
  assert.equal(L.edges.filter(Boolean).length, edges.length);
  for (const [i, pts] of L.edges.entries()) {
    const e = edges[i];
    assert.ok(Math.abs(pts[0].y - L.nodes[e.source].y) <= NODE_H / 2 + 1e-6);
    assert.ok(Math.abs(pts[pts.length - 1].y - L.nodes[e.target].y) <= NODE_H / 2 + 1e-6);
  }
  assert.ok(L.width > 0 && L.height >= 39 * NODE_H);
});

test("a box is wide enough for its name", () => {
  const L = layoutDag([{ key: "a", label: "dynamic_update_slice" }], []);
  assert.ok(L.nodes.a.w >= boxWidth("dynamic_update_slice") && boxWidth("dynamic_update_slice") > boxWidth("add"));
});

test("edges to nodes outside the drawing are left out, not drawn to nowhere", () => {
  const L = layoutDag([{ key: "a", label: "a" }, { key: "b", label: "b" }],
                     [{ source: "a", target: "b" }, { source: "x", target: "b" }, { source: "a", target: "a" }]);
  assert.ok(L.edges[0] && L.edges[1] === null && L.edges[2] === null);
});

test("500 operators lay out in well under a second", () => {
  const { nodes, edges } = layerDag(514);
  const t0 = performance.now();
  const L = layoutDag(nodes, edges);
  const ms = performance.now() - t0;
  assert.equal(Object.keys(L.nodes).length, 514);
  assert.ok(ms < 5000, `layout took ${ms} ms`);  // a bound a slow shared CI runner meets; ~100 ms on a laptop
});

test("sparse labels never overlap and always name the first and the last", () => {
  for (const [n, width, px] of [[26, 600, 70], [26, 2000, 70], [3, 100, 200], [1, 10, 50], [100, 500, 40]]) {
    const idx = sparseLabels(n, width, px);
    assert.equal(idx[0], 0);
    assert.equal(idx[idx.length - 1], n - 1);
    const slot = width / n;
    for (let i = 1; i < idx.length; i++) assert.ok((idx[i] - idx[i - 1]) * slot >= px - 1e-9 || n * slot < 2 * px,
                                                   `labels ${idx[i - 1]} and ${idx[i]} overlap`);
  }
  assert.deepEqual(sparseLabels(26, 2600, 70), [...Array(26).keys()]);  // room for all: all
  assert.deepEqual(sparseLabels(0, 100, 10), []);
});

test("the overview fits its width, gives groups more room, and labels what fits", () => {
  const nodes = [{ key: "L:embed", label: "embed" },
                 { key: "G:0", label: "layer_0..layer_11", count: 12 },
                 { key: "G:1", label: "layer_12..layer_23", count: 12 },
                 { key: "L:head", label: "head" }];
  const boxes = overviewLayout(nodes, 800);
  const last = boxes[boxes.length - 1];
  assert.ok(last.x + last.w <= 800 + 1e-6);
  assert.ok(boxes[1].w > boxes[0].w);
  assert.ok(boxes.every((b) => b.showLabel));
  // 26 single layers in 600 px: not every label fits; those drawn are spaced and include both ends.
  const many = Array.from({ length: 26 }, (_, i) => ({ key: `L:${i}`, label: `layer_${i}` }));
  const shown = overviewLayout(many, 600).map((b, i) => (b.showLabel ? i : -1)).filter((i) => i >= 0);
  assert.ok(shown.length < 26 && shown.length >= 2 && shown[0] === 0 && shown[shown.length - 1] === 25);
});

test("the selected layer of the overview is always named, and no drawn label overlaps it", () => {
  const many = Array.from({ length: 26 }, (_, i) => ({ key: `L:${i}`, label: `layer_${i}` }));
  const plain = overviewLayout(many, 600);
  const hidden = plain.findIndex((b) => !b.showLabel);  // a layer the sparse labelling leaves unnamed
  assert.ok(hidden > 0);
  for (const flag of ["selected", "expanded"]) {
    const nodes = many.map((n, i) => (i === hidden ? { ...n, [flag]: true } : n));
    const boxes = overviewLayout(nodes, 600);
    assert.ok(boxes[hidden].showLabel, `the ${flag} layer is named`);
    const centre = (b) => b.x + b.w / 2;
    const half = (i) => boxWidth(nodes[i].label) / 2;
    for (const [j, b] of boxes.entries()) {
      if (j === hidden || !b.showLabel) continue;
      assert.ok(Math.abs(centre(b) - centre(boxes[hidden])) >= half(j) + half(hidden), `label ${j} overlaps`);
    }
    assert.ok(boxes.filter((b) => b.showLabel).length >= 3);  // the others still named every k-th
  }
});

test("fit, zoom about a point, and the label threshold", () => {
  const t = fitTransform(1000, 2000, 500, 400);
  assert.ok(1000 * t.k <= 500 && 2000 * t.k <= 400);
  const z = zoomAt({ k: 1, x: 10, y: 20 }, 2, 100, 100);
  // The point under the cursor stays put: (100 - x) / k before = after.
  assert.equal((100 - 10) / 1, (100 - z.x) / z.k);
  assert.equal((100 - 20) / 1, (100 - z.y) / z.k);
  assert.equal(zoomAt({ k: 1, x: 0, y: 0 }, 1e9, 0, 0).k, 8);
  assert.ok(labelsVisible(1) && !labelsVisible(0.2));
});

test("the structure key ignores colours and selection", () => {
  const a = { nodes: [{ key: "O:1", label: "add", colour: "#f00" }], edges: [] };
  const b = { nodes: [{ key: "O:1", label: "add", colour: "#0f0", selected: true }], edges: [] };
  const c = { nodes: [{ key: "O:2", label: "add" }], edges: [] };
  assert.equal(structureKey(a), structureKey(b));
  assert.notEqual(structureKey(a), structureKey(c));
  assert.equal(pathOf([{ x: 0, y: 0 }, { x: 1.25, y: 2 }]), "M0.0,0.0L1.3,2.0");
});

test("edges marked layout:false do not move the boxes and are drawn straight", () => {
  const nodes = [{ key: "a", label: "a" }, { key: "b", label: "b" }, { key: "c", label: "c" }];
  const chain = [{ source: "a", target: "b" }, { source: "b", target: "c" }];
  const base = layoutDag(nodes, chain);
  const more = layoutDag(nodes, [...chain, { source: "a", target: "c", layout: false }]);
  for (const k of ["a", "b", "c"]) assert.deepEqual(more.nodes[k], base.nodes[k]);
  const pts = more.edges[2];
  assert.equal(pts.length, 2);
  assert.equal(pts[0].y, base.nodes.a.y + NODE_H / 2);
  assert.equal(pts[1].y, base.nodes.c.y - NODE_H / 2);
});

test("a big layer opens legible, on its first operator; a small one whole", () => {
  const { nodes, edges } = layerDag(300);
  const L = layoutDag(nodes, edges);
  const t = initialTransform(L, 800, 400, "O:0");
  assert.ok(labelsVisible(t.k));
  const b = L.nodes["O:0"];
  assert.ok(Math.abs(t.y + (b.y - NODE_H / 2) * t.k - 12) < 1e-9);  // its top edge just inside the drawing
  assert.ok(Math.abs(t.x + b.x * t.k - 400) < 1e-9);  // centred
  const small = layoutDag(nodes.slice(0, 3), edges.slice(0, 2));
  assert.deepEqual(initialTransform(small, 800, 400, "O:0"), fitTransform(small.width, small.height, 800, 400));
});
