// The operator graph view (anywidget): an overview strip of the model's layers (repeated ones collapsed) and, below
// it, one expanded layer's operators as a layered DAG with their names; zoom (wheel, buttons) and pan (drag) on the
// DAG; legends for the node colours and the edges; hover shows each node's and each resharded edge's details.
// Clicks go back to Python as {type: "click", key}; everything else about the graph is decided there.
import {
  FONT_PX, NODE_H, fitTransform, initialTransform, labelsVisible, layoutDag, overviewLayout, pathOf, structureKey,
  zoomAt,
} from "./model.js";

const SVG = "http://www.w3.org/2000/svg";
const OVERVIEW_H = 58;

function svgEl(name, attrs = {}, parent = null) {
  const e = document.createElementNS(SVG, name);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, String(v));
  if (parent) parent.appendChild(e);
  return e;
}

function div(cls, parent, text) {
  const e = document.createElement("div");
  e.className = cls;
  if (text !== undefined) e.textContent = text;
  if (parent) parent.appendChild(e);
  return e;
}

function button(label, title, parent, onClick) {
  const b = document.createElement("button");
  b.className = "apg-btn";
  b.textContent = label;
  b.title = title;
  b.addEventListener("click", onClick);
  parent.appendChild(b);
  return b;
}

function render({ model, el }) {
  const root = div("apg-root", el);
  const bar = div("apg-bar", root);
  const title = div("apg-title", bar);
  const tools = div("apg-tools", bar);
  const over = svgEl("svg", { class: "apg-overview", height: OVERVIEW_H }, root);
  const wrap = div("apg-detail-wrap", root);
  const detailTitle = div("apg-detail-title", wrap);
  const svg = svgEl("svg", { class: "apg-detail" }, wrap);
  const view = svgEl("g", { class: "apg-viewport" }, svg);
  const tip = div("apg-tip", root);
  const legends = div("apg-legends", root);
  const state = { t: { k: 1, x: 0, y: 0 }, layout: null, structure: null, frame: 0, drag: null, lastWidth: 0 };

  const applyTransform = () => {
    state.frame = 0;
    const { k, x, y } = state.t;
    view.setAttribute("transform", `translate(${x.toFixed(2)},${y.toFixed(2)}) scale(${k.toFixed(4)})`);
    root.classList.toggle("apg-nolabels", !labelsVisible(k));
    root.dataset.scale = k.toFixed(4);
  };
  const schedule = () => { if (!state.frame) state.frame = requestAnimationFrame(applyTransform); };
  const viewport = () => [svg.clientWidth || 600, svg.clientHeight || 400];
  const fit = () => {
    if (!state.layout) return;
    const [vw, vh] = viewport();
    state.t = fitTransform(state.layout.width, state.layout.height, vw, vh);
    schedule();
  };
  const zoomBy = (f, px, py) => {
    const [vw, vh] = viewport();
    state.t = zoomAt(state.t, f, px ?? vw / 2, py ?? vh / 2);
    schedule();
  };
  button("+", "zoom in", tools, () => zoomBy(1.25));
  button("\u2212", "zoom out", tools, () => zoomBy(0.8));
  button("fit", "show the whole layer", tools, fit);

  // --- tooltip --------------------------------------------------------------------------------------------------------
  const showTip = (text, ev) => {
    if (!text) return hideTip();
    tip.textContent = text;
    tip.style.display = "block";
    const r = root.getBoundingClientRect();
    const x = Math.min(ev.clientX - r.left + 14, Math.max(r.width - tip.offsetWidth - 4, 0));
    tip.style.left = `${x}px`;
    tip.style.top = `${ev.clientY - r.top + 14}px`;
  };
  const hideTip = () => { tip.style.display = "none"; };
  const hoverOf = (target) => {
    const g = target.closest && target.closest("[data-hover]");
    return g ? g.getAttribute("data-hover") : null;
  };
  for (const s of [over, svg]) {
    s.addEventListener("mousemove", (ev) => { if (!state.drag) showTip(hoverOf(ev.target), ev); });
    s.addEventListener("mouseleave", hideTip);
    s.addEventListener("click", (ev) => {
      const g = ev.target.closest && ev.target.closest("[data-key]");
      if (g && !(state.drag && state.drag.moved)) model.send({ type: "click", key: g.getAttribute("data-key") });
    });
  }

  // --- zoom and pan on the detail DAG ---------------------------------------------------------------------------------
  svg.addEventListener("wheel", (ev) => {
    ev.preventDefault();
    const r = svg.getBoundingClientRect();
    zoomBy(Math.exp(-ev.deltaY * 0.0015), ev.clientX - r.left, ev.clientY - r.top);
  }, { passive: false });
  svg.addEventListener("pointerdown", (ev) => {
    state.drag = { x: ev.clientX, y: ev.clientY, t: { ...state.t }, moved: false };
  });
  const onMove = (ev) => {
    const d = state.drag;
    if (!d) return;
    const dx = ev.clientX - d.x, dy = ev.clientY - d.y;
    if (Math.abs(dx) + Math.abs(dy) > 3) d.moved = true;
    if (d.moved) {
      state.t = { k: d.t.k, x: d.t.x + dx, y: d.t.y + dy };
      hideTip();
      schedule();
    }
  };
  // The click that ends a drag must not count as a click on a node: forget the drag only after it.
  const onUp = () => { setTimeout(() => { state.drag = null; }, 0); };
  window.addEventListener("pointermove", onMove);
  window.addEventListener("pointerup", onUp);
  svg.addEventListener("dblclick", fit);

  // --- drawing --------------------------------------------------------------------------------------------------------
  const drawOverview = (nodes) => {
    over.replaceChildren();
    const width = over.clientWidth || root.clientWidth || 600;
    state.lastWidth = width;
    const boxes = overviewLayout(nodes, width);
    const y = 14, h = 26;
    boxes.forEach((b, i) => {
      const n = nodes[i];
      if (i > 0) {
        const p = boxes[i - 1];
        svgEl("line", { x1: p.x + p.w, y1: y + h / 2, x2: b.x, y2: y + h / 2, class: "apg-chain" }, over);
      }
      const g = svgEl("g", { class: "apg-node apg-ov" + (n.selected ? " apg-selected" : "") +
                                    (n.expanded ? " apg-expanded" : "") + (n.count > 1 ? " apg-group" : ""),
                             "data-key": n.key, "data-hover": n.hover || n.label }, over);
      if (n.count > 1) {  // a second box peeking out behind: "many of these"
        svgEl("rect", { x: b.x + 3, y: y - 3, width: Math.max(b.w, 2), height: h, rx: 4, class: "apg-stack" }, g);
      }
      svgEl("rect", { x: b.x, y, width: Math.max(b.w, 2), height: h, rx: 4, fill: n.colour || "#888" }, g);
      if (b.showLabel) {
        const t = svgEl("text", { x: b.x + b.w / 2, y: y + h + 13, class: "apg-ov-label" }, g);
        t.textContent = n.label;
      }
      if (n.count > 1) {
        const t = svgEl("text", { x: b.x + b.w / 2, y: y + h / 2 + 4, class: "apg-badge" }, g);
        t.textContent = `\u00d7${n.count}`;
      }
    });
  };

  const drawDetail = (detail) => {
    view.replaceChildren();
    if (!detail || !detail.nodes || detail.nodes.length === 0) {
      wrap.classList.add("apg-empty");
      detailTitle.textContent = (detail && detail.title) || "click a layer to see its operators";
      state.layout = null;
      state.structure = null;
      root.dataset.nodes = "0";
      return;
    }
    wrap.classList.remove("apg-empty");
    detailTitle.textContent = detail.title || "";
    const key = structureKey(detail);
    const fresh = key !== state.structure;
    if (fresh) {
      const t0 = performance.now();
      state.layout = layoutDag(detail.nodes, detail.edges || []);
      root.dataset.layoutMs = (performance.now() - t0).toFixed(1);
      state.structure = key;
    }
    const L = state.layout;
    const edges = svgEl("g", { class: "apg-edges" }, view);
    const hot = svgEl("g", { class: "apg-edges apg-hot" }, view);
    (detail.edges || []).forEach((e, i) => {
      const pts = L.edges[i];
      if (!pts) return;
      const d = pathOf(pts);
      if (e.resharded) {
        const g = svgEl("g", { class: "apg-edge apg-resharded", "data-hover": e.hover || "" }, hot);
        svgEl("path", { d, class: "apg-hit" }, g);
        svgEl("path", { d, class: "apg-line", "marker-end": "url(#apg-arrow-hot)" }, g);
      } else {
        svgEl("path", { d, class: "apg-line", "marker-end": "url(#apg-arrow)" }, edges);
      }
    });
    const nodes = svgEl("g", { class: "apg-nodes" }, view);
    for (const n of detail.nodes) {
      const p = L.nodes[n.key];
      const g = svgEl("g", { class: "apg-node apg-op" + (n.selected ? " apg-selected" : "") +
                                    (n.pinned ? " apg-pinned" : ""),
                             "data-key": n.key, "data-hover": n.hover || n.label }, nodes);
      svgEl("rect", { x: p.x - p.w / 2, y: p.y - NODE_H / 2, width: p.w, height: NODE_H, rx: 4,
                      fill: n.colour || "#888" }, g);
      const t = svgEl("text", { x: p.x, y: p.y + FONT_PX / 2 - 2, class: "apg-op-label" }, g);
      t.textContent = n.label;
    }
    root.dataset.nodes = String(detail.nodes.length);
    if (fresh) {
      const [vw, vh] = viewport();
      state.t = initialTransform(L, vw, vh, detail.nodes[0].key);
    }
    schedule();
  };

  const drawLegends = (items) => {
    legends.replaceChildren();
    for (const lg of items || []) {
      const box = div("apg-legend", legends);
      div("apg-legend-title", box, lg.title);
      for (const it of lg.items || []) {
        const row = div("apg-legend-item" + (it.kind === "text" ? " apg-legend-text" : ""), box);
        if (it.kind !== "text") {  // a text item is words only: how to read what the hovers say
          const sw = div(it.kind === "line" ? "apg-swatch-line" : "apg-swatch", row);
          sw.style[it.kind === "line" ? "borderTopColor" : "background"] = it.colour;
          if (it.kind === "line" && it.width) sw.style.borderTopWidth = `${it.width}px`;
        }
        div("apg-legend-label", row, it.label);
      }
    }
  };

  // Arrow heads, once.
  const defs = svgEl("defs", {}, svg);
  for (const [id, cls] of [["apg-arrow", "apg-arrowhead"], ["apg-arrow-hot", "apg-arrowhead apg-arrowhead-hot"]]) {
    const m = svgEl("marker", { id, viewBox: "0 0 10 10", refX: 9, refY: 5, markerWidth: 6, markerHeight: 6,
                                orient: "auto-start-reverse" }, defs);
    svgEl("path", { d: "M0,0L10,5L0,10z", class: cls }, m);
  }

  const redraw = () => {
    const data = model.get("data") || {};
    title.textContent = data.title || "";
    wrap.style.height = `${model.get("height") || 420}px`;
    drawOverview(data.overview || []);
    drawDetail(data.detail);
    drawLegends(data.legends);
    root.dataset.rendered = String((Number(root.dataset.rendered) || 0) + 1);
  };
  model.on("change:data", redraw);
  model.on("change:height", redraw);
  // The strip is laid out for its width: draw it again when the notebook's width changes. The width also goes back
  // to Python (once it settles), which sizes the workbench's full-width figures to it.
  let widthTimer = 0;
  let sentWidth = -1;
  const ro = typeof ResizeObserver !== "undefined" ? new ResizeObserver(() => {
    if (Math.abs((over.clientWidth || 0) - state.lastWidth) > 2) drawOverview((model.get("data") || {}).overview || []);
    const w = root.clientWidth;
    if (w > 0 && Math.abs(w - sentWidth) > 4) {
      clearTimeout(widthTimer);
      widthTimer = setTimeout(() => { sentWidth = w; model.send({ type: "width", px: w }); }, 150);
    }
  }) : null;
  if (ro) ro.observe(root);
  requestAnimationFrame(redraw);
  redraw();
  return () => {
    clearTimeout(widthTimer);
    if (ro) ro.disconnect();
    window.removeEventListener("pointermove", onMove);
    window.removeEventListener("pointerup", onUp);
    model.off("change:data", redraw);
    model.off("change:height", redraw);
  };
}

export default { render };
