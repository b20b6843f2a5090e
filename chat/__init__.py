"""The chat the page runs (Pyodide): `session` (ChatSession: prompt formatting, streaming, stop,
the comparison of the two nests) and `page` (the functions static/main.js calls, JSON in and out).
`python -m app generate` runs the same ChatSession natively."""
