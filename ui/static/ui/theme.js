// Colours of the canvases, read from the stylesheet's variables (ui.css), so plots follow the light or
// dark theme; and a helper that sizes a canvas's drawing buffer to its CSS box on high-density screens.

export function color(name) {
  return getComputedStyle(document.documentElement).getPropertyValue(`--${name}`).trim() || "#888";
}

// Size the canvas buffer to its displayed size times the device pixel ratio; returns [ctx, width, height]
// in CSS pixels with the context scaled accordingly.
export function fitCanvas(canvas) {
  const ratio = window.devicePixelRatio || 1;
  const w = canvas.clientWidth || canvas.width, h = canvas.clientHeight || canvas.height;
  if (canvas.width !== Math.round(w * ratio) || canvas.height !== Math.round(h * ratio)) {
    canvas.width = Math.round(w * ratio);
    canvas.height = Math.round(h * ratio);
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  return [ctx, w, h];
}

// A popover menu placed under (or, without room, above) the button that opens it, right-aligned to it.
export function anchorPopover(button, popover) {
  popover.addEventListener("toggle", (event) => {
    button.setAttribute("aria-expanded", event.newState === "open" ? "true" : "false");
    if (event.newState !== "open") return;
    const at = button.getBoundingClientRect();
    const box = popover.getBoundingClientRect();
    const left = Math.max(8, Math.min(at.right - box.width, window.innerWidth - box.width - 8));
    const below = at.bottom + 4;
    const top = below + box.height <= window.innerHeight - 8 ? below : Math.max(8, at.top - box.height - 4);
    popover.style.left = `${left}px`;
    popover.style.top = `${top}px`;
  });
}
