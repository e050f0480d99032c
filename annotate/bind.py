"""`bind`: a handler `fn(ctx, *inputs, request)` as the `fn(*inputs, request)` Gradio calls.

Every tab's wiring uses it (ui.py, ui_admin.py, ui_train.py), so it lives apart from all of them.
"""

from __future__ import annotations

import functools
import inspect

from annotate.timing import session_of


def bind(fn, ctx):
    """Keep the signature and annotations Gradio reads to inject gr.Request, minus `ctx`.
    With the app's timings on (annotate/timing.py) every call is timed here."""

    @functools.wraps(fn)
    def bound(*args, **kwargs):
        timings = getattr(ctx, "timings", None)
        if timings is None:
            return fn(ctx, *args, **kwargs)
        with timings.handler(session_of(args, kwargs)):
            return fn(ctx, *args, **kwargs)

    params = list(inspect.signature(fn).parameters.values())[1:]
    bound.__signature__ = inspect.Signature(params)
    return bound
