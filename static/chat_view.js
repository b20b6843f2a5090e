// The chat: messages, a reply streamed in, the comparison of the two nests, New chat. Python does
// the work in the worker (app.python, static/python.js; chat/page.py returns JSON; chat/api.py
// declares each call); what streams in is drawn once per animation frame.
import { COLORS, drawSteps } from "./charts.js";
import { clearRuns, recordComparison, recordRun } from "./export.js";
import { chatError, deviceLost, errorText } from "./faults.js";
import { keeper } from "./gguf_keeper.js";
import { clearOverlay, drawOverlayNow, showComparison, showPrefill, showSpeed, speedText, updateOverlay } from "./overlay.js";
import { DEFAULT_MAX_NEW_TOKENS, STOPPED_IN_PREFILL, SWITCH_AT } from "./page_api.js";
import { $, definitionList, fmt, state, URL_RUN_OPTIONS } from "./ui.js";

const LONG_DOCUMENT_QUESTION = "\n\nSummarize the document above in three sentences.";

// The reply or comparison in flight (a promise), so New chat can stop it and wait for it.
let running = null;

// Busy: a reply, a comparison, a model opening. The GGUF caching in the background waits meanwhile.
export function setBusy(busy) {
  state.busy = busy;
  keeper.hold("busy", busy);
  const blocked = busy || state.deviceLost !== null;
  $("send").disabled = blocked; $("compare").disabled = blocked;
  $("stop").disabled = !busy;
}

export function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = `msg ${role}`;
  const body = document.createElement("span");
  body.textContent = text;
  div.append(body);
  $("messages").append(div);
  return div;
}

// Ends a reply's bubble: its token ids when the text shows nothing, then count, stop reason, speed.
export function finishReply(bubble, body, result) {
  if (!result.text.trim()) {  // nothing visible (e.g. only whitespace or special tokens): show the ids
    body.textContent = result.text;
    const ids = document.createElement("span");
    ids.className = "ids";
    ids.textContent = `(no visible text; token ids: ${result.token_ids.join(" ")})`;
    bubble.append(ids);
  }
  const meta = document.createElement("span");
  meta.className = "meta";
  const seed = result.seed === null ? "" : ` · seed ${result.seed}`;
  meta.textContent = `${result.token_ids.length} tokens · ${result.stop_reason}${seed} · ${speedText(result.speed)}`;
  bubble.append(meta);
}

// The request chat.page.parse_request reads: tokens to generate, run options, sampling.
function request() {
  return JSON.stringify({
    max_new_tokens: Number($("max-tokens").value) || DEFAULT_MAX_NEW_TOKENS,
    options: { ...URL_RUN_OPTIONS, attention: $("attention").value },
    sampling: { temperature: Number($("temperature").value) || 0, top_k: Number($("top-k").value),
      top_p: Number($("top-p").value), seed: $("seed").value === "" ? null : Number($("seed").value) },
  });
}

// Text pieces as they stream in, appended to `body` once per animation frame.
export class TextStream {
  constructor(body) { this.body = body; this.waiting = ""; this.frame = null; }
  push(piece) {
    this.waiting += piece;
    if (this.frame === null) this.frame = requestAnimationFrame(() => this.flush());
  }
  flush() {
    if (this.frame !== null) cancelAnimationFrame(this.frame);
    this.frame = null;
    if (this.waiting) this.body.textContent += this.waiting;
    this.waiting = "";
  }
}

export function send(app) {
  if (state.busy || state.deviceLost) return;
  running = reply(app).finally(() => { running = null; });
}

// The box's text for a new turn (the page busy from here), or null when it is empty.
function beginTurn(app) {
  const text = $("prompt").value;
  if (!text.trim()) { chatError("The message is empty."); return null; }
  chatError("");
  setBusy(true);
  return text;
}

