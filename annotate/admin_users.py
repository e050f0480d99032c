"""Admin handlers of the Data tab's Users sub-tab: accounts, roles, passwords, deactivation, locks.

Every function starts with `admin(ctx, request)` (annotate/context.py): an annotator reaching
these endpoints through the HTTP API is refused before anything is read or written. A change that
should end an account's sessions ends them at once (`ctx.sessions`, annotate/accounts.py).
"""

from __future__ import annotations

import math

import gradio as gr
import pandas as pd

from annotate.context import AppContext, admin
from store.errors import StoreError
from store.records import ROLES
from store.users import generate_password


def annotator_names(ctx: AppContext, request: gr.Request):
    """Choices for the export's annotator filter."""
    admin(ctx, request)
    return gr.update(choices=[acc.name for acc in ctx.store.list_annotators()])


def users_table(ctx: AppContext, request: gr.Request) -> pd.DataFrame:
    """Every account: role, whether it may sign in, its last sign-in (UTC), and whether failed
    sign-ins have locked it for now (annotate/accounts.py)."""
    admin(ctx, request)
    locked = ctx.throttle.locked_names()
    when = lambda t: "–" if t is None else t.strftime("%Y-%m-%d %H:%M")  # noqa: E731
    return pd.DataFrame([{"id": a.id, "name": a.name, "role": a.role, "active": "yes" if a.active else "no",
                          "last sign-in": when(a.last_login_at), "created": when(a.created_at),
                          "locked": f"{math.ceil(locked[a.name])} s" if a.name in locked else "–"}
                         for a in ctx.store.list_annotators()],
                        columns=["id", "name", "role", "active", "last sign-in", "created", "locked"])


def form_text(value, label: str) -> str:
    """A form's text field, checked: gr.Error naming the field when it is not text (None = "")."""
    if value is None:
        return ""
    if not isinstance(value, str):
        raise gr.Error(f"{label} must be text, not {value!r}.")
    return value


def _account(ctx: AppContext, name: str):
    name = form_text(name, "Account name").strip()
    if not name:
        raise gr.Error("Give the account's name.")
    try:
        return ctx.store.annotator_named(name)
    except StoreError as exc:
        raise gr.Error(f"{exc}.") from None


def _end_sessions(ctx: AppContext, name: str) -> str:
    ended = ctx.sessions.end(name) if ctx.sessions is not None else 0
    return f" {ended} open session{'s' if ended != 1 else ''} ended." if ended else ""


def reset_password(ctx: AppContext, name: str, password: str, request: gr.Request):
    """Give an account a new password (blank: a random one, shown once) and end its sessions.
    Returns (message, users)."""
    admin(ctx, request)
    account = _account(ctx, name)
    password = form_text(password, "Password")
    shown = not password.strip()
    password = generate_password() if shown else password
    try:
        ctx.store.set_password(account.id, password)
    except StoreError as exc:
        raise gr.Error(f"Password not reset: {exc}.") from None
    ctx.throttle.unlock(account.name)
    msg = f"New password for **{account.name}**." + _end_sessions(ctx, account.name)
    if shown:
        msg += f" One-time password: `{password}` (shown only now; pass it on privately)."
    return msg, users_table(ctx, request)


def change_role(ctx: AppContext, name: str, role: str, request: gr.Request):
    """Make an account an annotator or an admin (applies to its next request). Returns (message, users)."""
    admin(ctx, request)
    account = _account(ctx, name)
    if role not in ROLES:
        raise gr.Error(f"Role must be one of {', '.join(ROLES)}, not {role!r}.")
    try:
        ctx.store.set_role(account.id, role)
    except StoreError as exc:
        raise gr.Error(f"Role not changed: {exc}.") from None
    return f"**{account.name}** is now an {role}.", users_table(ctx, request)


def set_active(ctx: AppContext, name: str, active: bool, request: gr.Request):
    """Deactivate an account (its sessions end now, its rankings stay) or activate it again.
    Returns (message, users)."""
    admin(ctx, request)
    account = _account(ctx, name)
    try:
        ctx.store.set_active(account.id, bool(active))
    except StoreError as exc:
        raise gr.Error(f"Not changed: {exc}.") from None
    if active:
        return f"**{account.name}** can sign in again.", users_table(ctx, request)
    return (f"**{account.name}** is deactivated: it cannot sign in, its rankings stay."
            + _end_sessions(ctx, account.name), users_table(ctx, request))


def deactivate(ctx: AppContext, name: str, request: gr.Request):
    return set_active(ctx, name, False, request)


def activate(ctx: AppContext, name: str, request: gr.Request):
    return set_active(ctx, name, True, request)


def unlock(ctx: AppContext, name: str, request: gr.Request):
    """Clear an account's failed sign-ins, so it may try again now. Returns (message, users)."""
    admin(ctx, request)
    account = _account(ctx, name)
    was = ctx.throttle.unlock(account.name)
    msg = f"**{account.name}** is unlocked." if was else f"**{account.name}** had no failed sign-ins."
    return msg, users_table(ctx, request)


def add_user(ctx: AppContext, name: str, role: str, password: str, request: gr.Request):
    """Create an account. A blank password gets a random one, shown once. Returns (message, users)."""
    admin(ctx, request)
    name, password = form_text(name, "Name"), form_text(password, "Password")
    if role not in ROLES:
        raise gr.Error(f"Role must be one of {', '.join(ROLES)}.")
    shown = not password.strip()
    password = generate_password() if shown else password
    try:
        account = ctx.store.add_annotator(name, password, role=role)
    except StoreError as exc:
        raise gr.Error(str(exc)) from None
    msg = f"Added **{account.name}** ({account.role})."
    if shown:
        msg += f" One-time password: `{password}` (shown only now; pass it on privately)."
    return msg, users_table(ctx, request)
