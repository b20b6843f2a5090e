// The kernel lab panel: decode attention per layer, tiled vs sharded vs the host's choice, on this
// GPU (chat/lab.py does the work and the f64 check; this module shows rows, a chart and the export).
import { COLORS, drawSteps } from "./charts.js";
import { download } from "./export.js";
import { errorText } from "./faults.js";
import { keeper } from "./gguf_keeper.js";
import { SWITCH_AT } from "./page_api.js";
import { $, fmt, state } from "./ui.js";

// The model loaded when the lab ran (its name; the JSON has the whole state.model), then the row's fields.
const COLUMNS = ["model", "shape", "context", "nest", "ran", "us", "step_ms", "layers", "kv_gb_s", "tiled_over_sharded",
  "seed_ratio", "rel_l2", "ok", "error"];

function cell(row, text, className) {
  const td = document.createElement("td");
  td.textContent = text;
  if (className) td.className = className;
  row.append(td);
}

function addRow(r) {
  const tr = document.createElement("tr");
  tr.className = r.ok ? "" : "wrong";
  for (const text of [r.shape, r.context, r.nest, r.ran ?? "–"]) cell(tr, String(text));
  if (r.ok && r.us !== undefined) {
    for (const text of [fmt(r.us, 1), fmt(r.step_ms, 2), fmt(r.kv_gb_s, 1)]) cell(tr, text, "num");
    cell(tr, r.nest === "sharded" && r.tiled_over_sharded ? `${r.tiled_over_sharded.toFixed(2)}x` +
      (r.seed_ratio ? ` (seed ${r.seed_ratio}x)` : "") : "", "num");
    cell(tr, r.rel_l2.toExponential(1), "num");
  } else {
    const td = document.createElement("td");
    td.colSpan = 5;
    td.textContent = r.error || "";
    tr.append(td);
  }
  $("lab-rows").append(tr);
}

function drawLab(rows) {
  const series = [];
  for (const shape of [...new Set(rows.map((r) => r.shape))]) {
    for (const nest of ["tiled", "sharded"]) {
      const points = rows.filter((r) => r.shape === shape && r.nest === nest && r.us !== undefined)
        .map((r) => ({ x: r.context, y: r.us, nest }));
      if (points.length) series.push({ label: `${nest} ${shape}`, color: COLORS[nest], points });
    }
  }
  state.labChart = drawSteps($("lab-chart"), series, { switchAt: SWITCH_AT,
    yTitle: "attention per layer, us (GPU)" });
}

function csv(rows) {
  const field = (v) => (v === null || v === undefined ? "" : /[",\n]/.test(String(v)) ? `"${String(v).replace(/"/g, '""')}"` : String(v));
  return [COLUMNS.join(",")].concat(rows.map((r) => COLUMNS.map((c) => field(r[c])).join(","))).join("\n") + "\n";
}

function exportLab(format) {
  const result = state.lab;
  const stamp = new Date().toISOString().replace(/[:.]/g, "-");
  const rows = result.rows.map((r) => ({ model: result.model.name, ...r }));
  if (format === "csv") download(`kernel-lab-${stamp}.csv`, csv(rows), "text/csv");
  else download(`kernel-lab-${stamp}.json`, JSON.stringify({ ...result, browser: navigator.userAgent,
    exported_at: new Date().toISOString() }, null, 1), "application/json");
}

async function runLab(app) {
  $("lab-run").disabled = true;
  keeper.hold("lab", true);  // the GGUF caching in the background waits: the lab times kernels
  $("lab-rows").replaceChildren();
  $("lab-status").textContent = "running… (each row is checked against a float64 reference, then timed)";
  const rows = [];
  try {
    const contexts = $("lab-contexts").value.split(",").map((c) => c.trim()).filter(Boolean).map(Number);
    const request = JSON.stringify({ contexts, iters: Number($("lab-iters").value) || null });
    const result = JSON.parse(await app.python.call("lab", { request }, { row: (json) => {
      const row = JSON.parse(json);
      rows.push(row);
      addRow(row);
      $("lab-status").textContent = `running… ${rows.length} rows`;
    } }));
    if (result.error) { $("lab-status").textContent = result.error; return; }
    state.lab = { ...result, browser: navigator.userAgent, model: state.model };
    drawLab(result.rows);
    const wrong = result.rows.filter((r) => !r.ok).length;
    $("lab-status").textContent = `${result.rows.length} rows in ${result.seconds.toFixed(1)} s, ${result.dtype}, ` +
      `GPU timestamps, median of ${result.iters}` + (wrong ? `; ${wrong} not timed (see the rows)` : "");
    $("lab-csv").disabled = false; $("lab-json").disabled = false;
  } catch (err) {
    $("lab-status").textContent = `The lab failed: ${errorText(err)}`;
  } finally {
    keeper.hold("lab", false);
    $("lab-run").disabled = false;
  }
}

// Resolves once the lab's controls are wired and hold this adapter's defaults.
export async function setUpLab(app) {
  const defaults = JSON.parse(await app.python.call("labDefaults"));
  $("lab-contexts").value = defaults.contexts.join(",");
  $("lab-iters").value = defaults.iters;
  $("lab-note").textContent = defaults.note;
  $("lab-run").addEventListener("click", () => runLab(app));
  $("lab-csv").addEventListener("click", () => exportLab("csv"));
  $("lab-json").addEventListener("click", () => exportLab("json"));
  $("lab-panel").hidden = false;
}
