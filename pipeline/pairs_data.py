"""Preference pairs for the pairs trainers (train-reward, train-dpo): read, check, split, tokenise, batch.

Formats read (one pair per row, fields prompt / chosen / rejected, optional margin, weight and
split):
- a file as the store's imports read it (formats/rows.py: JSON Lines, JSON, CSV or Parquet), a
  `datasets` folder (`save_to_disk`; every split of a DatasetDict, by name), or a folder of
  .parquet/.jsonl files; rows are numbered from 1 (JSONL: the line), as the imports number them;
- HH-RLHF style rows without a prompt: chosen/rejected are whole transcripts, split at the last
  "\\n\\nAssistant:" (the prompt is the shared prefix up to and including it);
- TRL's conversational form: prompt a list of {role, content} messages, chosen/rejected a list
  ending with the assistant's message (or whole conversations with an implicit shared prompt).

`weight` (an export's quality_weights column, store/export.py): how much the pair counts in the
Bradley-Terry loss, a positive finite number; 1.0 when the column is absent or the value is null.

A snapshot exported with a test split (store/export.py: column `split`, or a DatasetDict with a
'test' split) keeps that split: its 'test' pairs are the held-out set.

Bad input raises PairsError naming the file, the row and the field. Pairs whose chosen and rejected
responses are identical carry no preference (their loss gradient is exactly zero): they are
dropped, counted, and reported; a file left with no pairs is refused.

Tokenising (must match how PPO will score policy samples): prompt messages through the chat
template with the generation prompt (pipeline/text.prompt_token_ids), then the response
tokens, then EOS, the token generation stops at. Chosen and rejected keep one shared prompt. Longer
than max_length: the prompt loses tokens from its left until it fits beside the longer response
(counted as prompt-truncated); a response that alone exceeds max_length - 1 keeps its last tokens
(counted as response-truncated). Nothing is dropped.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch

from formats.chat import ASSISTANT_MARK, split_hh
from formats.rows import EMPTY, RowsError, read_rows
from pipeline.text import encode_response, pad_rows, prompt_token_ids


class PairsError(ValueError):
    """A pairs file that cannot be used; the message names file, row and field."""


@dataclass
class Pair:
    prompt: str | list  # plain text / HH transcript, or a list of {role, content} messages
    chosen: str
    rejected: str
    margin: float = 0.0
    row: int = 0  # 0-based row in the source file, for error messages and reports
    split: str = "train"  # a snapshot's own split ('train' / 'test'), when it has one
    weight: float = 1.0  # the pair's weight in the Bradley-Terry loss (an export's `weight` column)
    ranking: str = ""  # the ranking it came from (an export's `ranking_id`), "" when the file has none


@dataclass
class EncodedPair:
    prompt_ids: list[int]  # shared by both responses (truncated once, from the left)
    chosen_response: list[int]  # response ids + EOS
    rejected_response: list[int]
    chosen_response_tokens: int  # untruncated response lengths, for the length baseline
    rejected_response_tokens: int
    margin: float = 0.0
    weight: float = 1.0

    @property
    def chosen_ids(self) -> list[int]:
        return self.prompt_ids + self.chosen_response

    @property
    def rejected_ids(self) -> list[int]:
        return self.prompt_ids + self.rejected_response

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + max(len(self.chosen_response), len(self.rejected_response))


@dataclass
class EncodeReport:
    prompt_truncated: int = 0  # pairs whose prompt lost tokens
    response_truncated: int = 0  # responses that alone exceeded max_length - 1 tokens
    max_tokens_seen: int = 0  # longest prompt+response before truncation
    examples: list = field(default_factory=list)  # first few truncated source rows


# --------------------------------------------------------------------------- reading


def _read_rows(path: Path) -> list[tuple[int, dict]]:
    """(row number from 1, row) of a pairs file (formats/rows.py), a `datasets` folder (every split
    of a DatasetDict, by name) or a folder of .parquet/.jsonl files (numbered within each file)."""
    if path.is_dir():
        if (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file():
            from datasets import DatasetDict, load_from_disk

            ds = load_from_disk(str(path))
            if isinstance(ds, DatasetDict):  # splits 'train' and maybe 'test' (store/export.py)
                return list(enumerate(({"split": name, **row} for name, part in ds.items() for row in part.to_list()), 1))
            return list(enumerate(ds.to_list(), 1))
        files = sorted(p for p in path.iterdir() if p.suffix in (".parquet", ".jsonl"))
        if not files:
            raise PairsError(f"{path}: a folder with no .parquet or .jsonl files and no datasets metadata")
        return [row for f in files for row in _read_rows(f)]
    try:
        return read_rows(path)
    except RowsError as exc:
        if exc.errors == [(None, EMPTY)]:
            raise PairsError(f"{path}: no pairs (the snapshot is empty)") from None
        raise PairsError(str(exc)) from None


def _response_text(value, where: str, name: str) -> str:
    """A response: a string, or a list of messages whose last one is the assistant's."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and isinstance(value[-1], dict):
        last = value[-1]
        if last.get("role") != "assistant" or not isinstance(last.get("content"), str):
            raise PairsError(f"{where}, field '{name}': the last message must be the assistant's, with text content")
        return last["content"]
    raise PairsError(f"{where}, field '{name}': expected text or a list of messages, got {type(value).__name__}")


