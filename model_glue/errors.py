"""The runtime's error for a problem a user can act on (a bad request, an artifact to rebuild)."""


class ModelError(RuntimeError):
    """A problem with the model artifact or a request, in words a user can act on."""
