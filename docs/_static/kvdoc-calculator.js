/* kvdoc memory calculator: K/V cache bytes of a published model or of sizes you type, per token,
 * per sequence, for a batch, and how many sequences fit in a memory. Runs in the reader's
 * browser; fetches nothing. The presets and element sizes come from the page itself (a JSON
 * block written at build time from kvdoc.measure.memory.calculator_data, with the lines and
 * sizes `python -m kvdoc memory` prints of each model).
 *
 * A model is { name, kind, context, groups, all_attention }, each group [perToken, window,
 * state, count, state32, indexer, rate, entry, buffer, overlap, what]: `count` layers that each
 * add `perToken` elements a position (`what`: K/V, latent or K = V), keep at most `window`
 * positions (null: all), hold `state` elements (and `state32` FP32 ones) whatever the length,
 * `indexer` keys a position (or an entry), and with a `rate`, an `entry` a block of `rate`
 * positions, `buffer` a position of the unfinished block and `overlap` once a block is done
 * (kvdoc.measure.layer_caches.LayerCache). `all_attention` is the groups of the same layers all
 * full attention (null for a plain model). The pure functions at the top carry no DOM code;
 * tests/test_calculator.py evaluates them with node against
 * kvdoc.measure.model_caches.ModelCache for every preset.
 */
