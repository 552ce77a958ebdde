// One model's page: its live status, its manage actions, a chart of queue wait and run time per minute
// over the last hour (refreshed each minute), and its lifecycle events, live.
import {connectStatus} from "./live.js";
import {submitAction} from "./forms.js";
import {color, fitCanvas} from "./theme.js";

const status = document.getElementById("status");
const modelId = status.dataset.model;
const tbody = document.querySelector("#log tbody");
const shown = new Set();
const EMPTY = {last_used_at: "never", last_error: "none", retry_at: "–"};

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
    cell.textContent = value === null || value === undefined ? (EMPTY[cell.dataset.field] ?? "–") : value;
  }
  status.querySelector('[data-field="state"]').className = `state ${model.state}`;
});

function describe(r) {
  if (!r) return "done";
  if ("deleted" in r) return `${r.id} unregistered`;
  if ("reconfigured" in r) return `${r.id}: ${r.reconfigured ? "reconfigured" : "unchanged"}, ${r.loaded ? "loaded" : "not loaded"}`;
  return `${r.id}: loaded=${r.loaded}`;
}

document.addEventListener("submit", async (event) => {
  const form = event.target;
  if (!form.classList.contains("act")) return;
  event.preventDefault();
  const ok = await submitAction(form, event.submitter, describe);
  if (ok && form.dataset.then) location.assign(form.dataset.then);
});

// --- the chart: mean queue wait and run time per minute, log scale ---
const chart = document.getElementById("timing-chart");
const summary = document.getElementById("timing-summary");

function summarise(minutes, part) {
  let count = 0, total = 0;
  for (const m of minutes) if (m[part]) { count += m[part].count; total += m[part].count * m[part].mean_ms; }
  return count ? `${count} request(s), mean ${(total / count).toFixed(total / count < 1 ? 2 : 1)} ms` : "no request";
}

function drawChart(minutes) {
  const [ctx, w, h] = fitCanvas(chart);
  ctx.clearRect(0, 0, w, h);
  const values = minutes.flatMap((m) => [m.queue, m.run]).filter(Boolean).map((s) => Math.max(0.1, s.mean_ms));
  const top = Math.max(10, ...values);
  const left = 48, bottom = h - 20;
  const y = (ms) => bottom - (Math.log10(Math.max(0.1, ms) / 0.1) / Math.log10(top / 0.1)) * (bottom - 6);
  const x = (i) => left + (i + 0.5) * ((w - left) / minutes.length);
  ctx.fillStyle = color("muted");
  ctx.strokeStyle = color("line");
  ctx.font = "11px system-ui, sans-serif";
  for (let ms = 0.1; ms <= top * 1.01; ms *= 10) {
    ctx.beginPath(); ctx.moveTo(left, y(ms)); ctx.lineTo(w, y(ms)); ctx.stroke();
    ctx.fillText(ms >= 1000 ? `${ms / 1000} s` : `${ms} ms`, 2, y(ms) + 4);
  }
  ctx.fillText("−60 min", left, h - 3);
  ctx.fillText("now", w - 24, h - 3);
  const barW = Math.max(2, (w - left) / minutes.length / 2 - 1);
  minutes.forEach((m, i) => {
    const bar = (ms) => Math.min(bottom - 2, y(ms));  // at least 2 px: a minute with requests is never blank
    if (m.queue) { ctx.fillStyle = color("plot-queued"); ctx.fillRect(x(i) - barW, bar(m.queue.mean_ms), barW, bottom - bar(m.queue.mean_ms)); }
    if (m.run) { ctx.fillStyle = color("plot-active"); ctx.fillRect(x(i), bar(m.run.mean_ms), barW, bottom - bar(m.run.mean_ms)); }
  });
  summary.textContent = `Last hour — run time: ${summarise(minutes, "run")}; queue wait: ${summarise(minutes, "queue")}.`;
}

let minutes = JSON.parse(document.getElementById("timing-minutes").textContent);
drawChart(minutes);
setInterval(async () => {
  const response = await fetch(`/ui/models/${encodeURIComponent(modelId)}/minutes`, {credentials: "same-origin"});
  if (response.ok) { minutes = await response.json(); drawChart(minutes); }
}, 60000);
matchMedia("(prefers-color-scheme: dark)").addEventListener("change", () => drawChart(minutes));
