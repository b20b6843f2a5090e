"""The app: the page's Python (chat, overlay, comparison) and the native CLI (`python -m app`)."""
