"""The dashboard's stylesheet and script, served from the daemon itself (no CDN, no build)."""

from __future__ import annotations

STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 0; color: #111; background: #fafafa; }
header { background: #1f2937; color: #fff; padding: 8px 16px; display: flex; gap: 16px; }
header a { color: #fff; text-decoration: none; }
main { padding: 12px 16px; }
table { border-collapse: collapse; background: #fff; }
th, td { border: 1px solid #ddd; padding: 4px 8px; text-align: left; vertical-align: top; }
th { background: #f3f4f6; }
.status-Failed { color: #b91c1c; font-weight: bold; }
.status-Finished { color: #15803d; }
.status-Waiting { color: #1d4ed8; }
.status-Cancelled { color: #6b7280; }
.counts span { margin-right: 12px; }
pre { background: #fff; border: 1px solid #ddd; padding: 8px; overflow: auto; max-height: 24em; }
.graph { background: #fff; border: 1px solid #ddd; overflow: auto; max-width: 100%; }
.live-off::after { content: " (not live)"; color: #b45309; }
form.inline { display: inline; }
button { margin-right: 8px; }
"""

#: Keeps a page live: on a `change` event its `#live` part is fetched again (at most every
#: 300 ms); `log` events are appended to `#log`; forms with data-confirm ask first.
SCRIPT = """
(function () {
  "use strict";
  var body = document.body;
  var fragment = body.getAttribute("data-fragment");
  var events = body.getAttribute("data-events");
  var busy = false, again = false;
  function refresh() {
    if (!fragment) return;
    if (busy) { again = true; return; }
    busy = true;
    fetch(fragment, {credentials: "same-origin"}).then(function (r) {
      if (!r.ok) throw new Error("HTTP " + r.status);
      return r.text();
    }).then(function (html) {
      document.getElementById("live").innerHTML = html;
      body.setAttribute("data-refreshed", String(Number(body.getAttribute("data-refreshed") || 0) + 1));
    }).catch(function () {}).then(function () {
      setTimeout(function () { busy = false; if (again) { again = false; refresh(); } }, 300);
    });
  }
  if (events && window.EventSource) {
    var source = new EventSource(events);
    source.addEventListener("open", function () { body.setAttribute("data-live", "on"); });
    source.addEventListener("error", function () { body.setAttribute("data-live", "off"); });
    source.addEventListener("change", refresh);
    source.addEventListener("log", function (e) {
      var log = document.getElementById("log");
      if (!log) return;
      var r = JSON.parse(e.data);
      var rest = Object.keys(r).filter(function (k) {
        return ["timestamp", "level", "event", "workflow_id", "workflow"].indexOf(k) < 0;
      }).map(function (k) { return k + "=" + JSON.stringify(r[k]); }).join(" ");
      log.textContent += (r.timestamp || "") + " " + (r.level || "") + " " + (r.event || "") +
        (rest ? " " + rest : "") + "\\n";
      log.scrollTop = log.scrollHeight;
    });
  }
  document.addEventListener("submit", function (e) {
    var question = e.target.getAttribute("data-confirm");
    if (question && !window.confirm(question)) e.preventDefault();
  });
})();
"""
