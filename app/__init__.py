"""The app. `page` and `chat` run in the page (Pyodide) and in `python -m app generate`; the rest is
the native CLI (`python -m app`: build, convert, check, serve, generate, bench), with the numpy
benchmarks under `app.bench`."""
