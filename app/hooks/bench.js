// Test hook, never in the served tree (as python.js): the page's benchmarks and diagnostics
// (app/page_bench/, which the page's wheel does not hold). At boot it copies that package into the
// worker's Python as `page_bench`, from the tests' and benchmarks' server (hooks/page_bench/), and
// adds the call `bench`: page_bench.CALLS[name] run on the page's chat with `values` as its keyword
// arguments; the result comes back as parsed JSON. The page exposes it as window.demo.bench(name, values).
export async function install({ pyodide, handles }) {
  const base = new URL("./page_bench/", import.meta.url);
  const source = async (file) => {
    const response = await fetch(new URL(file, base));
    if (!response.ok) throw new Error(`hooks/page_bench/${file}: HTTP ${response.status}`);
    return response.text();
  };
  const init = await source("__init__.py");
  const files = JSON.parse(init.match(/^FILES = (\[[^\]]*\])/m)[1]);  // page_bench.FILES, written as JSON
  const home = pyodide.runPython("import sysconfig; sysconfig.get_paths()['purelib']") + "/page_bench";
  pyodide.FS.mkdirTree(home);
  for (const file of files) pyodide.FS.writeFile(`${home}/${file}`, file === "__init__.py" ? init : await source(file));
  const bench = pyodide.pyimport("page_bench");
  return {
    async bench(id, { arg: name, values }) {
      return JSON.parse(await bench.call(name, handles.chat, JSON.stringify(values || {})));
    },
  };
}