def _row_to_pair(row, where: str, index: int) -> Pair:
    if not isinstance(row, dict):
        raise PairsError(f"{where}: expected an object with prompt/chosen/rejected, got {type(row).__name__}")
    for name in ("chosen", "rejected"):
        if row.get(name) is None:
            raise PairsError(f"{where}: missing field '{name}' (fields present: {', '.join(sorted(row)) or 'none'})")
    chosen, rejected, prompt = row["chosen"], row["rejected"], row.get("prompt")
    if prompt is None and isinstance(chosen, str) and isinstance(rejected, str):
        # HH-RLHF: whole transcripts; the prompt is everything up to the last "\n\nAssistant:".
        split = split_hh(chosen)
        if split is None:
            raise PairsError(f"{where}: no 'prompt' field and 'chosen' has no {ASSISTANT_MARK!r} to split at")
        prompt = split[0]
        if not rejected.startswith(prompt):
            raise PairsError(f"{where}: no 'prompt' field and 'chosen'/'rejected' do not share the conversation before the last reply")
        chosen, rejected = chosen[len(prompt):], rejected[len(prompt):]
    elif prompt is None and isinstance(chosen, list) and isinstance(rejected, list):
        prompt = chosen[:-1]  # TRL implicit-prompt conversational form
        if rejected[:-1] != prompt or not prompt:
            raise PairsError(f"{where}: no 'prompt' field and the 'chosen'/'rejected' conversations differ before the last message")
    _check_prompt(prompt, where)
    margin = row.get("margin")
    if margin is None:
        margin = 0.0
    elif not isinstance(margin, (int, float)) or isinstance(margin, bool) or margin != margin:
        raise PairsError(f"{where}, field 'margin': expected a number, got {margin!r}")
    ranking = row.get("ranking_id")
    return Pair(prompt, _response_text(chosen, where, "chosen"), _response_text(rejected, where, "rejected"),
                float(margin), index, _split(row, where), _weight(row.get("weight"), where),
                "" if ranking is None else str(ranking))


def _check_prompt(prompt, where: str) -> None:
    if not isinstance(prompt, (str, list)) or (isinstance(prompt, str) and not prompt.strip()) or not prompt:
        raise PairsError(f"{where}, field 'prompt': expected non-empty text or a list of messages")
    if isinstance(prompt, list):
        for i, m in enumerate(prompt):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise PairsError(f"{where}, field 'prompt': message {i} is not a {{role, content}} object of text")


def _split(row: dict, where: str) -> str:
    split = row.get("split") or "train"
    if split not in ("train", "test"):
        raise PairsError(f"{where}, field 'split': expected 'train' or 'test', got {split!r}")
    return split


