"""What the store and the training side both read and write, with neither torch nor duckdb.

`store/` (the database side) and `pipeline/` (the tensor side) never import each other's
internals, and neither may drag the other's heavy dependencies in; the formats they share live
here, once: `hashing.py` (the SHA-256 of a pairs snapshot, recorded by the store and written by
train-reward), `chat.py` (chat messages and HH-RLHF transcripts, converted one way for both) and
`rows.py` (a data file read into numbered rows: a file the Data tab imports is one train-reward reads).
"""
