"""The store's command line: `python -m store [--db PATH] <command> ...`.

    python -m store users add NAME [--admin] [--password P]
    python -m store users list
    python -m store users passwd NAME [--password P]     set a chosen password
    python -m store users reset NAME                     set a random password and print it
    python -m store users role NAME annotator|admin
    python -m store users deactivate|activate NAME       (a deactivated account keeps its rankings)
    python -m store backup PATH                          a copy of the whole database
    python -m store restore BACKUP                       check BACKUP, then put it in place of --db
    python -m store import-prompts FILE
    python -m store import-pairs FILE
    python -m store import-items FILE [--from items|labelstudio] [--evaluation NAME]
                                                         prompts with 2..16 responses to rank
    python -m store export --format jsonl|parquet|datasets --out PATH [--trl-format conversational|text]
                           [--margin-column] [--license ID] [--min-quality Q] [--quality-weights] [filters]
    python -m store stats                                counts, agreement (per annotator too), gold accuracy
    python -m store queue [--overlap N] [--gold-rate X] [--round R [--round-overlap N|default]
                          [--priority P|default]]        show or set how items are handed out
    python -m store gold list | import FILE | mark RANKING_ID | remove ITEM_ID
    python -m store evaluations [NAME] [--json FILE]     blind evaluations: win rates and leaderboard

The database defaults to $RLHF_LOOP_DB, else ./data/rlhf.duckdb. While the app runs it owns the
file, and these commands stop with a message saying so (use the app's admin tab instead: Data >
Users, Data > Backup). `restore` keeps the database it replaces beside it (`*.before-restore-*`).
Exit status: 0 done, 1 refused input (nothing stored), 2 the database is in use or missing.
"""

from __future__ import annotations

import argparse
import dataclasses
import getpass
import json
import sys
from pathlib import Path

from store.db import default_db_path
from store.errors import DataError, InvalidRequest, NotFoundError, StoreLockedError
from store.records import EXPORT_FORMATS, ITEM_FORMATS, ROLES
from store.export_options import TRL_FORMATS, ExportOptions
from store.quality import MIN_WEIGHT
from store.users import MIN_PASSWORD_CHARS, generate_password


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m store", description="Manage the rlhf-loop database.")
    p.add_argument("--db", default=None, help=f"database file (default: $RLHF_LOOP_DB or {default_db_path()})")
    sub = p.add_subparsers(dest="command", required=True)
    _users_parser(sub)
    bk = sub.add_parser("backup", help="copy the whole database to a file (while the app runs: Data > Backup)")
    bk.add_argument("path")
    bk.add_argument("--overwrite", action="store_true", help="replace an existing file")
    rs = sub.add_parser("restore", help="check a backup and put it in place of the database (app stopped)")
    rs.add_argument("backup")

    _import_parsers(sub)
    _export_parser(sub)
    sub.add_parser("stats", help="counts, per-annotator work, agreement, position bias")

    q = sub.add_parser("queue", help="show or set the overlap, a round's overlap and priority, the gold rate")
    q.add_argument("--overlap", type=int, help="how many annotators rank each item (rounds without their own)")
    q.add_argument("--gold-rate", type=float, help="share of each annotator's items that are gold items (0-1)")
    q.add_argument("--round", type=int, help="the round --round-overlap and --priority set")
    q.add_argument("--round-overlap", help="the round's own overlap, or 'default' (the store's)")
    q.add_argument("--priority", help="the round's priority (higher first), or 'default' (newest round first)")
    gold = sub.add_parser("gold", help="gold items: reference rankings").add_subparsers(dest="action", required=True)
    gold.add_parser("list", help="the gold items and their references")
    gold.add_parser("import", help='import gold rankings (JSONL: {"item"|"prompt", "ranking"})').add_argument("file")
    gold.add_parser("mark", help="make a ranking the reference of its item").add_argument("ranking_id", type=int)
    gold.add_parser("remove", help="an item is no longer gold").add_argument("item_id", type=int)
    ev = sub.add_parser("evaluations", help="blind evaluations (started in the Models tab or with python -m pipeline "
                                            "evaluate): each one's progress, the win rates and leaderboard")
    ev.add_argument("name", nargs="?", help="the results of this evaluation only (default: of every evaluation)")
    ev.add_argument("--json", metavar="FILE", help="also write the results to FILE as JSON")
    return p