def _weight(value, where: str) -> float:
    """A pair's weight: a positive finite number (None = 1.0). Zero or negative weights are refused:
    leave such pairs out of the export instead (min_quality)."""
    if value is None:
        return 1.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise PairsError(f"{where}, field 'weight': expected a positive finite number, got {value!r}")
    return float(value)


def read_pairs(path: str | Path) -> tuple[list[Pair], dict]:
    """(pairs, report): every usable pair in the file, and counts of what was dropped and why."""
    path = Path(path)
    rows = _read_rows(path)
    if not rows:
        raise PairsError(f"{path}: no pairs (the snapshot is empty)")
    pairs, identical = [], []
    for i, (n, row) in enumerate(rows):
        pair = _row_to_pair(row, f"{path}, row {n}", i)
        if pair.chosen.strip() == pair.rejected.strip():
            identical.append(n)
            continue
        for name in ("chosen", "rejected"):
            if not getattr(pair, name).strip():
                raise PairsError(f"{path}, row {n}, field '{name}': empty response")
        pairs.append(pair)
    if not pairs:
        raise PairsError(f"{path}: all {len(rows)} pairs have chosen == rejected; nothing to learn from")
    report = {"rows": len(rows), "pairs": len(pairs), "dropped_identical": len(identical),
              "dropped_identical_rows": identical[:20]}
    weights = [p.weight for p in pairs]
    if any(w != 1.0 for w in weights):
        report["weights"] = {"min": min(weights), "max": max(weights), "mean": sum(weights) / len(weights)}
    return pairs, report


# --------------------------------------------------------------------------- rankings (Plackett-Luce)


@dataclass
class Ranking:
    prompt: str | list  # as a pair's
    responses: list[str]
    tiers: list[int]  # each response's tie group, 0 = best (the export's `order`)
    row: int = 0
    split: str = "train"


@dataclass
class EncodedRanking:
    prompt_ids: list[int]
    responses: list[list[int]]  # response ids + EOS, as a pair's
    tiers: list[int]

    @property
    def length(self) -> int:  # the longest row, prompt + response
        return len(self.prompt_ids) + max(map(len, self.responses))


def rankings_path(data: str | Path) -> Path:
    """Where the rankings behind a pairs snapshot are (store/export.py's layout): `rankings/` in a
    snapshot folder, `<stem>.rankings.<ext>` beside a pairs file; or `data` itself when it is a
    rankings file or folder."""
    data = Path(data)
    for candidate in (data / "rankings", data.with_name(f"{data.stem}.rankings{data.suffix}")):
        if candidate.exists():
            return candidate
    return data


def read_rankings(data: str | Path) -> tuple[list[Ranking], dict]:
    """(rankings, report) from a snapshot's rankings (RANKING_COLUMNS of store/export.py: prompt,
    responses [{response_id, text, ...}], order = tie groups of response ids, best first, split).
    Blank responses are left out (train-reward refuses them in pairs too); a ranking left with one
    tie group says nothing about order (all tied, or one response) and is dropped; both counted."""
    path = rankings_path(data)
    rows = _read_rows(path)
    rankings, all_tied, blank = [], 0, 0
    for n, row in rows:
        where = f"{path}, row {n}"
        if not isinstance(row, dict) or not isinstance(row.get("responses"), list) or not isinstance(row.get("order"), list):
            raise PairsError(f"{where}: not a ranking: expected fields 'responses' and 'order' "
                             f"(store/export.py's rankings; fields present: {', '.join(sorted(row)) if isinstance(row, dict) else 'none'})")
        _check_prompt(row.get("prompt"), where)
        texts = {}
        for r in row["responses"]:
            if not isinstance(r, dict) or "response_id" not in r or not isinstance(r.get("text"), str):
                raise PairsError(f"{where}, field 'responses': each must be an object with 'response_id' and 'text'")
            texts[r["response_id"]] = r["text"]
        responses, tiers = [], []
        for tier, group in enumerate(row["order"]):
            for rid in group if isinstance(group, list) else [group]:
                if rid not in texts:
                    raise PairsError(f"{where}, field 'order': response id {rid!r} is not among its responses")
                if not texts[rid].strip():
                    blank += 1
                    continue
                responses.append(texts[rid])
                tiers.append(tier)
        if len(set(tiers)) < 2:
            all_tied += 1
            continue
        rankings.append(Ranking(row["prompt"], responses, tiers, n - 1, _split(row, where)))
    if not rankings:
        raise PairsError(f"{path}: no ranking orders two responses ({len(rows)} rows: all tied, or blank)")
    return rankings, {"rows": len(rows), "rankings": len(rankings), "dropped_all_tied": all_tied,
                      "blank_responses_left_out": blank, "file": str(path)}


