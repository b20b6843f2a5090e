// Attention time per decode step against context, on a canvas: axes with titles and units, tick
// labels, one polyline per series, a legend, and a dashed line where the host switches nest.

export const COLORS = { tiled: "#5aa2ff", sharded: "#ffa04d" };
const TEXT = "#bbb", AXIS = "#888", GRID = "#333";

function niceStep(range, ticks) {
  const raw = range / ticks, power = 10 ** Math.floor(Math.log10(raw));
  return [1, 2, 5, 10].map((m) => m * power).find((s) => s >= raw) || raw;
}

// series: [{label, color, points: [{x, y, nest}]}]; options: {switchAt, yTitle}.
// Points are coloured by their nest, so one series that crosses the switch shows both colours.
// Returns what it drew (axis titles, legend, point count), which the page tests read back.
export function drawSteps(canvas, series, { switchAt = null, yTitle = "attention, ms (GPU)" } = {}) {
  const ctx = canvas.getContext("2d");
  const w = canvas.width, h = canvas.height;
  const left = 58, right = 8, top = series.length > 1 ? 22 : 10, bottom = 32;
  ctx.clearRect(0, 0, w, h);
  ctx.font = "10px monospace";
  const all = series.flatMap((s) => s.points);
  if (!all.length) {
    ctx.fillStyle = TEXT;
    ctx.fillText("no timed decode steps yet", left, h / 2);
    return { points: 0 };
  }
  const minX = Math.min(...all.map((p) => p.x)), maxX = Math.max(...all.map((p) => p.x), minX + 1);
  const maxY = Math.max(...all.map((p) => p.y), 1e-3) * 1.05;
  const X = (x) => left + ((x - minX) / (maxX - minX)) * (w - left - right);
  const Y = (y) => h - bottom - (y / maxY) * (h - bottom - top);

  // grid and tick labels
  ctx.strokeStyle = GRID; ctx.fillStyle = TEXT; ctx.lineWidth = 1;
  const yStep = niceStep(maxY, 4);
  for (let y = 0; y <= maxY; y += yStep) {
    ctx.beginPath(); ctx.moveTo(left, Y(y)); ctx.lineTo(w - right, Y(y)); ctx.stroke();
    ctx.textAlign = "right";  // tick labels end at the axis, clear of the rotated title
    ctx.fillText(y < 1 ? y.toFixed(2) : y.toFixed(1), left - 4, Y(y) + 3);
    ctx.textAlign = "left";
  }
  const xStep = Math.max(1, niceStep(maxX - minX, 5));  // contexts are whole tokens: no 39.4 ticks
  for (let x = Math.ceil(minX / xStep) * xStep; x <= maxX; x += xStep) {
    ctx.fillText(String(x), X(x) - 8, h - bottom + 12);
  }
  ctx.strokeStyle = AXIS;
  ctx.beginPath(); ctx.moveTo(left, top); ctx.lineTo(left, h - bottom); ctx.lineTo(w - right, h - bottom); ctx.stroke();
  ctx.fillText("context (tokens)", (w + left) / 2 - 48, h - 4);
  ctx.save(); ctx.translate(10, top + (h - top - bottom) / 2); ctx.rotate(-Math.PI / 2);
  ctx.textAlign = "center"; ctx.fillText(yTitle, 0, 0); ctx.restore();

  if (switchAt !== null && switchAt > minX && switchAt < maxX) {
    ctx.setLineDash([4, 3]); ctx.strokeStyle = AXIS;
    ctx.beginPath(); ctx.moveTo(X(switchAt), top); ctx.lineTo(X(switchAt), h - bottom); ctx.stroke();
    ctx.setLineDash([]);
    ctx.fillText(`switch at ${switchAt}`, X(switchAt) + 3, top + 10);
  }
  for (const s of series) {
    ctx.beginPath();
    s.points.forEach((p, i) => (i ? ctx.lineTo(X(p.x), Y(p.y)) : ctx.moveTo(X(p.x), Y(p.y))));
    ctx.strokeStyle = s.color || "#777"; ctx.stroke();
    for (const p of s.points) {
      ctx.fillStyle = COLORS[p.nest] || "#ccc";
      ctx.fillRect(X(p.x) - 1.5, Y(p.y) - 1.5, 3, 3);
    }
  }
  if (series.length > 1) {  // legend, top right
    let x = w - right - 8;
    for (const s of [...series].reverse()) {
      const width = ctx.measureText(s.label).width;
      x -= width;
      ctx.fillStyle = TEXT; ctx.fillText(s.label, x, 12);
      ctx.fillStyle = s.color; ctx.fillRect(x - 12, 5, 9, 9);
      x -= 24;
    }
  }
  return { points: all.length, xTitle: "context (tokens)", yTitle, legend: series.length > 1 ? series.map((s) => s.label) : [],
    switchShown: switchAt !== null && switchAt > minX && switchAt < maxX };
}
