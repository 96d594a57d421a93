// The status page's only script: fetch the live part every few seconds and swap it in.
// No request leaves the box (same origin only); the page reads fine without it.
(function () {
  "use strict";
  var PERIOD_MS = 5000;
  var live = document.getElementById("live");
  var main = document.querySelector("main");

  // the folds a person opened stay open across a refresh (each <details> has an id)
  function openDetails() {
    var open = [];
    main.querySelectorAll("details[id][open]").forEach(function (d) { open.push(d.id); });
    return open;
  }

  function refresh() {
    fetch("/status/main", { cache: "no-store", credentials: "omit" })
      .then(function (response) {
        if (!response.ok) { throw new Error("HTTP " + response.status); }
        return response.text();
      })
      .then(function (text) {
        var open = openDetails();
        main.innerHTML = text;
        open.forEach(function (id) {
          var details = document.getElementById(id);
          if (details && main.contains(details)) { details.open = true; }
        });
        live.textContent = "Updated " + new Date().toLocaleTimeString() + ".";
        live.classList.remove("stale");
      })
      .catch(function (err) {
        live.textContent = "Cannot reach the arbiter (" + err.message + "); trying again.";
        live.classList.add("stale");
      })
      .finally(function () { window.setTimeout(refresh, PERIOD_MS); });
  }

  window.setTimeout(refresh, PERIOD_MS);
})();