def encode_rankings(rankings: list[Ranking], tokenizer, max_length: int) -> tuple[list[EncodedRanking], EncodeReport]:
    """Tokenise every ranking as pairs are (`encode_pairs`): one prompt for its responses, cut from
    the left to fit beside the longest."""
    report = EncodeReport()
    out = []
    for r in rankings:
        prompt, responses = _fit(prompt_token_ids(tokenizer, r.prompt),
                                 [encode_response(tokenizer, text) for text in r.responses], max_length, report, r.row)
        out.append(EncodedRanking(prompt, responses, r.tiers))
    return out, report


# --------------------------------------------------------------------------- split


def prompt_key(prompt) -> str:
    """Pairs with the same prompt (case and whitespace normalised) always land on the same side."""
    text = prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)
    return " ".join(text.lower().split())


def split_by_prompt(pairs: list[Pair], eval_fraction: float, seed: int) -> tuple[list[Pair], list[Pair]]:
    """Hold out about eval_fraction of the *prompts* (never a prompt on both sides)."""
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    keys = sorted({prompt_key(p.prompt) for p in pairs})
    random.Random(seed).shuffle(keys)
    n_eval = int(round(eval_fraction * len(keys)))
    if eval_fraction > 0 and len(keys) >= 2:
        n_eval = min(max(n_eval, 1), len(keys) - 1)
    held = set(keys[:n_eval])
    train = [p for p in pairs if prompt_key(p.prompt) not in held]
    evals = [p for p in pairs if prompt_key(p.prompt) in held]
    return train, evals


# --------------------------------------------------------------------------- tokenising


def _fit(prompt_ids: list[int], responses: list[list[int]], max_length: int, report: EncodeReport, row: int):
    """(prompt, responses) with prompt + the longest response <= max_length.

    Every response keeps the same prompt (a pair or a ranking compares responses in one context,
    and the prompt then runs once for all). The prompt loses tokens from its left; it keeps at
    least one, so a response longer than max_length - 1 keeps its last max_length - 1 tokens.
    """
    longest = max(map(len, responses))
    report.max_tokens_seen = max(report.max_tokens_seen, len(prompt_ids) + longest)
    if len(prompt_ids) + longest <= max_length:
        return prompt_ids, responses
    if len(report.examples) < 10:
        report.examples.append(row)
    keep = max(max_length - longest, 1)
    if keep < len(prompt_ids):
        report.prompt_truncated += 1
    budget = max_length - keep
    for response in responses:
        report.response_truncated += len(response) > budget
    return prompt_ids[-keep:], [response[-budget:] for response in responses]


def encode_pairs(pairs: list[Pair], tokenizer, max_length: int) -> tuple[list[EncodedPair], EncodeReport]:
    """Tokenise every pair (prompts once each), truncating from the left to max_length."""
    if max_length < 2:
        raise ValueError(f"max_length must be at least 2, got {max_length}")
    report = EncodeReport()
    prompt_cache: dict[str, list[int]] = {}
    out = []
    for pair in pairs:
        key = pair.prompt if isinstance(pair.prompt, str) else json.dumps(pair.prompt)
        if key not in prompt_cache:
            prompt_cache[key] = prompt_token_ids(tokenizer, pair.prompt)
        c, r = encode_response(tokenizer, pair.chosen), encode_response(tokenizer, pair.rejected)
        p, (c_fit, r_fit) = _fit(prompt_cache[key], [c, r], max_length, report, pair.row)
        out.append(EncodedPair(p, c_fit, r_fit, len(c), len(r), pair.margin, pair.weight))
    return out, report