async function reply(app) {
  const text = beginTurn(app);
  if (text === null) return;
  state.prefill = null;
  const userDiv = addMessage("user", text);
  const bubble = addMessage("assistant", "");
  const body = bubble.querySelector("span");
  // The box is free for the next message while this one runs; if the turn fails, the text comes
  // back (unless something new was typed meanwhile): nothing typed is lost.
  $("prompt").value = "";
  const giveBack = () => { if (!$("prompt").value) $("prompt").value = text; };
  const streamed = new TextStream(body);
  try {
    const result = JSON.parse(await app.python.call("reply", { text, request: request() }, {
      text: (piece) => streamed.push(piece), step: (s) => updateOverlay(JSON.parse(s)),
      prefill: ([done, total]) => showPrefill(done, total) }).finally(() => { streamed.flush(); drawOverlayNow(); }));
    if (result.device_lost) {
      // Keep what was shown (the partial reply too) and the typed text; offer a reload.
      bubble.classList.add("interrupted");
      giveBack();
      deviceLost(result.error, setBusy);
      return;
    }
    if (result.error) {
      userDiv.remove(); bubble.remove();
      giveBack();
      chatError(result.error);
      return;
    }
    if (result.stop_reason === STOPPED_IN_PREFILL) {
      userDiv.remove(); bubble.remove();
      giveBack();
      chatError("Stopped before the first token. Your message is back in the box.");
      state.lastReply = { text: "", stop_reason: result.stop_reason };
      return;
    }
    finishReply(bubble, body, result);
    showSpeed(result.speed);
    recordRun(`chat ${state.replies.filter((r) => r.reply.startsWith("chat")).length + 1}`, result);
    state.lastReply = { text: result.text, stop_reason: result.stop_reason, speed: result.speed,
      seed: result.seed, token_ids: result.token_ids, prompt_tokens: result.prompt_tokens };
  } catch (err) {
    giveBack();
    if (state.deviceLost) {  // reported by the device's `lost` promise: keep what was shown
      bubble.classList.add("interrupted");
      return;
    }
    bubble.remove();
    chatError(`Generation failed: ${errorText(err)}`);
  } finally {
    setBusy(false);
  }
}

export function compare(app) {
  if (state.busy || state.deviceLost) return;
  running = compareNests(app).finally(() => { running = null; });
}

async function compareNests(app) {
  const text = beginTurn(app);
  if (text === null) return;
  $("compare-panel").hidden = false;
  $("compare-verdict").textContent = "running…";
  $("compare-tiled").textContent = ""; $("compare-sharded").textContent = "";
  try {
    const result = JSON.parse(await app.python.call("compare", { text, request: request() },
      { progress: (nest) => { $("compare-verdict").textContent = `running the ${nest} nest…`; } }));
    if (result.error) {
      $("compare-verdict").textContent = "";
      if (result.device_lost) deviceLost(result.error, setBusy); else chatError(result.error);
      return;
    }
    const shown = (run) => (run.text.trim() ? run.text : `(no visible text; token ids: ${run.token_ids.join(" ")})`);
    $("compare-tiled").textContent = shown(result.runs.tiled);
    $("compare-sharded").textContent = shown(result.runs.sharded);
    $("compare-verdict").textContent = result.identical
      ? "Identical greedy text."
      : `Texts first differ at generated token ${result.first_divergence}.`;
    showCompareFigures(result);
    const series = Object.keys(result.runs).map((nest) => ({
      label: nest === "tiled" ? "tiled nest" : "sharded family", color: COLORS[nest],
      points: result.runs[nest].stats.filter((s) => s.kind === "decode" && s.attention_ms !== null)
        .map((s) => ({ x: s.context, y: s.attention_ms, nest })),
    }));
    state.compareChart = drawSteps($("compare-chart"), series, { switchAt: SWITCH_AT });
    showComparison(series);
    const n = state.replies.filter((r) => r.reply.startsWith("compare")).length / 2 + 1;
    for (const nest of Object.keys(result.runs)) recordRun(`compare ${n} ${nest}`, result.runs[nest]);
    state.lastCompare = { model: state.model.name, identical: result.identical, first_divergence: result.first_divergence,
      teacher_forced: result.teacher_forced, past_switch: result.past_switch,
      prompt_tokens: result.runs.tiled.prompt_tokens };
    recordComparison({ label: `compare ${n}`, ...state.lastCompare });
  } catch (err) {
    chatError(`Comparison failed: ${errorText(err)}`);
  } finally {
    setBusy(false);
  }
}