(function () {
  "use strict";

  function checkCount(name, value, min) {
    if (!Number.isSafeInteger(value) || value < min) {
      throw new RangeError(name + " must be an integer of at least " + min + ", got " + value);
    }
    return value;
  }

  /* The model of a plain or windowed decoder: L layers of 2 x H_kv x D elements a position. */
  function customModel(layers, kvHeads, headDim, window) {
    checkCount("layers", layers, 1);
    checkCount("K/V heads", kvHeads, 1);
    checkCount("head size", headDim, 1);
    if (window !== null) checkCount("window", window, 1);
    return { name: "custom", kind: window === null ? "plain" : "windowed", context: null,
             groups: [[2 * kvHeads * headDim, window, 0, layers, 0, 0, 0, 0, 0, 0, "K/V"]],
             all_attention: null };
  }

  /* One layer's elements of each term after T positions, in LayerCache.parts' order. */
  function groupParts(g, T) {
    var held = g[1] === null ? T : Math.min(T, g[1]), rate = g[6];
    var entries = rate ? Math.floor(T / rate) : 0;
    return [[g[10], g[0] * held], ["indexer keys", g[5] * (rate ? entries : T)],
            ["compressed entries", g[7] * entries],
            ["block buffer", rate ? g[8] * (T % rate) + (T >= rate ? g[9] : 0) : 0],
            ["state", g[2]], ["state (FP32)", g[4]]];
  }

  /* Bytes of `batch` sequences of T positions by term, [name, bytes] in order of first
   * appearance, the nonzero ones: `s` bytes an element, 4 for the FP32 state. */
  function partBytes(model, batch, T, s) {
    checkCount("length", T, 0);
    checkCount("batch", batch, 1);
    checkCount("element size", s, 1);
    var names = [], total = {};
    model.groups.forEach(function (g) {
      groupParts(g, T).forEach(function (p) {
        if (!p[1]) return;
        if (!(p[0] in total)) { names.push(p[0]); total[p[0]] = 0; }
        total[p[0]] += g[3] * p[1];
      });
    });
    return names.map(function (name) {
      return [name, checkCount("bytes (too large to count exactly)",
                               batch * (name === "state (FP32)" ? 4 : s) * total[name], 0)];
    });
  }

  /* Elements one sequence of T positions keeps in the cache's dtype (all but the FP32 state). */
  function sequenceElements(model, T) {
    var total = 0;
    partBytes(model, 1, T, 1).forEach(function (p) { if (p[0] !== "state (FP32)") total += p[1]; });
    return checkCount("elements", total, 0);
  }

  /* Bytes of `batch` sequences of T positions, `s` bytes an element. */
  function cacheBytes(model, batch, T, s) {
    var total = 0;
    partBytes(model, batch, T, s).forEach(function (p) { total += p[1]; });
    return checkCount("bytes (too large to count exactly)", total, 0);
  }

  /* The same layers, every one full attention of the model's own sizes (null: a plain model). */
  function allAttention(model) {
    return model.all_attention === null ? null :
      { name: model.name + ", all attention", kind: "plain", context: model.context,
        groups: model.all_attention, all_attention: null };
  }

  /* Bytes one more position adds to a sequence while it is inside every window; with
   * `pastWindows`, once it is past them all, when only the full layers grow. */
  function bytesPerToken(model, s, pastWindows) {
    var n = 0;
    model.groups.forEach(function (g) {
      n += g[3] * ((pastWindows && g[1] !== null ? 0 : g[0]) + (g[6] ? 0 : g[5]));
    });
    return checkCount("bytes", n * checkCount("element size", s, 1), 0);
  }

  /* Bytes a sequence holds whatever its length (the states; a recurrent one in FP32). */
  function fixedBytes(model, s) {
    return cacheBytes(model, 1, 0, s);
  }

  /* How many sequences of T positions fit in `memory` bytes. */
  function sequencesThatFit(model, T, s, memory) {
    checkCount("memory", memory, 1);
    var one = cacheBytes(model, 1, T, s);
    if (one === 0) throw new RangeError("an empty cache: every count of sequences fits");
    return Math.floor(memory / one);
  }

  /* Binary units as kvdoc.measure.kv_bytes.binary_size prints them: 3 decimals, rounded
   * half to even (Python's format of the exact quotient n / 1024^k), trailing zeros dropped. */
  function binarySize(n) {
    checkCount("byte count", n, 0);
    var units = ["bytes", "KiB", "MiB", "GiB", "TiB", "PiB"], power = 0;
    while (power + 1 < units.length && n >= Math.pow(1024, power + 1)) power++;
    if (power === 0) return n.toLocaleString("en-US") + " bytes";
    var den = BigInt(1024) ** BigInt(power), num = BigInt(n) * BigInt(1000);
    var m = num / den, twice = (num % den) * BigInt(2);
    if (twice > den || (twice === den && m % BigInt(2) === BigInt(1))) m += BigInt(1);
    var whole = m / BigInt(1000), frac = (m % BigInt(1000)).toString().padStart(3, "0");
    frac = frac.replace(/0+$/, "");
    return whole.toLocaleString("en-US") + (frac ? "." + frac : "") + " " + units[power];
  }

  var api = { customModel: customModel, sequenceElements: sequenceElements, cacheBytes: cacheBytes,
              partBytes: partBytes, allAttention: allAttention,
              bytesPerToken: bytesPerToken, fixedBytes: fixedBytes,
              sequencesThatFit: sequencesThatFit, binarySize: binarySize };
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

  function field(label, input) {
    return el("label", { "class": "kvc-field" }, [el("span", { text: label }), input]);
  }

  function build(root, data) {
    var models = data.presets;
    var pick = el("select", { id: "kvc-model" });
    pick.appendChild(el("option", { value: "", text: "custom sizes (type them below)" }));
    models.forEach(function (m, i) {
      pick.appendChild(el("option", { value: "" + i, text: m.name + " (" + m.kind + ")" }));
    });
    var dtype = el("select", { id: "kvc-dtype" });
    Object.keys(data.element_bytes).forEach(function (name) {
      dtype.appendChild(el("option", { value: name, text: name + " (" + data.element_bytes[name] + " B)" }));
    });
    dtype.value = "bfloat16";
    function num(id, value) { return el("input", { type: "number", min: "1", step: "1", value: value, id: id }); }
    var L = num("kvc-layers", "32"), H = num("kvc-kv-heads", "8"), D = num("kvc-head-dim", "128");
    var W = el("input", { type: "number", min: "1", step: "1", placeholder: "none", id: "kvc-window" });
    var B = num("kvc-batch", "1"), T = num("kvc-length", "8192"), M = num("kvc-memory", "80");
    var G = el("input", { type: "number", min: "0", step: "any", placeholder: "not counted",
                          id: "kvc-weights" });
    var custom = el("fieldset", { "class": "kvc-custom" }, [el("legend", { text: "sizes" }),
      field("layers L", L), field("K/V heads H_kv", H), field("head size D", D), field("window W", W)]);
    var out = el("div", { "class": "kvc-out", "aria-live": "polite", id: "kvc-out" });

    function integer(input, name) {
      var v = Number(input.value);
      if (input.value.trim() === "" || !Number.isInteger(v)) throw new RangeError(name + " must be a whole number");
      return v;
    }
    function current() {
      if (pick.value === "") {
        return customModel(integer(L, "layers"), integer(H, "K/V heads"), integer(D, "head size"),
                           W.value.trim() === "" ? null : integer(W, "window"));
      }
      return models[Number(pick.value)];
    }
    /* A preset fills the boxes with its own sizes (greyed) and its weights, whose exact
     * bytes stand for the shown GiB until the reader edits them. */
    function fill(m) {
      T.value = "" + m.context;
      [L, H, D, W].forEach(function (box, i) { box.value = m.sizes[i] === null ? "" : "" + m.sizes[i]; });
      H.placeholder = D.placeholder = m.sizes[1] === null ? "none: a latent" : "";
      G.value = m.weights === null ? "" : (m.weights / Math.pow(2, 30)).toFixed(3);
      G.dataset.shown = G.value;
      G.dataset.bytes = m.weights === null ? "" : "" + m.weights;
    }
    function weightBytes() {
      if (G.value.trim() === "") return 0;
      if (G.value === G.dataset.shown && G.dataset.bytes) return Number(G.dataset.bytes);
      var gib = Number(G.value);
      if (!(gib >= 0)) throw new RangeError("weights must be a number of GiB, 0 or more");
      return Math.floor(gib * Math.pow(2, 30));
    }
    function bytes(n) { return n.toLocaleString("en-US") + " (" + binarySize(n) + ")"; }
    function draw() {
      custom.disabled = pick.value !== "";
      var rows;
      try {
        var m = current(), s = data.element_bytes[dtype.value];
        var b = integer(B, "batch"), t = integer(T, "context"), mem = Number(M.value);
        if (!(mem > 0)) throw new RangeError("memory must be a positive number of GiB");
        var memBytes = Math.floor(mem * Math.pow(2, 30)), weights = weightBytes();
        if (weights >= memBytes) {
          throw new RangeError("the weights (" + binarySize(weights) + ") leave nothing of the " + mem + " GiB");
        }
        var perSeq = cacheBytes(m, 1, t, s), total = cacheBytes(m, b, t, s);
        var windows = m.groups.filter(function (g) { return g[1] !== null; }).map(function (g) { return g[1]; });
        rows = (m.layers || []).map(function (line) { return ["layers", line]; });
        rows.push([windows.length ? "bytes per token, inside every window" : "bytes per token", bytes(bytesPerToken(m, s))]);
        if (windows.length) {
          rows.push(["bytes per token past every window (T > " + Math.max.apply(null, windows).toLocaleString("en-US") + ")",
                     bytes(bytesPerToken(m, s, true))]);
        }
        rows.push(["per sequence of " + t.toLocaleString("en-US"), bytes(perSeq)]);
        if (b > 1) rows.push(["batch of " + b, bytes(total)]);
        var full = allAttention(m);
        if (full !== null) {  /* each term apart, then the same layers all full attention */
          partBytes(m, b, t, s).forEach(function (p) {
            rows.push(["part: " + p[0] + (p[0].startsWith("state") ? " (constant in T)" : ""),
                       bytes(p[1])]);
          });
          rows.push(["all attention, the same " + m.sizes[0] + " layers", bytes(cacheBytes(full, b, t, s))]);
        }
        if (fixedBytes(m, s)) rows.push(["fixed state per sequence (constant in T)", bytes(fixedBytes(m, s))]);
        rows.push(["sequences that fit in " + mem + " GiB" + (weights ? ", after " + binarySize(weights) + " of weights" : " (weights not counted)"),
                   perSeq === 0 ? "any number" : sequencesThatFit(m, t, s, memBytes - weights).toLocaleString("en-US")]);
        var notes = [];
        if (m.context !== null && t > m.context) notes.push("Past the model's context of " + m.context.toLocaleString("en-US") + " tokens.");
        if (m.note) notes.push(m.note[0].toUpperCase() + m.note.slice(1) + ".");
        if (m.parameters) {
          notes.push("Weights: " + m.parameters.toLocaleString("en-US") + " parameters (counted from " +
                     "the config's sizes) in bfloat16, unless you type another size.");
        } else if (m.parameters === null) notes.push("Weights: not listed for this model; type their GiB.");
        if (m.source) notes.push("Source: " + m.source);
        out.replaceChildren(el("table", { "class": "kvc-table" }, rows.map(function (r) {
          return el("tr", {}, [el("th", { text: r[0] }), el("td", { text: r[1] })]);
        })), el("p", { "class": "kvc-note", text: notes.join(" ") }));
      } catch (e) {
        out.replaceChildren(el("p", { "class": "kvc-error", text: e.message }));
      }
    }
    pick.addEventListener("change", function () {
      if (pick.value !== "") fill(models[Number(pick.value)]);
      draw();
    });
    [dtype, L, H, D, W, B, T, M, G].forEach(function (x) { x.addEventListener("input", draw); });
    var first = models.findIndex(function (m) { return m.name === data.initial; });
    if (first >= 0) { pick.value = "" + first; fill(models[first]); }
    root.replaceChildren(
      el("div", { "class": "kvc-row" }, [field("model", pick), field("dtype", dtype)]),
      custom,
      el("div", { "class": "kvc-row" }, [field("batch B", B), field("context T (tokens)", T),
                                         field("memory (GiB)", M), field("weights (GiB)", G)]),
      out);
    draw();
  }

  function init() {
    var root = document.getElementById("kvdoc-calculator");
    var blob = document.getElementById("kvdoc-calculator-data");
    if (!root || !blob || root.dataset.ready) return;
    root.dataset.ready = "1";
    build(root, JSON.parse(blob.textContent));
  }
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", init); else init();
})();
