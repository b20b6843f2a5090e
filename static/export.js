// The per-step timings of the conversation, downloaded as CSV or JSON for analysis elsewhere. Every
// row names the model that ran it (a GGUF opened mid-conversation runs the replies after it).
import { STEP_FIELDS } from "./page_api.js";
import { $, state } from "./ui.js";

// The model's name and the reply's label, then StepStats' fields (model_glue/model/step_stats.py, through chat/api.py).
export const STEP_COLUMNS = ["model", "reply", ...STEP_FIELDS];

function csvField(value) {
  const text = value === null || value === undefined ? "" : String(value);
  return /[",\n]/.test(text) ? `"${text.replace(/"/g, '""')}"` : text;
}

// replies: [{model, reply, speed, stats: [StepStats as a dict]}]
export function stepRows(replies) {
  return replies.flatMap((r) => r.stats.map((s) => ({ model: r.model, reply: r.reply, ...s })));
}

export function stepsCsv(replies) {
  const lines = [STEP_COLUMNS.join(",")];
  for (const row of stepRows(replies)) lines.push(STEP_COLUMNS.map((c) => csvField(row[c])).join(","));
  return lines.join("\n") + "\n";
}

// `comparisons`: each comparison's verdict and teacher-forced agreement, its misses' margins too.
export function stepsJson(replies, comparisons, about) {
  return JSON.stringify({ ...about, exported_at: new Date().toISOString(),
    replies: replies.map(({ model, reply, speed, seed, stop_reason }) => ({ model, reply, speed, seed, stop_reason })),
    comparisons, steps: stepRows(replies) }, null, 1);
}

export function download(filename, text, type) {
  const url = URL.createObjectURL(new Blob([text], { type }));
  const a = document.createElement("a");
  a.href = url; a.download = filename;
  document.body.append(a); a.click(); a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 10_000);
}

// -- the page's export buttons --------------------------------------------------------------------

// A finished reply (or comparison run): the model that ran it, its speed and full step table go
// into the export.
export function recordRun(label, result) {
  state.replies.push({ model: state.model.name, reply: label, speed: result.speed, seed: result.seed ?? null,
    stop_reason: result.stop_reason, stats: result.stats });
  $("export-csv").disabled = false; $("export-json").disabled = false;
}

// A finished comparison (chat_view.js lastCompare): the JSON export keeps it.
export function recordComparison(comparison) {
  state.comparisons.push(comparison);
}

export function clearRuns() {
  state.replies = [];
  state.comparisons = [];
  $("export-csv").disabled = true; $("export-json").disabled = true;
}

// `about`: the model, adapter and applied options the figures belong to.
export function exportSteps(format, about) {
  const stamp = new Date().toISOString().replace(/[:.]/g, "-");
  if (format === "csv") download(`decode-steps-${stamp}.csv`, stepsCsv(state.replies), "text/csv");
  else download(`decode-steps-${stamp}.json`, stepsJson(state.replies, state.comparisons, about), "application/json");
}