# --------------------------------------------------------------------------- groups (one forward per response)


@dataclass
class PairGroup:
    """The pairs of one ranking: its prompt once, each distinct response (by its text) once,
    and every pair as indices into `responses`, with the pair's own margin and weight. InstructGPT
    (Ouyang et al. 2022, sec. 3.5) trains "all (K choose 2) comparisons from each prompt as a single
    batch element": one forward pass per response instead of one per pair it is in."""
    prompt: str | list
    responses: list[str]
    chosen: list[int]  # (n,) per pair, the index of its chosen response
    rejected: list[int]  # (n,) and of its rejected one
    margins: list[float]
    weights: list[float]
    split: str = "train"
    row: int = 0  # its first pair's row in the source file, for reports


def group_pairs(pairs: list[Pair]) -> list[PairGroup]:
    """Pairs grouped by the ranking they came from (their `ranking` id: an annotator's own answer's
    `edit` pairs carry its ranking's id, so the answer is one more response of that group), or, for
    pairs without one, by prompt; within a group a response text appears once. Prompts and responses
    are matched by their exact text, so every pair keeps the tokens it has alone (`encode_pairs`).
    Groups keep the order of their first pair, and a group's pairs their file order."""
    groups: dict[tuple[str, str], PairGroup] = {}
    index: dict[tuple[str, str], dict[str, int]] = {}
    for p in pairs:
        key = ("ranking", p.ranking) if p.ranking else (
            "prompt", p.prompt if isinstance(p.prompt, str) else json.dumps(p.prompt, sort_keys=True))
        if key not in groups:
            groups[key], index[key] = PairGroup(p.prompt, [], [], [], [], [], p.split, p.row), {}
        g, seen = groups[key], index[key]
        for text, side in ((p.chosen, g.chosen), (p.rejected, g.rejected)):
            if text not in seen:
                seen[text] = len(g.responses)
                g.responses.append(text)
            side.append(seen[text])
        g.margins.append(p.margin)
        g.weights.append(p.weight)
    return list(groups.values())


@dataclass
class EncodedGroup:
    prompt_ids: list[int]  # shared by every response (truncated once, from the left)
    responses: list[list[int]]  # response ids + EOS
    response_tokens: list[int]  # untruncated response lengths, for the length baseline
    chosen: list[int]
    rejected: list[int]
    margins: list[float]
    weights: list[float]

    @property
    def length(self) -> int:  # the longest row, prompt + response
        return len(self.prompt_ids) + max(map(len, self.responses))

    @property
    def n_pairs(self) -> int:
        return len(self.chosen)

    def pairs(self) -> list[EncodedPair]:
        """The group's pairs as pairs (each with the group's prompt, as truncated for the group)."""
        return [EncodedPair(self.prompt_ids, self.responses[c], self.responses[r], self.response_tokens[c],
                            self.response_tokens[r], m, w)
                for c, r, m, w in zip(self.chosen, self.rejected, self.margins, self.weights)]


def encode_groups(groups: list[PairGroup], tokenizer, max_length: int) -> tuple[list[EncodedGroup], EncodeReport]:
    """Tokenise every group as pairs are (`encode_pairs`): one prompt for all its responses, cut from
    the left to fit beside the group's longest (so a group's prompt may lose more than each of its
    pairs alone would; the same where nothing is truncated)."""
    if max_length < 2:
        raise ValueError(f"max_length must be at least 2, got {max_length}")
    report = EncodeReport()
    prompt_cache: dict[str, list[int]] = {}
    out = []
    for g in groups:
        key = g.prompt if isinstance(g.prompt, str) else json.dumps(g.prompt)
        if key not in prompt_cache:
            prompt_cache[key] = prompt_token_ids(tokenizer, g.prompt)
        full = [encode_response(tokenizer, text) for text in g.responses]
        prompt, responses = _fit(prompt_cache[key], full, max_length, report, g.row)
        out.append(EncodedGroup(prompt, responses, [len(r) for r in full], list(g.chosen), list(g.rejected),
                                list(g.margins), list(g.weights)))
    return out, report


