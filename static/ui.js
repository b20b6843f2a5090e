// What every module of the page shares: element lookup and window.demoState, the page's state
// (read by the tests and by `python -m app bench page`). Text from the model or the user is only
// ever set through textContent, never as HTML.
import { RUN_OPTION_NAMES } from "./page_api.js";

export const $ = (id) => document.getElementById(id);

// ?layout=shards:8, ?merge_in_o=off, ...: any RunOptions field by name (chat/api.py), passed on as text
// with the model's load and with every request; Python reads and checks it (model_glue.options).
export const URL_RUN_OPTIONS = Object.fromEntries([...new URLSearchParams(location.search)]
  .filter(([name]) => RUN_OPTION_NAMES.includes(name)));

// steps: this conversation's live per-step stats (the overlay); replies: every finished reply or
// comparison run with its speed figures and complete step table (the export); info: the loaded
// model's applied options and dtype (chat.page.chat_info; the runtime's constants are in page_api.js).
// model: what the page runs (main.js nameModel); comparisons: every finished comparison (the JSON export).
export const state = window.demoState = { ready: false, chatReady: false, busy: false, steps: [], replies: [],
  comparisons: [], deviceLost: null, longTasks: [], info: null, model: null, errorKind: null };

export const fmt = (value, digits = 1) => (value === null || value === undefined ? "–" : value.toFixed(digits));
export const MiB = (bytes) => (bytes / 2 ** 20).toFixed(1);

// rows: [term, text] or [term, text, class of the text]
export function definitionList(dl, rows) {
  dl.replaceChildren();
  for (const [k, v, className] of rows) {
    const dt = document.createElement("dt"); dt.textContent = k;
    const dd = document.createElement("dd"); dd.textContent = v;
    if (className) dd.className = className;
    dl.append(dt, dd);
  }
}
