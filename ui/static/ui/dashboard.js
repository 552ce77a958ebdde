// The dashboard: rows from the live status, management forms, and a small timeline per model.
import {connectStatus, shortTime} from "./live.js";
import {submitAction} from "./forms.js";
import {anchorPopover, color, fitCanvas} from "./theme.js";

const tbody = document.querySelector("#models tbody");
const template = document.getElementById("row-template");
const HISTORY_MS = 30000;
const history = new Map();  // model id -> [{t, active, queued, slots}]

function describe(result) {
  if (!result) return "done";
  if ("unloaded" in result) {
    return `unloaded: ${result.unloaded.join(", ") || "none"}` +
      (result.not_found.length ? `; not found: ${result.not_found.join(", ")}` : "") +
      (result.skipped.length ? `; skipped: ${result.skipped.join(", ")}` : "");
  }
  if ("deleted" in result) return `${result.id} unregistered`;
  if ("reconfigured" in result) return `${result.id}: loaded=${result.loaded}, reconfigured=${result.reconfigured}`;
  return `${result.id}: loaded=${result.loaded}`;
}

function rowOf(id) {
  return tbody.querySelector(`tr[data-model="${CSS.escape(id)}"]`);
}

let menus = 0;

function newRow(model) {
  const row = template.content.firstElementChild.cloneNode(true);
  row.dataset.model = model.id;
  const link = row.querySelector('[data-field="link"]');
  link.textContent = model.id;
  link.href = `/ui/models/${encodeURIComponent(model.id)}`;
  const select = row.querySelector('[data-field="select"]');
  if (select) { select.value = model.id; select.setAttribute("aria-label", `select ${model.id}`); }
  row.querySelector('[data-field="timeline"]').setAttribute("aria-label", `queue and slot timeline of ${model.id}`);
  const menu = row.querySelector('[data-field="menu"]');
  if (menu) {
    const button = row.querySelector('[data-field="menu-button"]');
    menu.id = `menu-${++menus}`;
    menu.setAttribute("aria-label", `Manage ${model.id}`);
    button.setAttribute("popovertarget", menu.id);
    button.setAttribute("aria-label", `Manage ${model.id}`);
    button.setAttribute("aria-expanded", "false");
    row.querySelector('[data-field="menu-title"]').textContent = model.id;
    const page = row.querySelector('[data-field="menu-page"]');
    page.href = link.href;
    page.setAttribute("aria-label", `options, voice presets and history of ${model.id}`);
    anchorPopover(button, menu);
  }
  for (const form of row.querySelectorAll("form.act")) {
    form.action = `/ui/manage/${encodeURIComponent(model.id)}/${form.dataset.action}`;
    if (form.dataset.confirm) form.dataset.confirm = form.dataset.confirm.replace("{id}", model.id);
    for (const button of form.querySelectorAll("button")) {
      button.setAttribute("aria-label", `${button.textContent} ${model.id}`);
    }
  }
  const slotsInput = row.querySelector('input[name="slots"]');
  if (slotsInput) { slotsInput.value = model.slots; slotsInput.setAttribute("aria-label", `slots of ${model.id}`); }
  return row;
}

function setField(row, name, value) {
  const cell = row.querySelector(`[data-field="${name}"]`);
  if (!cell) return;
  const text = value === null || value === undefined ? "" : String(value);
  if (cell.textContent !== text) cell.textContent = text;
}