def group_weights(items: list[EncodedGroup], use_weights: bool) -> list[list[float]] | None:
    """Each training pair's weight over the mean of all training pairs' (as `pair_weights`), per
    group; None for the plain loss."""
    flat = [w for g in items for w in g.weights]
    if not use_weights or len(set(flat)) == 1:
        return None
    mean_w = sum(flat) / len(flat)
    return [[w / mean_w for w in g.weights] for g in items]


def train_eval_pairs(pairs: list[Pair], data_report: dict, eval_data: str, eval_fraction: float,
                     seed: int) -> tuple[list[Pair], list[Pair]]:
    """(train, held-out) pairs, as train-reward and train-dpo choose them: the pairs of eval_data
    when given (the report counts its prompts also seen in training), else a snapshot's own 'test' split, else
    eval_fraction of the prompts. data_report gains what was chosen."""
    if eval_data:
        eval_pairs, eval_report = read_pairs(eval_data)
        train_keys = {prompt_key(p.prompt) for p in pairs}
        eval_report["prompts_also_in_train"] = sum(prompt_key(p.prompt) in train_keys for p in eval_pairs)
        data_report["eval_file"] = eval_report
        return pairs, eval_pairs
    if any(p.split == "test" for p in pairs):
        data_report["split"] = "snapshot"
        return [p for p in pairs if p.split != "test"], [p for p in pairs if p.split == "test"]
    return split_by_prompt(pairs, eval_fraction, seed)


def train_eval_data(data, eval_data: str, eval_fraction: float, seed: int) -> tuple[list[Pair], list[Pair], dict]:
    """Phase 1 of train-reward and train-dpo: (train pairs, held-out pairs, data report) of a pairs
    file (`read_pairs`, then `train_eval_pairs`); no training pair left is a ValueError."""
    pairs, data_report = read_pairs(data)
    train_pairs, eval_pairs = train_eval_pairs(pairs, data_report, eval_data, eval_fraction, seed)
    if not train_pairs:
        raise ValueError(f"{data}: no training pairs left after holding out {eval_fraction:.0%} of prompts")
    return train_pairs, eval_pairs, data_report


def pair_weights(items: list[EncodedPair], use_weights: bool) -> list[float] | None:
    """Each training pair's weight over their mean, or None for the plain loss (weights off, or one
    weight for every pair, judged on the raw weights: bit for bit the unweighted loss). mean(w * loss)
    keeps the plain loss's scale and each batch its pairs' share of the whole data's weight."""
    if not use_weights or len({it.weight for it in items}) == 1:
        return None
    mean_w = sum(it.weight for it in items) / len(items)
    return [it.weight / mean_w for it in items]


# --------------------------------------------------------------------------- batching


def length_grouped_batches(lengths: list[int], batch_size: int, seed: int, mega: int = 50) -> list[list[int]]:
    """Shuffled batches of similar-length pairs, so dynamic padding pads little.

    As transformers' LengthGroupedSampler: shuffle, cut into megabatches of mega * batch_size,
    sort each by length, cut into batches; then shuffle the batch order (ours) so an epoch does
    not run from long to short. Deterministic in `seed`, which --resume relies on.
    """
    rng = random.Random(seed)
    order = list(range(len(lengths)))
    rng.shuffle(order)
    batches = []
    step = batch_size * mega
    for start in range(0, len(order), step):
        chunk = sorted(order[start:start + step], key=lambda i: lengths[i], reverse=True)
        batches += [chunk[k:k + batch_size] for k in range(0, len(chunk), batch_size)]
    rng.shuffle(batches)
    return batches


