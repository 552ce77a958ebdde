// The live status stream (/ui/ws/status): one WebSocket, reconnected with a growing delay.
// Messages: {type: "status", models, workers, at} | {type: "event", event} | {type: "error", message}.
// Nothing here polls the server: updates arrive when the scheduler publishes a change.

const indicator = () => document.getElementById("live-state");

export function connectStatus(onMessage) {
  let delayMs = 500;
  const open = () => {
    const scheme = location.protocol === "https:" ? "wss:" : "ws:";
    const socket = new WebSocket(`${scheme}//${location.host}/ui/ws/status`);
    socket.addEventListener("open", () => {
      delayMs = 500;
      if (indicator()) indicator().textContent = "live";
      document.body.dataset.live = "open";
    });
    socket.addEventListener("message", (e) => {
      const message = JSON.parse(e.data);
      if (message.type === "error" && indicator()) indicator().textContent = "interrupted";
      else if (message.type === "status" && indicator()) indicator().textContent = "live";
      onMessage(message);
    });
    socket.addEventListener("close", () => {
      document.body.dataset.live = "closed";
      if (indicator()) indicator().textContent = "reconnecting…";
      setTimeout(open, delayMs);
      delayMs = Math.min(delayMs * 2, 10000);
    });
  };
  open();
}

// "2026-12-01T10:00:00.250Z" -> "10:00:00" (local time) with the full time as a tooltip value.
export function shortTime(iso) {
  if (!iso) return "";
  const d = new Date(iso);
  return d.toLocaleTimeString([], {hour12: false});
}