function render(models) {
  const seen = new Set();
  const now = Date.now();
  for (const model of models) {
    seen.add(model.id);
    let row = rowOf(model.id);
    if (!row) {
      row = newRow(model);
      const after = [...tbody.children].find((r) => r.dataset.model > model.id);
      tbody.insertBefore(row, after || null);
    }
    row.dataset.state = model.state;
    setField(row, "state", model.state);
    row.querySelector('[data-field="state"]').className = `state ${model.state}`;
    for (const name of ["family", "task", "slots", "active_slots", "queued_requests", "worker", "last_error"]) {
      setField(row, name, model[name]);
    }
    const error = row.querySelector('[data-field="last_error"]');
    if (model.last_error) error.title = model.retry_at ? `${model.last_error} (retry at ${model.retry_at})` : model.last_error;
    else error.removeAttribute("title");
    // The counts a resize may ask for here (capacity and admission table together), not the family's
    // advertised capacity alone: a resize past it is refused with "admitted counts are 1..N".
    setField(row, "admitted_slots", `1..${model.admitted_slots}`);
    row.querySelector('[data-field="admitted_slots"]').title =
      `advertised capacity of the loaded pool: ${model.max_parallel_slots ?? "not loaded"}`;
    setField(row, "last_used_at", shortTime(model.last_used_at));
    row.querySelector('[data-field="last_used_at"]').title = model.last_used_at || "never";
    const points = history.get(model.id) || [];
    points.push({t: now, active: model.active_slots, queued: model.queued_requests, slots: model.slots});
    history.set(model.id, points);
  }
  for (const row of [...tbody.children]) {
    if (!seen.has(row.dataset.model)) { history.delete(row.dataset.model); row.remove(); }
  }
}

function drawTimeline(canvas, points, now) {
  const [ctx, w, h] = fitCanvas(canvas);
  ctx.clearRect(0, 0, w, h);
  if (!points.length) return;
  const top = Math.max(1, ...points.map((p) => Math.max(p.slots, p.active + p.queued)));
  const x = (t) => w - ((now - t) / HISTORY_MS) * w;
  const y = (v) => h - 1 - (v / top) * (h - 4);
  const series = (value, color, fill) => {
    ctx.beginPath();
    ctx.moveTo(Math.max(0, x(points[0].t)), h);
    let last = 0;
    for (const p of points) {
      const px = Math.max(0, x(p.t));
      ctx.lineTo(px, y(last));
      last = value(p);
      ctx.lineTo(px, y(last));
    }
    ctx.lineTo(w, y(last));
    ctx.lineTo(w, h);
    ctx.closePath();
    ctx.fillStyle = fill;
    ctx.fill();
    ctx.strokeStyle = color;
    ctx.stroke();
  };
  series((p) => p.active + p.queued, color("plot-queued"), color("plot-queued-fill"));
  series((p) => p.active, color("plot-active"), color("plot-active-fill"));
  ctx.setLineDash([3, 3]);
  ctx.strokeStyle = color("plot-line");
  ctx.beginPath();
  const slots = points[points.length - 1].slots;
  ctx.moveTo(0, y(slots));
  ctx.lineTo(w, y(slots));
  ctx.stroke();
  ctx.setLineDash([]);
}

function redrawTimelines() {
  const now = Date.now();
  for (const row of tbody.children) {
    const points = history.get(row.dataset.model) || [];
    while (points.length > 1 && points[1].t < now - HISTORY_MS) points.shift();
    drawTimeline(row.querySelector("canvas.timeline"), points, now);
  }
}

document.addEventListener("submit", (event) => {
  const form = event.target;
  if (!form.classList.contains("act")) return;
  event.preventDefault();
  submitAction(form, event.submitter, describe);
});

const families = document.getElementById("families");
if (families) {
  const data = JSON.parse(families.textContent);
  const family = document.getElementById("reg-family");
  const task = document.getElementById("reg-task");
  const fill = () => {
    const spec = data[family.value];
    task.replaceChildren(...spec.tasks.map((t) => new Option(t, t)));
    document.getElementById("reg-load").value = JSON.stringify(spec.defaults.load_options);
    document.getElementById("reg-session").value = JSON.stringify(spec.defaults.session_options);
    document.getElementById("reg-request").value = JSON.stringify(spec.defaults.default_request_options);
  };
  family.addEventListener("change", fill);
  fill();
}

render(JSON.parse(document.getElementById("initial-board").textContent));
connectStatus((message) => {
  if (message.type !== "status") return;
  document.getElementById("workers").textContent = message.workers;
  render(message.models);
});
setInterval(redrawTimelines, 500);
redrawTimelines();
