#!/usr/bin/env bash
# Print the path of a Python >= 3.12 (pyodide-build needs it): PATH first, then pyenv's versions.
set -u
ok() { "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' 2>/dev/null; }
for name in python3.12 python3.13 python3; do
  p=$(command -v "$name" 2>/dev/null) && ok "$p" && { echo "$p"; exit 0; }
done
root=$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")
# 3.12 first: the version every pinned dependency was verified with.
for p in $(ls -d "$root"/versions/3.12*/bin/python3 2>/dev/null | sort -rV) \
         $(ls -d "$root"/versions/3.1[3-9]*/bin/python3 2>/dev/null | sort -V); do
  ok "$p" && { echo "$p"; exit 0; }
done
echo "error: no Python >= 3.12 found on PATH or in pyenv ($root/versions)." >&2
echo "       Install one (e.g. 'apt-get install python3.12' or 'pyenv install 3.12') and re-run make." >&2
exit 1