def _users_parser(sub) -> None:
    users = sub.add_parser("users", help="annotator accounts").add_subparsers(dest="action", required=True)
    add = users.add_parser("add", help="create an account (prints a generated password if none is given)")
    add.add_argument("name")
    add.add_argument("--admin", action="store_true", help="give the account the admin role")
    add.add_argument("--password", help=f"its password (at least {MIN_PASSWORD_CHARS} characters); "
                                        "default: asked for on a terminal, else generated and printed")
    users.add_parser("list", help="list accounts")
    passwd = users.add_parser("passwd", help="set an account's password (asked for on a terminal)")
    passwd.add_argument("name")
    passwd.add_argument("--password", help=f"the new password (at least {MIN_PASSWORD_CHARS} characters)")
    users.add_parser("reset", help="give an account a random password and print it").add_argument("name")
    role = users.add_parser("role", help="change an account's role")
    role.add_argument("name")
    role.add_argument("role", choices=ROLES)
    users.add_parser("deactivate", help="stop an account from signing in (its rankings stay)").add_argument("name")
    users.add_parser("activate", help="let a deactivated account sign in again").add_argument("name")


def _import_parsers(sub) -> None:
    for name, what in (("import-prompts", "prompts (a 'prompt' or 'messages' column)"),
                       ("import-pairs", "preference pairs (TRL prompt/chosen/rejected, or HH-RLHF transcripts)"),
                       ("import-items", "items to rank: a prompt ('prompt' or 'messages') and 2..16 responses "
                                        "('responses', or response_1..n with model_1..n), each with an optional "
                                        "model name")):
        imp = sub.add_parser(name, help=f"import {what} from JSONL, CSV or Parquet")
        imp.add_argument("file")
        imp.add_argument("--max-mb", type=float, default=None, help="refuse files larger than this (MiB)")
        if name == "import-items":
            imp.add_argument("--evaluation", metavar="NAME", default=None,
                             help="import the items as a blind evaluation of this name between the models the file "
                                  "names (one response from each per row; results: the evaluations command)")
            imp.add_argument("--from", dest="items_format", choices=ITEM_FORMATS, default="items",
                             help="items (default): rows of a prompt and its responses; labelstudio: a Label "
                                  "Studio JSON export of a ranking or pairwise project; argilla: an Argilla ranking "
                                  "dataset's Hub export (its folder or its rows); the rankings made there come in "
                                  "with who made them")


