// Bootstrap: load the self-hosted Pyodide, the project's wheel, then hand over to Python (app/page.py).
// Everything is fetched from this origin: the page works offline.
import { loadPyodide } from "./pyodide/pyodide.mjs";

const progress = document.getElementById("progress");
const errorBox = document.getElementById("error");

function step(text) {
  for (const li of progress.querySelectorAll("li.active")) li.className = "done";
  const li = document.createElement("li");
  li.className = "active";
  li.textContent = text;  // textContent, never innerHTML: messages may carry arbitrary text
  progress.append(li);
  return li;
}

function fail(message) {
  for (const li of progress.querySelectorAll("li.active")) li.className = "";
  errorBox.textContent = message;
  errorBox.hidden = false;
  window.demoState = { ready: false, error: message };
}

function showAdapter(device) {
  const dl = document.getElementById("adapter");
  const rows = [
    ["name", device.adapter], ["backend", device.backend],
    ["shader-f16", device.shader_f16 ? "yes" : "no (f32 kernels)"],
    ["timestamp-query", device.timestamp_query ? "yes" : "no"],
    ["features", device.features.join(", ")],
  ];
  for (const [k, v] of rows) {
    const dt = document.createElement("dt"); dt.textContent = k;
    const dd = document.createElement("dd"); dd.textContent = v;
    dl.append(dt, dd);
  }
  document.getElementById("adapter-panel").hidden = false;
}

function showProbe(result) {
  const tbody = document.querySelector("#probe-table tbody");
  result.got.forEach((g, i) => {
    const tr = document.createElement("tr");
    for (const v of [i, g.toFixed(5), result.want[i].toFixed(5)]) {
      const td = document.createElement("td"); td.textContent = v; tr.append(td);
    }
    tbody.append(tr);
  });
  const verdict = document.getElementById("probe-verdict");
  verdict.textContent = result.ok
    ? `OK: GPU sums match Python's (max abs error ${result.max_abs_error.toExponential(2)}).`
    : `MISMATCH: max abs error ${result.max_abs_error}`;
  verdict.className = result.ok ? "ok" : "error";
  document.getElementById("probe-panel").hidden = false;
}

async function boot() {
  window.demoState = { ready: false };
  if (!("gpu" in navigator)) {
    fail("This browser has no WebGPU (navigator.gpu is missing). Use a recent Chromium-based browser " +
         "with WebGPU enabled (on Linux: --enable-unsafe-webgpu).");
    return;
  }
  step("Loading Python (Pyodide)…");
  const pyodide = await loadPyodide({ indexURL: new URL("./pyodide/", location.href).href });
  step("Loading the project's wheel…");
  await pyodide.loadPackage("sharded-decode-demo", { messageCallback: () => {} });
  step("Opening WebGPU and reading the kernel manifest…");
  const page = pyodide.pyimport("app.page");
  const base = new URL("./artifacts/kernels", location.href).href;
  const session = await page.open_session(base);
  const device = session.device.describe().toJs({ dict_converter: Object.fromEntries });
  showAdapter(device);
  step("Running the TVM-built probe kernel…");
  const probe = (await session.run_probe()).toJs({ dict_converter: Object.fromEntries });
  showProbe(probe);
  step("Ready.");
  for (const li of progress.querySelectorAll("li.active")) li.className = "done";
  window.demo = { pyodide, page, session };
  window.demoState = { ready: true, device, probe };
}

boot().catch((err) => fail(`Startup failed: ${err && err.message ? err.message : err}`));
