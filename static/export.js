// The per-step timings of the conversation, downloaded as CSV or JSON for analysis elsewhere.

export const STEP_COLUMNS = ["reply", "kind", "tokens", "context", "nest", "variant", "attention_ms", "step_ms",
  "timing_note", "encode_ms", "gpu_ms", "dispatches"];

function csvField(value) {
  const text = value === null || value === undefined ? "" : String(value);
  return /[",\n]/.test(text) ? `"${text.replace(/"/g, '""')}"` : text;
}

// replies: [{reply, speed, stats: [StepStats as a dict]}]
export function stepRows(replies) {
  return replies.flatMap((r) => r.stats.map((s) => ({ reply: r.reply, ...s })));
}

export function stepsCsv(replies) {
  const lines = [STEP_COLUMNS.join(",")];
  for (const row of stepRows(replies)) lines.push(STEP_COLUMNS.map((c) => csvField(row[c])).join(","));
  return lines.join("\n") + "\n";
}

export function stepsJson(replies, about) {
  return JSON.stringify({ ...about, exported_at: new Date().toISOString(),
    replies: replies.map(({ reply, speed, seed, stop_reason }) => ({ reply, speed, seed, stop_reason })),
    steps: stepRows(replies) }, null, 1);
}

export function download(filename, text, type) {
  const url = URL.createObjectURL(new Blob([text], { type }));
  const a = document.createElement("a");
  a.href = url; a.download = filename;
  document.body.append(a); a.click(); a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 10_000);
}
