"""The runtime's errors for problems a user can act on (a bad request, an artifact to rebuild, a
browser without a feature). A subclass is a kind the page tells the user what to do about
(chat.api.ERROR_HELP): Pyodide hands the page the class name as the error's `type`."""


class ModelError(RuntimeError):
    """A problem with the model artifact or a request, in words a user can act on."""


class NeedsShaderF16(ModelError):
    """The model runs only in float16 here and the adapter has no shader-f16."""
