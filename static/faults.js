// What goes wrong, said plainly: Python errors, a failed start, a lost GPU device, and main-thread
// tasks long enough to freeze the page (recorded for the tests).
import { ERROR_HELP } from "./page_api.js";
import { $, state } from "./ui.js";

// Main-thread tasks over 50 ms (the browser's definition), to check that a reply keeps the page usable.
export function watchLongTasks() {
  try {
    new PerformanceObserver((list) => {
      for (const e of list.getEntries()) state.longTasks.push({ start: e.startTime, duration: e.duration });
    }).observe({ type: "longtask", buffered: true });
  } catch { /* no Long Tasks API: nothing recorded */ }
}

// A Python exception reaches JS as a PythonError whose message is the whole traceback: show its
// last line, without the module path of the exception class.
export function errorText(err) {
  const text = String((err && err.message) || err).trim();
  if (!err || err.type === undefined) return text;
  const last = text.split("\n").filter((line) => line.trim()).pop() || text;
  return last.replace(/^[\w.]*\.(\w+: )/, "$1");
}

// What the user can do about an error, where its kind is one the runtime names (chat.api.error_help):
// the Python class it came from, else null.
export function errorKind(err) {
  return err && Object.hasOwn(ERROR_HELP, err.type) ? err.type : null;
}

// An error in the status panel (`err`, the error itself where there is one: its kind's help shown below).
export function showError(message, err = null) {
  const kind = errorKind(err);
  $("error").textContent = message;
  $("error").hidden = false;
  $("error-help").textContent = kind ? ERROR_HELP[kind] : "";
  $("error-help").hidden = !kind;
  state.errorKind = kind;
}

export function hideError() {
  $("error").hidden = true;
  $("error-help").hidden = true;
  state.errorKind = null;
}

export function fail(message, err = null) {
  for (const li of $("progress").querySelectorAll("li.active")) li.className = "";
  $("status-details").open = true;
  $("status-summary").textContent = "failed";
  showError(message, err);
  state.error = message;
}

export function chatError(message) {
  $("chat-error").textContent = message || "";
  $("chat-error").hidden = !message;
}

// The GPU device can be lost at any time (driver reset, another tab, device.destroy()). The page
// says so, keeps everything on screen and in the box, and offers to load the model again.
export function deviceLost(message, setBusy) {
  if (state.deviceLost) return;
  state.deviceLost = message;
  $("device-lost-text").textContent = message;
  $("device-lost").hidden = false;
  setBusy(state.busy);
}
