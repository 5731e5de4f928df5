// Reading paths (docs/_ext/kvdoc_paths.py writes the hidden nav.kvdoc-path blocks).
// The path a reader is on: the address's ?path=NAME, else the last one chosen in this tab.
// On a page of that path, its previous/next links are shown and the theme's book-order
// previous/next is hidden. (The landing page's lists link into each path with ?path=NAME.)
// Also: a table wider than its box says, above it, that it scrolls sideways.
(function () {
  "use strict";
  var KEY = "kvdoc-path";

  function chosenPath() {
    var fromUrl = new URLSearchParams(window.location.search).get("path");
    try {
      if (fromUrl !== null) {
        if (fromUrl) { sessionStorage.setItem(KEY, fromUrl); } else { sessionStorage.removeItem(KEY); }
        return fromUrl;
      }
      return sessionStorage.getItem(KEY) || "";
    } catch (e) { // storage refused (a private window): the address alone decides
      return fromUrl || "";
    }
  }

  function showPath() {
    var name = chosenPath();
    var navs = document.querySelectorAll("nav.kvdoc-path");
    var shown = false;
    navs.forEach(function (nav) {
      nav.hidden = nav.dataset.path !== name;
      shown = shown || !nav.hidden;
    });
    if (shown) {
      document.querySelectorAll(".prev-next-area").forEach(function (el) { el.hidden = true; });
    }
  }

  function markScrollingTables() {
    var boxes = document.querySelectorAll(
      ".pst-scrollable-table-container, div.cell_output table, table.indextable");
    boxes.forEach(function (box) {
      var hint = box.previousElementSibling;
      if (!hint || !hint.classList.contains("kvdoc-scroll-hint")) {
        hint = document.createElement("p");
        hint.className = "kvdoc-scroll-hint";
        hint.textContent = "Wider than the page: scroll the table sideways \u2192";
        box.parentNode.insertBefore(hint, box);
      }
      hint.hidden = box.scrollWidth <= box.clientWidth + 1;
    });
  }

  document.addEventListener("DOMContentLoaded", function () {
    showPath();
    markScrollingTables();
  });
  window.addEventListener("resize", markScrollingTables);
})();