function showCompareFigures(result) {
  const forced = result.teacher_forced, past = result.past_switch, switchAt = SWITCH_AT;
  const agreement = forced.steps
    ? `${(100 * forced.match_rate).toFixed(1)}% (${forced.matches} of ${forced.steps} steps: the sharded family ` +
      "fed the tiled run's tokens picks the same top-1)"
    : "no generated steps";
  const med = past.median_attention_ms;
  const speedup = past.speedup === null
    ? `no decode steps past ${switchAt} tokens of context (try Long document)` + (med.tiled === null && past.steps.tiled
      ? "; this adapter has no GPU timestamps" : "")
    : `tiled ${fmt(med.tiled, 3)} ms, sharded ${fmt(med.sharded, 3)} ms: ${past.speedup.toFixed(2)}x faster ` +
      `(median over ${past.steps.sharded} steps)`;
  const misses = forced.misses;
  definitionList($("compare-figures"), [["prompt", `${result.runs.tiled.prompt_tokens} tokens`],
    ["teacher-forced agreement", agreement],
    ...(misses.length ? [["teacher-forced misses", missesText(forced), misses.every((m) => m.near_tie) ? "" : "wrong"]] : []),
    [`attention past ${switchAt} tokens`, speedup]]);
}

// A logit difference: two significant digits below 1, two decimals above.
const logits = (value) => (Math.abs(value) >= 1 ? value.toFixed(2) : value.toPrecision(2));
const percent = (fraction) => (fraction >= 0.1 ? (100 * fraction).toFixed(0) : (100 * fraction).toPrecision(2));

function span(values, format = logits) {
  const low = Math.min(...values), high = Math.max(...values);
  return low === high ? format(low) : `${format(low)}-${format(high)}`;
}

const ordinal = (n) => `${n}${n % 100 >= 11 && n % 100 <= 13 ? "th" : ["th", "st", "nd", "rd"][n % 10] || "th"}`;

// One run's figures at a miss: its top-1 minus top-2 logit, and where it put the other run's pick
// when that was not its runner-up.
function runFigures(run, nest, other) {
  return `${nest} margin ${logits(run.margin)}` +
    (run.other_rank === 2 ? "" : ` (the ${other} pick ${ordinal(run.other_rank)}, ${logits(run.lead)} behind)`);
}

// The teacher-forced misses in a line. A near-tie (each run's pick within near_tie_logits of the
// other run's) shows its margins: the sharded run's (the run checked), then the tiled run's. Any
// other miss is shown as such, by its figures and how far apart the two runs' logits were there.
export function missesText(forced) {
  const { misses, near_tie_logits: tie } = forced;
  const ties = misses.filter((m) => m.near_tie), others = misses.filter((m) => !m.near_tie);
  const count = (n, one, many) => `${n} ${n === 1 ? one : many}`;
  const margins = (list) => `margins ${span(list.map((m) => m.sharded.margin))} ` +
    `(the tiled run's: ${span(list.map((m) => m.tiled.margin))})`;
  const repeat = forced.tiled_repeated === false
    ? " The tiled run, repeated for its logits, picked other tokens: its figures are the repeat's." : "";
  const head = count(misses.length, "miss", "misses");
  if (!others.length) return `${head}, ${misses.length === 1 ? "a near-tie" : "all near-ties"}: ${margins(ties)}.${repeat}`;
  const which = others.length === misses.length ? (misses.length === 1 ? "not a near-tie" : "no near-ties")
    : `${count(others.length, "not a near-tie", "not near-ties")}`;
  const shown = others.slice(0, 3).map((m) => `token ${m.step}: ${runFigures(m.sharded, "sharded", "tiled")} / ` +
    `${runFigures(m.tiled, "tiled", "sharded")}`).join("; ") + (others.length > 3 ? `; ${others.length - 3} more in the export` : "");
  return `${head}, ${which} (a pick leads the other run's by more than ${tie} logit; the two runs' logits ` +
    `${span(others.map((m) => m.logits_rel_l2), percent)}% apart there, relative L2): ${shown}.` +
    (ties.length ? ` ${count(ties.length, "near-tie", "near-ties")}: ${margins(ties)}.` : "") + repeat;
}

export async function fillLongDocument() {
  try {
    const response = await fetch(new URL("./long_document.txt", location.href));
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    $("prompt").value = (await response.text()).trim() + LONG_DOCUMENT_QUESTION;
    chatError("");
  } catch (err) {
    chatError(`Cannot load the long document: ${errorText(err)}`);
  }
}

// Stops the reply in flight, if any, and waits for it to end.
export async function stopRunning(app) {
  if (running) { app.python.call("stop"); await running; }
}

export async function newChat(app) {
  await stopRunning(app);  // a reply in flight ends first
  await app.python.call("newChat");
  $("messages").replaceChildren();
  state.steps = [];
  clearRuns();
  clearOverlay();
  chatError("");
}
