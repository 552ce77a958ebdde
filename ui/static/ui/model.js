// One model's page: its status row and its lifecycle events, live.
import {connectStatus} from "./live.js";
import {submitAction} from "./forms.js";

const status = document.getElementById("status");
const modelId = status.dataset.model;
const tbody = document.querySelector("#log tbody");
const shown = new Set();

function eventRow(e) {
  const row = document.createElement("tr");
  for (const value of [e.created_at.replace("T", " ").replace("Z", ""), e.model_id, e.event, e.outcome, e.actor,
                       e.duration_ms ?? "", e.detail]) {
    const cell = document.createElement("td");
    cell.textContent = value;
    row.append(cell);
  }
  return row;
}

for (const e of JSON.parse(document.getElementById("initial-events").textContent)) {
  shown.add(e.id);
  tbody.append(eventRow(e));
}
connectStatus((message) => {
  if (message.type === "event" && message.event.model_id === modelId && !shown.has(message.event.id)) {
    shown.add(message.event.id);
    const row = eventRow(message.event);
    row.className = "fresh";
    tbody.prepend(row);
  }
  if (message.type !== "status") return;
  const model = message.models.find((m) => m.id === modelId);
  if (!model) {
    status.querySelector('[data-field="state"]').textContent = "not registered";
    return;
  }
  for (const cell of status.querySelectorAll("[data-field]")) {
    const value = model[cell.dataset.field];
    cell.textContent = value === null || value === undefined ? (cell.dataset.field === "last_used_at" ? "never" : "–") : value;
  }
  status.querySelector('[data-field="state"]').className = `state ${model.state}`;
});

const configure = document.getElementById("configure");
if (configure) {
  configure.addEventListener("submit", (event) => {
    event.preventDefault();
    submitAction(configure, event.submitter,
                 (r) => `${r.id}: ${r.reconfigured ? "reconfigured" : "unchanged"}, ${r.loaded ? "loaded" : "not loaded"}`);
  });
}
