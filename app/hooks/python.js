// Test hook, never in the served tree: the tests' and the benchmarks' servers serve app/hooks/ at
// static's hooks/ (app/server.py, make_server(..., hooks=True)); the worker imports it when the page
// asks for it (?hooks=python). It adds the call `python`: Python source run with `page`, `session`
// and `chat` in scope (and `values`, converted), in one namespace kept between calls; the result
// comes back as plain JS. The page exposes it as window.demo.python(code, values).
export function install({ pyodide, page, handles }) {
  let namespace = null;
  return {
    async python(id, { arg: code, values }) {
      namespace = namespace || pyodide.globals.get("dict")();
      namespace.set("page", page);
      namespace.set("session", handles.session);
      namespace.set("chat", handles.chat);
      namespace.set("values", pyodide.toPy(values || {}));
      const result = await pyodide.runPythonAsync(code, { globals: namespace });
      return result && typeof result.toJs === "function"
        ? result.toJs({ dict_converter: Object.fromEntries, create_pyproxies: false }) : result;
    },
  };
}
