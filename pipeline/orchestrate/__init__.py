"""The orchestration side: what runs next, and what the store learns of it.

These modules own the store (or are used by what owns it): `jobs` launches subprocess jobs and
ingests their run directories, `loop` is the round state machine, `simulate` ranks items with an
`oracle` as an annotator would. The training side (the modules of `pipeline/` itself) never
imports them, nor `store/`, `annotate/` or gradio.
"""
