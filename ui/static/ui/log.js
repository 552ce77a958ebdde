// The lifecycle log: rows of the audit table, filtered by model and event, new rows live.
import {connectStatus} from "./live.js";

const tbody = document.querySelector("#log tbody");
const params = new URLSearchParams(location.search);
const wantModel = params.get("model") || "";
const wantEvent = params.get("event") || "";
const shown = new Set();

export function eventRow(e) {
  const row = document.createElement("tr");
  row.dataset.id = e.id;
  const cells = [e.created_at.replace("T", " ").replace("Z", ""), e.model_id, e.event, e.outcome, e.actor,
                 e.duration_ms ?? "", e.detail];
  for (const value of cells) {
    const cell = document.createElement("td");
    cell.textContent = value;
    row.append(cell);
  }
  row.children[3].className = e.outcome === "failed" ? "error" : "";
  return row;
}

for (const e of JSON.parse(document.getElementById("initial-events").textContent)) {
  shown.add(e.id);
  tbody.append(eventRow(e));
}
connectStatus((message) => {
  if (message.type !== "event") return;
  const e = message.event;
  if (shown.has(e.id) || (wantModel && e.model_id !== wantModel) || (wantEvent && e.event !== wantEvent)) return;
  shown.add(e.id);
  const row = eventRow(e);
  row.className = "fresh";
  tbody.prepend(row);
});
