// The timing overlay: the last pass's figures, the reply's speed, attention per decode step.
import { drawSteps } from "./charts.js";
import { SWITCH_AT } from "./page_api.js";
import { $, fmt, state } from "./ui.js";

export function speedText(speed) {
  const ttft = speed.ttft_ms === null ? "–" : `${Math.round(speed.ttft_ms)} ms`;
  return `TTFT ${ttft} · prefill ${speed.prefill_tokens} tok (${speed.reused_tokens} reused) at ` +
    `${fmt(speed.prefill_tok_s)} tok/s · decode ${fmt(speed.decode_tok_s)} tok/s`;
}

// What the chart shows: what ran last, the chat's own steps or the last comparison's two runs.
let comparison = null;

export function drawOverlayChart() {
  const points = state.steps.filter((s) => s.attention_ms !== null && s.kind === "decode")
    .map((s) => ({ x: s.context, y: s.attention_ms, nest: s.nest }));
  state.overlayChart = drawSteps($("overlay-chart"), comparison || [{ label: "this chat", color: "#777", points }],
    { switchAt: SWITCH_AT });
}

// A comparison ran: the chart shows its runs ([{label, color, points}], as the comparison's own chart).
export function showComparison(series) {
  comparison = series;
  drawOverlayChart();
  $("overlay").hidden = false;
}

// New chat: nothing has run in it yet.
export function clearOverlay() {
  comparison = null;
  showSpeed(null);
  drawOverlayChart();
}

// A pass finished: its stats count at once (state.steps); the overlay shows them at the next
// animation frame, once per frame however many passes finished (a decode step can take ~1 ms).
export function updateOverlay(stats) {
  comparison = null;
  state.steps.push(stats);
  drawNextFrame();
}

let frameRequested = false;

function drawNextFrame() {
  if (frameRequested) return;
  frameRequested = true;
  requestAnimationFrame(() => {
    frameRequested = false;
    drawLastStep();
  });
}

function drawLastStep() {
  const stats = state.steps[state.steps.length - 1];
  if (!stats) return;
  // Decode steps time attention in one step in 16 (RunOptions.time_attention_every): between those,
  // the overlay shows the last timed step's figure, labelled with its context.
  const timed = stats.attention_ms !== null ? stats : lastTimedStep(stats.kind);
  const attn = timed === null ? "n/a" : timed === stats ? `${stats.attention_ms.toFixed(3)} ms`
    : `${timed.attention_ms.toFixed(3)} ms (sampled at ctx ${timed.context})`;
  const gpu = stats.gpu_ms === null ? "n/a" : `${stats.gpu_ms.toFixed(2)} ms`;
  // The GPU's idle time before the pass: near zero while the host keeps it fed.
  const idle = stats.gpu_gap_ms === null ? "" : ` · GPU idle ${stats.gpu_gap_ms.toFixed(2)} ms before it`;
  $("overlay-last").textContent =
    `${stats.kind} · ctx ${stats.context} · ${stats.kernel} · attn ${attn} · GPU ${gpu} · ` +
    `encode ${stats.encode_ms.toFixed(2)} ms · step ${stats.step_ms.toFixed(1)} ms · ` +
    `waited ${stats.wait_ms.toFixed(2)} ms for the id${idle} · ${stats.dispatches} dispatches`;
  $("overlay-note").textContent = stats.timing_note || "";
  drawOverlayChart();
  $("overlay").hidden = false;
}

function lastTimedStep(kind) {
  for (let i = state.steps.length - 1; i >= 0; i--) {
    const s = state.steps[i];
    if (s.kind === kind && s.attention_ms !== null) return s;
  }
  return null;
}

// The reply ended: draw its last step now (a frame may still be pending, or never come in a
// hidden tab).
export function drawOverlayNow() {
  drawLastStep();
}

export function showPrefill(done, total) {
  state.prefill = { done, total };
  $("overlay-last").textContent = `prefill ${done}/${total} tokens`;
  $("overlay").hidden = false;
}

export function showSpeed(speed) {
  $("overlay-speed").textContent = speed ? speedText(speed) : "";
}
