"""`bind`: a handler `fn(ctx, *inputs, request)` as the `fn(*inputs, request)` Gradio calls;
`bind_form`: a handler `fn(ctx, form, *inputs, request)` whose form (a dataclass) Gradio passes
as one component per field, in the fields' order, the order `form_inputs` lists the components in.

Every tab's wiring uses it (ui.py, ui_admin.py, ui_train.py), so it lives apart from all of them.
"""

from __future__ import annotations

import dataclasses
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


def bind_form(fn, ctx, form_cls):
    """`fn(ctx, form, *rest, request)` as the `fn(*form values, *rest, request)` Gradio calls: the
    first len(fields) values become `form_cls(...)` by position, the fields' order being the order
    the tab lists the form's components in (built from the same fields, so they cannot differ)."""
    names = [f.name for f in dataclasses.fields(form_cls)]
    inner = bind(fn, ctx)

    @functools.wraps(fn)
    def bound(*args, **kwargs):
        return inner(form_cls(*args[:len(names)]), *args[len(names):], **kwargs)

    rest = list(inspect.signature(fn).parameters.values())[2:]
    form = [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in names]
    bound.__signature__ = inspect.Signature(form + rest)
    return bound


def form_inputs(form_cls, components: dict) -> list:
    """A form's components (by field name) in the order of its fields, which `bind_form` turns
    back into the form."""
    return [components[f.name] for f in dataclasses.fields(form_cls)]