def collate(items: list[EncodedPair], pad_id: int, with_lm_mask: bool = False) -> dict[str, torch.Tensor]:
    """Whole sequences, chosen rows then rejected rows, right-padded to the longest of the batch.

    input_ids, attention_mask: (2B, L); margin: (B,); lm_mask (optional): (B, L), 1 on the chosen
    response tokens (the LM-loss targets).
    """
    seqs = [it.chosen_ids for it in items] + [it.rejected_ids for it in items]
    input_ids, attention_mask = pad_rows(seqs, pad_id, left=False)  # (2B, L)
    batch = {"input_ids": input_ids, "attention_mask": attention_mask,
             "margin": torch.tensor([it.margin for it in items], dtype=torch.float32)}  # (B,)
    if with_lm_mask:
        lm_mask = torch.zeros((len(items), input_ids.shape[1]), dtype=torch.long)  # (B, L)
        for i, it in enumerate(items):
            lm_mask[i, it.prompt_len: len(it.chosen_ids)] = 1
        batch["lm_mask"] = lm_mask
    return batch


def collate_shared(items: list[EncodedPair], pad_id: int) -> dict[str, torch.Tensor]:
    """A prompt once per pair, then both responses (for the shared-prefix forward pass).

    prompt_ids, prompt_mask: (B, P), left-padded so every prompt ends at the same column and the
    responses continue right after it; response_ids, response_mask: (2B, R), chosen rows then
    rejected rows, right-padded; margin: (B,).
    """
    prompt_ids, prompt_mask = pad_rows([it.prompt_ids for it in items], pad_id, left=True)  # (B, P)
    response_ids, response_mask = pad_rows([it.chosen_response for it in items]
                                       + [it.rejected_response for it in items], pad_id, left=False)  # (2B, R)
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "response_ids": response_ids,
            "response_mask": response_mask,
            "margin": torch.tensor([it.margin for it in items], dtype=torch.float32)}  # (B,)


def collate_groups(items: list[EncodedGroup], pad_id: int, shared: bool) -> dict[str, torch.Tensor]:
    """Every response of every group once, group after group (N rows in all), and every pair as
    indices into those rows.

    shared (the shared-prefix forward pass): prompt_ids, prompt_mask (G, P), left-padded as in
    `collate_shared`; response_ids, response_mask (N, R), right-padded; prompt_of_row (N,), the
    prompt row each response continues. Else input_ids, attention_mask (N, L), prompt + response
    right-padded as in `collate`, and prompt_len (N,). Both: chosen, rejected (n,) row indices of each
    pair's responses, group (n,) its group's position in `items`, margin (n,), and chosen_count (N,),
    the number of pairs in which each row is the chosen response (the LM term's weight per row).
    """
    sizes = [len(it.responses) for it in items]
    offsets = [sum(sizes[:g]) for g in range(len(items))]
    chosen = [o + c for it, o in zip(items, offsets) for c in it.chosen]
    rejected = [o + r for it, o in zip(items, offsets) for r in it.rejected]
    batch = {"chosen": torch.tensor(chosen), "rejected": torch.tensor(rejected),  # (n,)
             "group": torch.tensor([g for g, it in enumerate(items) for _ in it.chosen]),  # (n,)
             "margin": torch.tensor([m for it in items for m in it.margins], dtype=torch.float32),  # (n,)
             "chosen_count": torch.bincount(torch.tensor(chosen), minlength=sum(sizes))}  # (N,)
    if shared:
        batch["prompt_ids"], batch["prompt_mask"] = pad_rows([it.prompt_ids for it in items], pad_id, left=True)  # (G, P)
        batch["response_ids"], batch["response_mask"] = pad_rows(
            [r for it in items for r in it.responses], pad_id, left=False)  # (N, R)
        batch["prompt_of_row"] = torch.arange(len(items)).repeat_interleave(torch.tensor(sizes))  # (N,)
    else:
        batch["input_ids"], batch["attention_mask"] = pad_rows(
            [it.prompt_ids + r for it in items for r in it.responses], pad_id, left=False)  # (N, L)
        batch["prompt_len"] = torch.tensor([len(it.prompt_ids) for it in items for _ in it.responses])  # (N,)
    return batch