def _export_parser(sub) -> None:
    """`export`: each option's dest is the ExportOptions field it sets (store/export_options.py)."""
    exp = sub.add_parser(
        "export", help="export pairs (TRL preference format), rankings and a dataset card; record the snapshot",
        description="Export the preference pairs as a TRL preference dataset, the rankings behind them, a "
                    "dataset card (README.md) and a manifest, and record the snapshot with its SHA-256.")
    exp.add_argument("--format", choices=EXPORT_FORMATS, default="jsonl", help="file format (default: jsonl)")
    exp.add_argument("--out", required=True,
                     help="a folder (pairs, rankings/, README.md, snapshot.json inside); or, for jsonl and "
                          "parquet, the pairs file itself (NAME.jsonl / NAME.parquet, the rest beside it)")
    exp.add_argument("--trl-format", choices=TRL_FORMATS, default="conversational",
                     help="conversational (default): prompt as chat messages, chosen/rejected as one assistant "
                          "message each (TRL applies the chat template); text: plain strings, chat prompts as "
                          "HH-style transcripts")
    exp.add_argument("--margin-column", action="store_true",
                     help="also write a `margin` column: the pair's strength as Llama 2's margin (much better 1, "
                          "better 2/3, slightly better 1/3, about the same 0) where the annotator gave one, else "
                          "the rank gap. TRL's RewardTrainer reads a column of that name and trains with "
                          "-log sigmoid(r_chosen - r_rejected - margin) (so does train-reward --margin); "
                          "DPOTrainer ignores it. Without this option the rank gap is only in `rank_gap` and the "
                          "strength only in `strength`, which no trainer reads")
    exp.add_argument("--license", default="unknown", help="the dataset card's license field (e.g. cc-by-4.0)")
    exp.add_argument("--round", type=int, action="append", dest="rounds", help="only this round (repeatable)")
    exp.add_argument("--annotator", action="append", dest="annotators", help="only this annotator (repeatable)")
    exp.add_argument("--min-agreement", type=float,
                     help="keep pairs that at least this share of the item's rankings agree with")
    exp.add_argument("--since", help="pairs created at or after this UTC date/time (ISO)")
    exp.add_argument("--until", help="pairs created before this UTC date/time (ISO)")
    exp.add_argument("--include-all-bad", action="store_true", help="also pairs from 'all bad' rankings")
    exp.add_argument("--no-imported", dest="include_imported", action="store_false", help="leave out imported pairs")
    exp.add_argument("--min-quality", type=float,
                     help="leave out annotators whose quality (gold accuracy, else agreement with the majority; "
                          "see `stats`) is below this (0-1); annotators not measured yet are kept")
    exp.add_argument("--quality-weights", action="store_true",
                     help=f"add a `weight` column: each pair's annotator's quality q as 2q - 1, clipped to "
                          f"[{MIN_WEIGHT}, 1] (1 when not measured, and for imported pairs); train-reward weighs "
                          "each pair's loss by it")
    exp.add_argument("--test-fraction", type=float, default=0.0, help="share of prompts held out as 'test'")
    exp.add_argument("--seed", type=int, default=0, help="seed of the train/test split")
    exp.add_argument("--overwrite", action="store_true", help="replace an existing output")


