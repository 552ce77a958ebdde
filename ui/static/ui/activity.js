// The activity view: the last answered requests, newest first, filtered by model and outcome in the
// page; new rows arrive over the status socket ({type: "activity", requests: [...] oldest first}).
import {connectStatus} from "./live.js";

const KEEP = 200;
const tbody = document.querySelector("#activity tbody");
const modelSelect = document.getElementById("filter-model");
const outcomeSelect = document.getElementById("filter-outcome");
const count = document.getElementById("activity-count");

const ms = (v) => (v === null || v === undefined ? "–" : v < 10 ? v.toFixed(1) : String(Math.round(v)));

function matches(row) {
  return (!modelSelect.value || row.dataset.model === modelSelect.value) &&
         (!outcomeSelect.value || row.dataset.outcome === outcomeSelect.value);
}

export function requestRow(r) {
  const row = document.createElement("tr");
  row.dataset.model = r.model;
  row.dataset.outcome = r.outcome;
  const when = new Date(r.at);
  const cells = [
    [when.toLocaleTimeString([], {hour12: false}) + "." + String(when.getMilliseconds()).padStart(3, "0"), "nowrap"],
    [r.model || "(none)", ""], [r.route, ""], null,
    [ms(r.queue_ms), "num"], [ms(r.run_ms), "num"], [ms(r.total_ms), "num"],
    [r.user ? `${r.user} · ${r.client}` : r.client, ""],
  ];
  for (const cell of cells) {
    const td = document.createElement("td");
    if (cell === null) {  // outcome: a word in a coloured pill, the status and error code beside it
      const pill = document.createElement("span");
      pill.className = `state ${r.outcome}`;
      pill.textContent = r.outcome;
      td.append(pill, ` ${r.status}${r.code ? " " + r.code : ""}`);
      td.className = "nowrap";
    } else {
      td.textContent = cell[0];
      td.className = cell[1];
    }
    row.append(td);
  }
  row.children[0].title = r.at;
  return row;
}

function applyFilter() {
  let shown = 0;
  for (const row of tbody.children) {
    row.hidden = !matches(row);
    if (!row.hidden) shown++;
  }
  count.textContent = `${shown} of ${tbody.children.length} shown`;
  const params = new URLSearchParams();
  if (modelSelect.value) params.set("model", modelSelect.value);
  if (outcomeSelect.value) params.set("outcome", outcomeSelect.value);
  history.replaceState(null, "", params.size ? `?${params}` : location.pathname);
}

for (const r of JSON.parse(document.getElementById("initial-requests").textContent)) tbody.append(requestRow(r));
modelSelect.addEventListener("change", applyFilter);
outcomeSelect.addEventListener("change", applyFilter);
document.getElementById("filters").addEventListener("submit", (e) => { e.preventDefault(); applyFilter(); });
applyFilter();

connectStatus((message) => {
  if (message.type !== "activity") return;
  for (const r of message.requests) {
    const row = requestRow(r);
    row.className = "fresh";
    row.hidden = !matches(row);
    tbody.prepend(row);
    window.dispatchEvent(new CustomEvent("activity-row", {detail: r}));
  }
  while (tbody.children.length > KEEP) tbody.lastElementChild.remove();
  applyFilter();
});
