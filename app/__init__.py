"""The native command line (`python -m app`: build, convert, check, serve, generate, bench), with
the numpy benchmarks under `app.bench`. It runs from the checkout and is never shipped to the
browser; nothing imports it."""