def options_from_args(args: argparse.Namespace) -> ExportOptions:
    """The options of `export`'s command line (an option's dest is the field it sets)."""
    return ExportOptions(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ExportOptions)
                            if hasattr(args, f.name)})


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from store.repo import Store  # after parsing, so --help is fast

    if args.command == "restore":  # never opens the database as a Store: it replaces the file
        return _restore(args)
    try:
        store = Store(args.db)
    except StoreLockedError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        return _run(store, args)
    except DataError as exc:
        print(f"error: {exc.path}: nothing was stored", file=sys.stderr)
        for row, problem in exc.errors:
            print(f"  {'file' if row is None else f'row {row}'}: {problem}", file=sys.stderr)
        if exc.more:
            print(f"  ... and {exc.more} more problems", file=sys.stderr)
        return 1
    except (InvalidRequest, NotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        store.close()


def _run(store, args) -> int:
    from store import io

    if args.command == "users" and args.action == "add":
        password, shown = args.password, False
        if password is None and sys.stdin.isatty():
            password = getpass.getpass(f"password for {args.name} (empty: generate one): ")
            if password and getpass.getpass("again: ") != password:
                print("error: the passwords differ", file=sys.stderr)
                return 1
        if not password:
            password, shown = generate_password(), True
        user = store.add_annotator(args.name, password, ROLES[1] if args.admin else ROLES[0])
        print(f"created {user.role} {user.name!r} (id {user.id})")
        if shown:
            print(f"password: {password}")
    elif args.command == "users" and args.action == "list":
        for a in store.list_annotators():
            last = "never" if a.last_login_at is None else f"{a.last_login_at:%Y-%m-%d %H:%M} UTC"
            print(f"{a.id:>4}  {a.name:<24} {a.role:<10} {'active' if a.active else 'DEACTIVATED':<12}"
                  f"created {a.created_at:%Y-%m-%d %H:%M} UTC, last sign-in {last}")
    elif args.command == "users":
        return _manage_user(store, args)
    elif args.command == "backup":
        from store.backup import backup

        info = backup(store, args.path, overwrite=args.overwrite)
        rows = sum(n for n, _ in info["tables"].values())
        print(f"backed up {len(info['tables'])} tables ({rows} rows, {info['bytes']} bytes) to {info['path']}")
    elif args.command in ("import-prompts", "import-pairs", "import-items"):
        limit = {} if args.max_mb is None else {"max_bytes": int(args.max_mb * 1024 * 1024)}
        if args.command == "import-items":
            from store.import_items import import_items

            result = import_items(store, args.file, fmt=args.items_format, evaluation=args.evaluation, **limit)
        else:
            fn = io.import_prompts if args.command == "import-prompts" else io.import_pairs
            result = fn(store, args.file, **limit)
        print(json.dumps(result, indent=2))
    elif args.command == "export":
        snap = io.export_dataset(store, args.out, options_from_args(args))
        print(f"snapshot {snap.id}: {snap.counts['pairs']} pairs, {snap.counts['rankings']} rankings -> "
              f"{snap.path} (sha256 {snap.sha256[:16]}...)")
        print(json.dumps(snap.counts))
        if snap.filters.get("excluded_annotators"):
            print(f"left out (quality below {snap.filters['min_quality']:g}): "
                  + ", ".join(snap.filters["excluded_annotators"]))
    elif args.command == "stats":
        _print_stats(store)
    elif args.command == "queue":
        _queue(store, args)
    elif args.command == "gold":
        _gold(store, args)
    elif args.command == "evaluations":
        _evaluations(store, args)
    return 0


def _evaluations(store, args) -> None:
    names = {mv.id: mv.name for mv in store.list_model_versions()}
    for e in store.list_evaluations():
        print(f"evaluation {e.id:<4} {e.name:<32} {', '.join(names.get(v, str(v)) for v in e.version_ids):<40} "
              f"{len(e.prompt_ids)} prompts, {e.items} items, {e.rankings} rankings")
    ev = None
    if args.name:
        ev = store.find_evaluation(args.name)
        if ev is None:
            raise NotFoundError(f"no evaluation named {args.name!r}")
    results = store.evaluation_results(None if ev is None else ev.id)
    print(f"\n{results['comparisons']} comparisons on {results['prompts']} prompts "
          f"({'every evaluation' if ev is None else ev.name}); 95% bootstrap intervals over prompts")
    print("version                          rating   95% interval   comparisons")
    for r in results["leaderboard"]:
        print(f"{r['version']:<32} {r['rating']:>6.0f}   {r['low']:>5.0f} to {r['high']:<5.0f} {r['comparisons']:>11}")
    for r in results["win_rates"]:
        print(f"{r['a']} over {r['b']}: {r['win_rate']:.1%} [{r['low']:.1%}, {r['high']:.1%}] "
              f"of {r['comparisons']} comparisons")
    if args.json:
        Path(args.json).write_text(json.dumps({"evaluation": None if ev is None else ev.name, **results}, indent=2),
                                   encoding="utf-8")
        print(f"wrote {args.json}")


def _manage_user(store, args) -> int:
    account = store.annotator_named(args.name)
    if args.action == "passwd":
        password = args.password
        if password is None:
            if not sys.stdin.isatty():
                print("error: give --password, or run this on a terminal to be asked", file=sys.stderr)
                return 1
            password = getpass.getpass(f"new password for {account.name}: ")
            if getpass.getpass("again: ") != password:
                print("error: the passwords differ", file=sys.stderr)
                return 1
        store.set_password(account.id, password)
        print(f"password of {account.name!r} changed")
    elif args.action == "reset":
        password = generate_password()
        store.set_password(account.id, password)
        print(f"password of {account.name!r} reset\npassword: {password}")
    elif args.action == "role":
        store.set_role(account.id, args.role)
        print(f"{account.name!r} is now an {args.role}")
    else:
        store.set_active(account.id, args.action == "activate")
        print(f"{account.name!r} is {'active' if args.action == 'activate' else 'deactivated (its rankings stay)'}")
    return 0


def _restore(args) -> int:
    from store.backup import BackupError, restore

    db = args.db or default_db_path()
    try:
        info = restore(args.backup, db)
    except StoreLockedError as exc:
        print(f"error: {exc}; nothing was restored", file=sys.stderr)
        return 2
    except (BackupError, InvalidRequest) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    rows = sum(n for n, _ in info["tables"].values())
    print(f"restored {args.backup} ({len(info['tables'])} tables, {rows} rows) to {db}")
    if info["replaced"]:
        print(f"the database it replaced is kept as {info['replaced']}")
    return 0


def _queue(store, args) -> None:
    """Set what was given, then print the queue's settings and the rounds'."""
    if args.overlap is not None:
        store.set_queue_overlap(args.overlap)
    if args.gold_rate is not None:
        store.set_gold_rate(args.gold_rate)
    if args.round_overlap is not None or args.priority is not None:
        if args.round is None:
            raise InvalidRequest("--round-overlap and --priority need --round")
        overlap, priority = store.round_queue().get(args.round, (None, None))
        store.set_round_queue(args.round, overlap=_number_or_default(args.round_overlap, overlap, "--round-overlap"),
                              priority=_number_or_default(args.priority, priority, "--priority"))
    print(f"overlap {store.queue_overlap()} (rounds without their own), gold rate {store.gold_rate():g}")
    settings = store.round_queue()
    for r in store.list_rounds():
        overlap, priority = settings.get(r.id, (None, None))
        print(f"round {r.id:<4} {r.status:<11} overlap {'default' if overlap is None else overlap:<8} "
              f"priority {'default' if priority is None else priority}")


def _number_or_default(text: str | None, current, flag: str):
    """The round setting a flag gives: unchanged if absent, None for 'default', else a whole number."""
    if text is None:
        return current
    if text.strip().lower() == "default":
        return None
    try:
        return int(text)
    except ValueError:
        raise InvalidRequest(f"{flag} takes a whole number or 'default', not {text!r}") from None


def _gold(store, args) -> None:
    if args.action == "import":
        result = store.import_gold(args.file)
        print(f"imported {result['rows']} gold items from {args.file}")
    elif args.action == "mark":
        g = store.set_gold_from_ranking(args.ranking_id)
        print(f"item {g.item_id} is gold, with ranking {args.ranking_id} as its reference")
    elif args.action == "remove":
        store.remove_gold(args.item_id)
        print(f"item {args.item_id} is no longer gold")
    for g in store.gold_items():
        order = " > ".join(" = ".join(map(str, group)) for group in g.order)
        print(f"item {g.item_id:<6} {order:<40} {g.source}")


def _print_stats(store) -> None:
    for key, value in store.counts().items():
        print(f"{key:<18} {value}")
    print("\nannotator              rankings  today  pairs  skips  all_bad  median_s")
    for s in store.annotator_stats():
        med = "-" if s.median_duration_s is None else f"{s.median_duration_s:.1f}"
        print(f"{s.name:<22} {s.rankings:>8} {s.rankings_today:>6} {s.pairs:>6} {s.skips:>6} {s.all_bad:>8} {med:>9}")
    ag = store.agreement()
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    print(f"\nagreement on {ag.items} items ranked by 2+ annotators: pairwise {fmt(ag.pairwise_agreement)}, "
          f"Krippendorff alpha (ordinal) {fmt(ag.krippendorff_alpha)}, Kendall tau-b {fmt(ag.kendall_tau)}")
    pb = store.position_bias()
    print(f"position bias over {pb.rankings} rankings: first-shown ranked best {fmt(pb.first_shown_best_rate)} "
          f"(no bias: {fmt(pb.expected_rate)})")
    print("\nannotator              agrees: others  majority  gold (items)  first shown best (no bias)")
    for a in store.annotator_agreement():
        print(f"{a.name:<22} {fmt(a.pairwise_agreement):>14} {fmt(a.majority_agreement):>9} "
              f"{fmt(a.gold_accuracy):>6} ({a.gold_items:>3})  {fmt(a.first_shown_best_rate):>16} "
              f"({fmt(a.expected_first_rate)})")


if __name__ == "__main__":
    sys.exit(main())
