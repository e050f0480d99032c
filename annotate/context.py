"""What every handler shares: the store, the app's settings, the job runner, and who is asking.

Roles are enforced here, on the server, in every handler: `user(ctx, request)` reads the name that
Gradio's login put on the request (`gr.Request.username`, from the signed session cookie) and looks
the account up in the store; `admin(ctx, request)` additionally refuses non-admins. A hidden button
is not a permission: the HTTP API reaches every event, so an annotator calling an admin endpoint
through gradio_client gets `Refused` and nothing happens.

Deactivated accounts are refused here too, on every request, whatever session they still hold.

With `--no-auth` (single-user mode, bound to localhost) there is no login: every request acts as
the one local admin account.

A file a handler hands to the browser (an export, a backup, a model archive) is a `served_copy`:
Gradio serves it from the temp folder, so no data or results folder is ever exposed.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import gradio as gr

from annotate.accounts import Sessions, Throttle
from annotate.timing import Timings, span
from store.records import Annotator


class Refused(gr.Error):
    """The request is not allowed (not signed in, unknown account, not an admin). Shown as an
    error toast in the browser and raised as an error in API clients."""


@dataclass
class AppContext:
    store: object
    """The open store.repo.Store (typed loosely so tests can pass one from any fixture)."""
    auth: bool = True
    """False in --no-auth mode: requests carry no user and act as `local_user`."""
    local_user: str = "local"
    """The admin account used in --no-auth mode."""
    data_dir: Path = field(default_factory=lambda: Path("data"))
    """Where exports are written (data_dir/exports)."""
    jobs: object | None = None
    """pipeline.orchestrate.jobs.JobRunner: every model runs in one of its subprocess jobs
    (generation, training, comparison); None = no models in this app (rank what is stored)."""
    chat: object | None = None
    """pipeline.orchestrate.chat.ChatService: the policy's replies while an annotator waits (the
    Chat tab, annotate/chat.py); the app builds one and closes it at exit. None = no Chat."""
    train_settings: object | None = None
    """pipeline.orchestrate.steps.LoopSettings the jobs start from (model, device, K); None = defaults."""
    generate_defaults: dict = field(default_factory=dict)
    """Defaults for the Generate form: k, max_new_tokens, temperature, top_p."""
    background: object | None = None
    """A concurrent.futures executor that prefetches the next item after an action has returned
    (no extra request from the page); None prefetches inline, before returning (tests)."""
    prefetch: bool = True
    """Fetch the next item ahead. Off only to measure what it buys (bench/ui_bench.py)."""
    timings: Timings | None = field(default=None, repr=False)
    """Where each action's time goes (app.py --timings; annotate/timing.py); None = not measured."""
    accounts: dict = field(default_factory=dict, repr=False)
    """name -> (Annotator, expiry, store.accounts_version): annotation handlers reuse a lookup for
    ACCOUNT_CACHE_S, unless any account changed since."""
    session_hours: float = 12.0
    """A sign-in lasts this long; then the login form is shown again (annotate/accounts.py)."""
    throttle: Throttle = field(default_factory=Throttle, repr=False)
    """Failed sign-ins per name and address, and the locks they earn (annotate/accounts.py)."""
    cookie_id: str = ""
    """The id in the session cookie's name, the store's own (annotate/accounts.py `cookie_id`);
    set by `launch`."""
    sessions: Sessions | None = field(default=None, repr=False)
    """Gradio's sign-in tokens with their ages, once `launch` has installed them (None before,
    and in tests that call handlers directly)."""

    @property
    def export_dir(self) -> Path:
        return self.data_dir / "exports"


ACCOUNT_CACHE_S = 10.0
"""How long annotation handlers reuse an account lookup (a query per submit is a tenth of its cost
under load). A cached lookup is dropped as soon as any account changes (the store's
accounts_version moves), so a deactivation or a role change applies to the next request; admin
actions look the account up afresh anyway."""


def user(ctx: AppContext, request, *, fresh: bool = False) -> Annotator:
    """The signed-in account behind this request (Refused if there is none)."""
    with span(ctx, "account"):
        return _look_up(ctx, request, fresh)


def _look_up(ctx: AppContext, request, fresh: bool) -> Annotator:
    name = getattr(request, "username", None) if request is not None else None
    if name is None:
        if ctx.auth:
            raise Refused("Not signed in.")
        name = ctx.local_user
    now = time.monotonic()
    version = ctx.store.accounts_version
    cached = None if fresh else ctx.accounts.get(name)
    if cached is not None and cached[1] > now and cached[2] == version:
        return cached[0]
    account = ctx.store.find_annotator(name)
    if account is None:
        ctx.accounts.pop(name, None)
        raise Refused(f"No account named {name!r}: ask an admin to add you.")
    if not account.active:
        ctx.accounts.pop(name, None)
        raise Refused(f"The account {name!r} is deactivated: ask an admin.")
    ctx.accounts[name] = (account, now + ACCOUNT_CACHE_S, version)
    return account


def admin(ctx: AppContext, request) -> Annotator:
    """The signed-in account, which must be an admin (Refused otherwise; nothing else happens)."""
    account = user(ctx, request, fresh=True)
    if not account.is_admin:
        raise Refused(f"{account.name} is an annotator: this action is for admins only.")
    return account


def served_copy(path: Path, cache_name: str) -> Path:
    """The file as Gradio serves it: a copy under the temp folder's `cache_name`, one per file
    version (its path and mtime name it), so serving it again adds nothing. A hard link where the
    filesystem allows (an exported model or a backup is large), a folder zipped; written under a
    temporary name, so a reader never sees half a file."""
    key = hashlib.sha1(f"{path.resolve()}:{path.stat().st_mtime_ns}".encode()).hexdigest()[:16]
    folder = Path(tempfile.gettempdir()) / cache_name / key
    copy = folder / (f"{path.name}.zip" if path.is_dir() else path.name)
    if not copy.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{os.getpid()}-{threading.get_ident()}"
        if path.is_dir():
            tmp = Path(shutil.make_archive(str(tmp), "zip", root_dir=path))
        else:
            try:
                os.link(path, tmp)
            except OSError:
                shutil.copy2(path, tmp)
        os.replace(tmp, copy)
    return copy
