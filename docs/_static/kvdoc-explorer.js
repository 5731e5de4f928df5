/* kvdoc explorer: the offset causal mask beside the top-left mask, and one head stepping
 * through token-by-token K/V reuse. Runs in the reader's browser; fetches nothing.
 *
 * The pure functions at the top (offsetMask, topLeftMask, cachedSteps) carry no DOM code, so
 * tests/test_explorer.py evaluates them with node and compares them with kvdoc's masks
 * (kvdoc.core.mask, kvdoc.proofs.broken) and kvdoc.teach.worked. Everything below "DOM" only draws.
 */
(function () {
  "use strict";

  /* Which keys each new query may read: C rows, P + C columns; row i (absolute position P + i)
   * may read key j iff j <= P + i. Same rule as kvdoc.core.mask.offset_causal_mask. */
  function offsetMask(P, C) {
    checkLengths(P, C);
    var rows = [];
    for (var i = 0; i < C; i++) {
      var row = [];
      for (var j = 0; j < P + C; j++) row.push(j <= P + i);
      rows.push(row);
    }
    return rows;
  }

  /* The triangle aligned to the top-left corner (is_causal=True): row i may read key j iff
   * j <= i. Same rule as kvdoc.proofs.broken.top_left_causal_mask; wrong whenever P > 0. */
  function topLeftMask(P, C) {
    checkLengths(P, C);
    var rows = [];
    for (var i = 0; i < C; i++) {
      var row = [];
      for (var j = 0; j < P + C; j++) row.push(j <= i);
      rows.push(row);
    }
    return rows;
  }

  function checkLengths(P, C) {
    if (!Number.isInteger(P) || P < 0) throw new RangeError("P must be a non-negative integer");
    if (!Number.isInteger(C) || C < 1) throw new RangeError("C must be a positive integer");
  }

  function softmax(xs) {
    var m = Math.max.apply(null, xs);
    var e = xs.map(function (x) { return Math.exp(x - m); });
    var z = e.reduce(function (a, b) { return a + b; }, 0);
    return e.map(function (x) { return x / z; });
  }

  /* One head, d_head = 2, W_q = W_k = W_v = I: feed the inputs one at a time, keep K and V.
   * Returns, per step, the new query, the cache after appending, scores, weights, output. */
  function cachedSteps(inputs) {
    var K = [], V = [], steps = [];
    inputs.forEach(function (x, t) {
      if (x.length !== 2) throw new RangeError("every input must have 2 numbers");
      var q = [x[0], x[1]];
      K.push([x[0], x[1]]);
      V.push([x[0], x[1]]);
      var scores = K.map(function (k) { return (q[0] * k[0] + q[1] * k[1]) / Math.sqrt(2); });
      var w = softmax(scores);
      var out = [0, 0];
      w.forEach(function (wi, j) { out[0] += wi * V[j][0]; out[1] += wi * V[j][1]; });
      steps.push({ step: t, q: q, K: K.map(function (r) { return r.slice(); }),
                   V: V.map(function (r) { return r.slice(); }), scores: scores, weights: w, output: out });
    });
    return steps;
  }

  var api = { offsetMask: offsetMask, topLeftMask: topLeftMask, cachedSteps: cachedSteps, softmax: softmax };
  if (typeof module !== "undefined" && module.exports) module.exports = api;
  if (typeof document === "undefined") return;

  /* ---------------------------------- DOM ---------------------------------- */

  function el(tag, attrs, children) {
    var node = document.createElement(tag);
    Object.keys(attrs || {}).forEach(function (k) {
      if (k === "text") node.textContent = attrs[k]; else node.setAttribute(k, attrs[k]);
    });
    (children || []).forEach(function (c) { node.appendChild(c); });
    return node;
  }

  function fmt(x) { return x.toFixed(3); }

  function maskGrid(title, mask, P, other) {
    var C = mask.length, T = P + C;
    var table = el("table", { "class": "kvx-grid", "aria-label": title });
    var head = el("tr", {}, [el("th", { text: "query \\ key" })]);
    for (var j = 0; j < T; j++) head.appendChild(el("th", { text: String(j), "class": j < P ? "kvx-cached" : "" }));
    table.appendChild(head);
    for (var i = 0; i < C; i++) {
      var tr = el("tr", {}, [el("th", { text: "pos " + (P + i) })]);
      var n = 0;
      for (var k = 0; k < T; k++) {
        var on = mask[i][k];
        if (on) n++;
        var cls = on ? "kvx-on" : "kvx-off";
        if (on !== other[i][k]) cls += " kvx-diff";
        tr.appendChild(el("td", { "class": cls, text: on ? "\u2713" : "\u00b7",
                                  title: "query at position " + (P + i) + ", key " + k + ": " + (on ? "visible" : "hidden") }));
      }
      tr.appendChild(el("td", { "class": "kvx-count", text: n + (n === 1 ? " key" : " keys") }));
      table.appendChild(tr);
    }
    return el("figure", { "class": "kvx-mask" }, [el("figcaption", { text: title }), table]);
  }

  function buildMasks(root) {
    var pIn = el("input", { type: "range", min: "0", max: "12", value: "3", id: "kvx-p" });
    var cIn = el("input", { type: "range", min: "1", max: "6", value: "2", id: "kvx-c" });
    var pOut = el("output", { "for": "kvx-p" }), cOut = el("output", { "for": "kvx-c" });
    var note = el("p", { "class": "kvx-note" });
    var grids = el("div", { "class": "kvx-grids" });
    function draw() {
      var P = parseInt(pIn.value, 10), C = parseInt(cIn.value, 10);
      pOut.textContent = String(P); cOut.textContent = String(C);
      var off = offsetMask(P, C), tl = topLeftMask(P, C);
      grids.replaceChildren(maskGrid("offset mask (correct): key j visible iff j \u2264 P + i", off, P, tl),
                            maskGrid("top-left mask (is_causal=True): key j visible iff j \u2264 i", tl, P, off));
      var differ = 0;
      off.forEach(function (row, i) { row.forEach(function (v, j) { if (v !== tl[i][j]) differ++; }); });
      note.textContent = "Scores are " + C + " \u00d7 " + (P + C) + ". " +
        (P === 0 ? "No key comes from the cache." : "Keys 0.." + (P - 1) + " come from the cache.") +
        " Cells where the two masks disagree: " + differ +
        (differ ? " (highlighted)." : " (none: with P = 0 the two masks are the same).");
    }
    pIn.addEventListener("input", draw); cIn.addEventListener("input", draw);
    root.appendChild(el("div", { "class": "kvx-controls" }, [
      el("label", { "for": "kvx-p", text: "cached length P " }), pIn, pOut,
      el("label", { "for": "kvx-c", text: " new chunk length C " }), cIn, cOut]));
    root.appendChild(note);
    root.appendChild(grids);
    draw();
  }

  function rowsTable(caption, headers, rows) {
    var table = el("table", { "class": "kvx-step" }, [el("caption", { text: caption })]);
    table.appendChild(el("tr", {}, headers.map(function (h) { return el("th", { text: h }); })));
    rows.forEach(function (r) { table.appendChild(el("tr", {}, r.map(function (c) { return el("td", { text: c }); }))); });
    return table;
  }

  function buildStepper(root) {
    var inputs = [[1, 2], [3, 1], [2, 3], [4, 1]];
    var t = 0;
    var boxes = inputs.map(function (x, i) {
      return el("input", { type: "text", size: "7", value: x[0] + ", " + x[1], "aria-label": "x" + i });
    });
    var prev = el("button", { type: "button", text: "\u25c0 previous step" });
    var next = el("button", { type: "button", text: "next step \u25b6" });
    var out = el("div", { "class": "kvx-stepout", "aria-live": "polite" });
    function parse() {
      return boxes.map(function (b) {
        var v = b.value.split(",").map(function (s) { return parseFloat(s); });
        if (v.length !== 2 || v.some(function (n) { return !isFinite(n); })) throw new RangeError(b.value);
        return v;
      });
    }
    function draw() {
      var steps;
      try { steps = cachedSteps(parse()); } catch (e) {
        out.replaceChildren(el("p", { "class": "kvx-error", text: "Each x must be two numbers like 1, 2 (" + e.message + ")." }));
        return;
      }
      var s = steps[t];
      var cached = s.K.length - 1;
      out.replaceChildren(
        el("p", { text: "Step " + t + ": the new token is x" + t + " = [" + s.q.map(fmt).join(", ") + "]. It is projected once " +
          "(q = k = v = x" + t + "); " + cached + " K/V row" + (cached === 1 ? " is" : "s are") +
          " read from the cache, not recomputed, and 1 new row is appended." }),
        rowsTable("cache after this step (K = V here, since W_k = W_v = I)", ["position", "K", "V", "source"],
          s.K.map(function (k, j) {
            return ["" + j, "[" + k.map(fmt).join(", ") + "]", "[" + s.V[j].map(fmt).join(", ") + "]",
                    j < cached ? "cache (reused)" : "computed now"];
          })),
        rowsTable("the new query against every cached key", ["key", "score q\u00b7k/\u221a2", "weight"],
          s.scores.map(function (sc, j) { return ["" + j, fmt(sc), fmt(s.weights[j])]; })),
        el("p", { "class": "kvx-result", text: "output at step " + t + " = [" + s.output.map(fmt).join(", ") + "]" }));
      prev.disabled = t === 0; next.disabled = t === steps.length - 1;
    }
    prev.addEventListener("click", function () { t = Math.max(0, t - 1); draw(); });
    next.addEventListener("click", function () { t = Math.min(inputs.length - 1, t + 1); draw(); });
    boxes.forEach(function (b) { b.addEventListener("change", draw); });
    var inputsRow = el("div", { "class": "kvx-controls" }, [el("span", { text: "inputs: " })]);
    boxes.forEach(function (b, i) { inputsRow.appendChild(el("label", { text: " x" + i + " " })); inputsRow.appendChild(b); });
    root.appendChild(inputsRow);
    root.appendChild(el("div", { "class": "kvx-controls" }, [prev, next]));
    root.appendChild(out);
    draw();
  }

  function init() {
    var masks = document.getElementById("kvdoc-explorer-masks");
    if (masks && !masks.dataset.ready) { masks.dataset.ready = "1"; buildMasks(masks); }
    var stepper = document.getElementById("kvdoc-explorer-stepper");
    if (stepper && !stepper.dataset.ready) { stepper.dataset.ready = "1"; buildStepper(stepper); }
  }
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", init); else init();
})();
