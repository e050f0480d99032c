"""pipeline/generate.py and pipeline/responses.py: prompts -> tokens, the sampling loop, K responses
per prompt, the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipeline.__main__ import main as cli
from pipeline.config import GenerateConfig
from pipeline.policy import causal_lm_logits, load_policy
from pipeline.responses import generate_responses
from pipeline.sampling import Decoding, _filter_logits, _sample_categorical, sample
from pipeline.text import SYSTEM_PROMPT, encode_prompts, prompt_token_ids, to_messages
from tests.tiny import build_tiny_model, build_tiny_tokenizer

# the bundled default prompt pool (real HH-RLHF user turns; license in store/data/LICENSE.md)
DATA = Path(__file__).resolve().parents[1] / "store" / "data"
PROMPTS = ["hello there, how are you today?", "\n\nHuman: hi\n\nAssistant: yo\n\nHuman: what?\n\nAssistant:", "a"]


def _sample(model, tokenizer, cfg, prompts=PROMPTS, n=8, seed=0, check_every=None):
    ids, mask = encode_prompts(tokenizer, prompts)
    return sample(model, ids, mask, cfg, tokenizer, num_samples=n, draws=torch.Generator().manual_seed(seed),
                  decoding=Decoding(check_every=check_every))


# --------------------------------------------------------------------------- prompts


def test_hh_transcript_becomes_chat_messages():
    text = "\n\nHuman: What is 2+2?\n\nAssistant: 4.\n\nHuman: And 3+3?\n\nAssistant:"
    assert to_messages(text) == [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 3+3?"},
    ]
    assert to_messages("Plain question?") == [{"role": "user", "content": "Plain question?"}]
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert to_messages(msgs) == msgs
    with pytest.raises(ValueError, match="message 0"):
        to_messages([{"text": "hi"}])


def test_encode_prompts_left_pads_with_chat_template(tiny_tokenizer):
    ids, mask = encode_prompts(tiny_tokenizer, ["a", "a much longer prompt than the first one"])
    assert ids.shape == mask.shape and mask[1].all() and not mask[0].all()
    assert mask[0, -1] == 1 and mask[0, 0] == 0  # left padding
    assert (ids[0][mask[0] == 0] == tiny_tokenizer.pad_token_id).all()
    # the chat template over our system prompt and the user's message
    expected = tiny_tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM_PROMPT},
                                                   {"role": "user", "content": "a"}],
                                                  add_generation_prompt=True, tokenize=False)
    assert tiny_tokenizer.decode(ids[0][mask[0] == 1]) == expected
    assert expected.startswith(f"<|im_start|>system\n{SYSTEM_PROMPT}") and expected.endswith("<|im_start|>assistant\n")
    # a prompt with a system message of its own keeps it
    own = prompt_token_ids(tiny_tokenizer, [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "a"}])
    assert SYSTEM_PROMPT not in tiny_tokenizer.decode(own) and "Be terse." in tiny_tokenizer.decode(own)
    truncated = prompt_token_ids(tiny_tokenizer, "a much longer prompt than the first one", max_prompt_tokens=5)
    assert truncated == ids[1][-5:].tolist()  # keeps the end, where the generation prompt is


# --------------------------------------------------------------------------- sampling


def test_filter_logits_top_p_and_top_k_by_hand():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    kept = lambda out: torch.isfinite(out)[0].tolist()  # noqa: E731
    assert kept(_filter_logits(logits, 0, 0.7)) == [True, True, False, False]  # 0.5 < 0.7 <= 0.8
    assert kept(_filter_logits(logits, 0, 0.8)) == [True, True, False, False]  # 0.8 reaches 0.8
    assert kept(_filter_logits(logits, 0, 0.81)) == [True, True, True, False]
    assert kept(_filter_logits(logits, 0, 0.1)) == [True, False, False, False]  # top token always stays
    assert kept(_filter_logits(logits, 3, 1.0)) == [True, True, True, False]
    shuffled = logits[:, [2, 0, 3, 1]]  # filtering follows the values, not the positions
    assert kept(_filter_logits(shuffled, 0, 0.7)) == [False, True, False, True]


def test_categorical_sampling_matches_the_distribution():
    probs = torch.tensor([[0.1, 0.0, 0.6, 0.3], [0.0, 0.0, 0.0, 1.0]]).repeat(20000, 1)  # (40000, 4)
    tokens = _sample_categorical(probs, torch.Generator().manual_seed(0))
    first = torch.bincount(tokens[0::2], minlength=4) / 20000
    torch.testing.assert_close(first, torch.tensor([0.1, 0.0, 0.6, 0.3]), atol=0.01, rtol=0)
    assert first[1] == 0 and (tokens[1::2] == 3).all()  # zero-probability tokens never drawn


def test_blocked_categorical_sampling_picks_the_float64_tokens():
    # the GPU form (float64 over block totals, float32 inside a block) against the float64 cumsum,
    # with the same uniforms: a vocabulary of 5000 with filtered (0) and tiny (1e-9) entries
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4000, 5000, generator=g) * 3
    logits[:, ::7] = float("-inf")
    probs = logits.softmax(-1)
    probs[:, 1::11] = 1e-9
    probs = probs / probs.sum(-1, keepdim=True)
    exact = _sample_categorical(probs, torch.Generator().manual_seed(5), blocked=False)
    blocked = _sample_categorical(probs, torch.Generator().manual_seed(5), blocked=True, block=256)
    assert (exact == blocked).float().mean() == 1.0
    assert (probs.gather(1, blocked[:, None]) > 0).all()
    one_hot = torch.zeros(3, 3000)
    one_hot[0, 0], one_hot[1, 2999], one_hot[2, 1500] = 1.0, 1.0, 1.0  # first, last, a block boundary
    assert _sample_categorical(one_hot, None, blocked=True, block=500).tolist() == [0, 2999, 1500]


@pytest.mark.parametrize("check_every", [None, 5])
def test_sample_shapes_and_eos_masking(tiny_model, tiny_tokenizer, check_every):
    # check_every 5: finished rows stay in the batch (masked) up to 4 tokens, as on a GPU
    cfg = GenerateConfig(temperature=1.0, max_new_tokens=48)
    out = _sample(tiny_model, tiny_tokenizer, cfg, n=24, check_every=check_every)
    B, R, P = 3 * 24, out.response_ids.shape[1], out.prompt_length
    assert out.response_ids.shape == out.response_mask.shape == out.logprobs.shape == (B, R)
    assert out.sequences.shape == out.attention_mask.shape == (B, P + R)
    assert out.prompt_index.tolist() == [i for i in range(3) for _ in range(24)]
    eos, pad = tiny_tokenizer.eos_token_id, tiny_tokenizer.pad_token_id
    assert set(out.finish_reason) == {"eos", "length"}  # a random model over 320 tokens does both
    for row, reason in enumerate(out.finish_reason):
        n = int(out.response_mask[row].sum())
        assert out.response_mask[row, :n].all() and not out.response_mask[row, n:].any()
        tokens = out.response_ids[row]
        if reason == "eos":
            assert tokens[n - 1] == eos and (tokens[: n - 1] != eos).all()
            assert (tokens[n:] == pad).all() and (out.logprobs[row, n:] == 0).all()
        else:
            assert n == cfg.max_new_tokens and (tokens != eos).all()
    assert (out.logprobs[out.response_mask == 1] < 0).all()
    assert torch.equal(out.sequences[:, P:], out.response_ids)


def test_eos_masking_when_pad_is_eos():
    tokenizer = build_tiny_tokenizer(pad_is_eos=True)  # like SmolLM2
    model = build_tiny_model(tokenizer)
    out = _sample(model, tokenizer, GenerateConfig(temperature=1.0, max_new_tokens=48), n=24)
    lengths = out.response_mask.sum(-1)
    for row, reason in enumerate(out.finish_reason):
        n = int(lengths[row])
        assert (out.response_ids[row, n - 1] == tokenizer.eos_token_id) == (reason == "eos")
    assert "eos" in out.finish_reason


@pytest.mark.parametrize("top_k,top_p,check_every", [(0, 1.0, None), (20, 0.9, None), (0, 1.0, 3)])
def test_logprobs_match_a_separate_forward_pass(tiny_model, tiny_tokenizer, top_k, top_p, check_every):
    # check_every 3: rows that ended stay in the batch a while; more samples so that some end
    cfg = GenerateConfig(temperature=0.7 if check_every is None else 1.0, top_k=top_k, top_p=top_p,
                         max_new_tokens=24 if check_every is None else 48)
    out = _sample(tiny_model, tiny_tokenizer, cfg, n=4 if check_every is None else 16, check_every=check_every)
    if check_every is not None:
        assert "eos" in out.finish_reason and "length" in out.finish_reason
    with torch.no_grad():
        logits = causal_lm_logits(tiny_model, out.sequences, out.attention_mask)  # (B, P+R, V)
    P = out.prompt_length
    logp = torch.log_softmax(logits[:, P - 1 : -1].float() / cfg.temperature, dim=-1)
    expected = logp.gather(2, out.response_ids[:, :, None]).squeeze(2) * out.response_mask
    torch.testing.assert_close(out.logprobs, expected, atol=1e-4, rtol=0)


def test_same_seed_same_samples_other_seed_differs(tiny_model, tiny_tokenizer):
    cfg = GenerateConfig(temperature=1.0, max_new_tokens=16)
    a, b = _sample(tiny_model, tiny_tokenizer, cfg, seed=3), _sample(tiny_model, tiny_tokenizer, cfg, seed=3)
    c = _sample(tiny_model, tiny_tokenizer, cfg, seed=4)
    assert torch.equal(a.sequences, b.sequences) and torch.equal(a.logprobs, b.logprobs)
    assert not torch.equal(a.response_ids, c.response_ids)


def test_greedy_and_top_k_1_agree_and_repeat(tiny_model, tiny_tokenizer):
    greedy = _sample(tiny_model, tiny_tokenizer, GenerateConfig(temperature=0.0, max_new_tokens=12), n=3)
    top1 = _sample(tiny_model, tiny_tokenizer, GenerateConfig(temperature=1.0, top_k=1, max_new_tokens=12), n=3)
    assert torch.equal(greedy.response_ids, top1.response_ids)
    assert torch.equal(greedy.response_ids[0], greedy.response_ids[2])  # K samples of one prompt
    for check_every in (4, 100):  # finished rows dropped every 4 tokens, or never: the same result
        late = _sample(tiny_model, tiny_tokenizer, GenerateConfig(temperature=0.0, max_new_tokens=12), n=3,
                       check_every=check_every)
        assert torch.equal(late.sequences, greedy.sequences) and late.finish_reason == greedy.finish_reason
        torch.testing.assert_close(late.logprobs, greedy.logprobs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("draws,check_every,share_prefix,temperature", [
    ("generator", None, True, 1.0),  # finished rows dropped at once, the prompts' system prompt run once
    ("generator", 3, False, 1.0),  # rows dropped every 3 tokens, no shared prefix
    ("uniforms", None, True, 1.0),  # each row's own numbers
    ("generator", None, True, 0.0),  # greedy
])
def test_kv_cache_allocated_once_samples_as_the_dynamic_cache(tiny_model, tiny_tokenizer, draws, check_every,
                                                              share_prefix, temperature):
    # a ColumnCache (keys/values written column by column into tensors allocated once) against
    # transformers' DynamicCache (concatenated each step): the same tokens for the same draws, the
    # same log-probs up to fp32 rounding; 3 prompts x 16 samples, 48 tokens: rows end all along
    ids, mask = encode_prompts(tiny_tokenizer, PROMPTS)
    cfg = GenerateConfig(temperature=temperature, top_p=0.95, max_new_tokens=48)
    uniforms = torch.rand((3 * 16, 48), generator=torch.Generator().manual_seed(5))
    outs = []
    for preallocated in (True, False):
        source = uniforms if draws == "uniforms" else torch.Generator().manual_seed(11)
        outs.append(sample(tiny_model, ids, mask, cfg, tiny_tokenizer, num_samples=16, draws=source,
                           decoding=Decoding(share_prefix=share_prefix, check_every=check_every,
                                             preallocated_cache=preallocated)))
    new, old = outs
    assert temperature == 0 or {"eos", "length"} <= set(old.finish_reason)  # rows left the batch early
    assert torch.equal(new.sequences, old.sequences) and torch.equal(new.response_mask, old.response_mask)
    assert new.finish_reason == old.finish_reason
    torch.testing.assert_close(new.logprobs, old.logprobs, atol=1e-5, rtol=0)


def test_kv_cache_allocated_once_holds_the_prompt_and_every_token_fed_back(tiny_model, tiny_tokenizer):
    from transformers import DynamicCache

    from pipeline.kv_cache import ColumnCache
    from pipeline.packing import cache_kwarg

    ids, mask = encode_prompts(tiny_tokenizer, PROMPTS[:2])  # (2, P)
    P = ids.shape[1]
    with torch.no_grad():
        prefill = DynamicCache()
        tiny_model(input_ids=ids, attention_mask=mask, use_cache=True, **{cache_kwarg(tiny_model): prefill})
        cache = ColumnCache.from_prefill(prefill, torch.tensor([0, 0, 1]), extra=2)  # (3, kv_heads, P + 2, head_dim)
        assert cache.layers[0].keys.shape[0] == 3 and cache.layers[0].keys.shape[2] == P + 2
        assert cache.get_seq_length() == P and cache.get_max_length() == P + 2
        assert torch.equal(cache.layers[0].keys[:, :, :P], prefill.layers[0].keys[[0, 0, 1]])
        k = torch.ones(3, *cache.layers[0].keys.shape[1:2], 2, cache.layers[0].keys.shape[-1])
        keys, values = cache.layers[0].update(k, 2 * k)  # views of the P + 2 columns written
        assert keys.shape[2] == P + 2 and (keys[:, :, P:] == 1).all() and (values[:, :, P:] == 2).all()
        assert cache.layers[0].get_mask_sizes(1) == (P + 3, 0)
        with pytest.raises(ValueError, match="do not fit"):
            cache.layers[0].update(k[:, :, :1], k[:, :, :1])
        cache.batch_select_indices(torch.tensor([2]))  # rows 0 and 1 leave the batch
        assert torch.equal(cache.layers[1].keys[0, :, :P], prefill.layers[1].keys[1])


# --------------------------------------------------------------------------- K responses per prompt


def test_generate_responses_k_per_prompt_in_order(tiny_model, tiny_tokenizer):
    cfg = GenerateConfig(temperature=0.0, max_new_tokens=10, batch_size=4)
    results = generate_responses(tiny_model, tiny_tokenizer, PROMPTS, k=3, cfg=cfg)
    assert [len(r) for r in results] == [3, 3, 3]
    for prompt, gens in zip(PROMPTS, results):
        # batched, length-sorted, left-padded greedy == the prompt alone
        alone = generate_responses(tiny_model, tiny_tokenizer, [prompt], k=1, cfg=cfg)[0][0]
        assert gens[0].token_ids == alone.token_ids
        for g in gens:
            assert len(g.token_ids) == len(g.logprobs) and g.finish_reason in ("eos", "length")
            assert g.text == tiny_tokenizer.decode(g.token_ids, skip_special_tokens=True)


def test_duplicates_are_resampled(tiny_model, tiny_tokenizer):
    prompts = [f"prompt number {i}" for i in range(8)]
    # one token out of the top 4, three times: duplicates are likely
    cfg = GenerateConfig(temperature=1.0, top_k=4, max_new_tokens=1, max_resample=0)
    texts = lambda res: [[g.text.strip() for g in gens] for gens in res]  # noqa: E731
    plain = texts(generate_responses(tiny_model, tiny_tokenizer, prompts, 3, cfg))
    assert any(len(set(t)) < 3 for t in plain)
    cfg.max_resample = 30
    deduped = texts(generate_responses(tiny_model, tiny_tokenizer, prompts, 3, cfg))
    assert all(len(set(t)) == 3 for t in deduped)


def test_generate_with_a_lora_policy(tiny_model_cfg):
    policy, tokenizer = load_policy(tiny_model_cfg)
    progress = []
    # 9 sequences in batches of 4: a prompt's K samples may be split across batches
    results = generate_responses(policy, tokenizer, PROMPTS, k=3,
                                 cfg=GenerateConfig(max_new_tokens=6, batch_size=4),
                                 on_progress=lambda done, total: progress.append((done, total)))
    assert [len(r) for r in results] == [3, 3, 3]
    assert progress == [(4, 9), (8, 9), (9, 9)]


# --------------------------------------------------------------------------- CLI


def test_cli_writes_a_run_directory(tiny_model_dir, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p, "id": i}) for i, p in enumerate(PROMPTS)) + "\n")
    out = tmp_path / "run"
    rc = cli(["generate", "--prompts", str(prompts), "--out", str(out), "--model", str(tiny_model_dir),
              "--k", "2", "--max-new-tokens", "5", "--device", "cpu"])
    assert rc == 0
    rows = [json.loads(line) for line in (out / "responses.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and [r["prompt_index"] for r in rows] == [0, 0, 1, 1, 2, 2]
    assert rows[2]["prompt"] == PROMPTS[1] and rows[2]["prompt_id"] == 1
    assert all(r["finish_reason"] in ("eos", "length") and 1 <= r["token_count"] <= 5 for r in rows)
    assert rows[0]["sampling"]["temperature"] == 0.7 and rows[0]["model"] == str(tiny_model_dir)
    status = json.loads((out / "status.json").read_text())
    assert status["state"] == "done" and (status["step"], status["total"], status["progress"]) == (6, 6, 1.0)
    assert json.loads((out / "config.json").read_text())["generate"]["k"] == 2


def test_cli_with_a_saved_adapter(tiny_model_cfg, tmp_path):
    from pipeline.saving import save_policy

    policy, tokenizer = load_policy(tiny_model_cfg)
    with torch.no_grad():  # a non-zero adapter, as after training
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.5)
    adapter = save_policy(policy, tokenizer, tmp_path / "policy")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": PROMPTS[0]}) + "\n")
    out = tmp_path / "run"
    assert cli(["generate", "--prompts", str(prompts), "--out", str(out), "--adapter", str(adapter),
                "--k", "1", "--max-new-tokens", "6", "--temperature", "0"]) == 0
    row = json.loads((out / "responses.jsonl").read_text())
    assert row["model"] == str(adapter.resolve())
    # the CLI merges the adapter for speed; greedy output matches the unmerged policy
    expected = generate_responses(policy, tokenizer, [PROMPTS[0]], 1,
                                  GenerateConfig(temperature=0.0, max_new_tokens=6))[0][0]
    assert row["text"] == expected.text


def test_cli_bad_prompt_file_fails_clearly(tiny_model_dir, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "fine"}\n{"text": "no prompt field"}\n')
    out = tmp_path / "run"
    rc = cli(["generate", "--prompts", str(prompts), "--out", str(out), "--model", str(tiny_model_dir)])
    assert rc == 1 and "line 2: no 'prompt' field" in capsys.readouterr().out
    status = json.loads((out / "status.json").read_text())
    assert status["state"] == "failed" and "line 2" in status["error"]
    assert not (out / "responses.jsonl").exists()


# --------------------------------------------------------------------------- the real default model


@pytest.mark.slow
def test_default_model_answers_a_real_prompt_offline(default_model_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from pipeline.config import ModelConfig

    prompt = json.loads((DATA / "prompts.jsonl").read_text().splitlines()[0])["prompt"]
    policy, tokenizer = load_policy(ModelConfig(model="default", device="cpu", lora=False))
    cfg = GenerateConfig(temperature=0.7, max_new_tokens=32, seed=0)
    gens = generate_responses(policy, tokenizer, [prompt], k=1, cfg=cfg)[0]
    for g in gens:
        words = g.text.split()
        assert len(words) >= 3 and g.finish_reason in ("eos", "length")
        # English: mostly ASCII letters, and common English words appear
        assert sum(c.isascii() for c in g.text) / len(g.text) > 0.95
        assert {w.lower().strip(".,!?:") for w in words} & {"the", "a", "and", "to", "of", "you", "is", "are"}
        if g.finish_reason == "eos":
            assert g.token_ids[-1] == tokenizer.eos_token_id


def _read_chunks(out: Path) -> list[list[dict]]:
    files = sorted((out / "chunks").iterdir())
    assert [f.name for f in files] == [f"{i:05d}.jsonl" for i in range(len(files))]  # no temporary files left
    return [[json.loads(line) for line in f.read_text().splitlines()] for f in files]


def test_cli_writes_chunk_files_as_prompts_finish(tiny_model_dir, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    texts = [f"prompt number {i}, please answer" for i in range(5)]
    prompts.write_text("\n".join(json.dumps({"prompt": p, "id": 10 + i}) for i, p in enumerate(texts)) + "\n")
    args = ["generate", "--prompts", str(prompts), "--model", str(tiny_model_dir), "--k", "2",
            "--max-new-tokens", "4", "--device", "cpu", "--chunk-prompts", "2", "--seed", "3"]
    assert cli([*args, "--out", str(tmp_path / "run")]) == 0
    chunks = _read_chunks(tmp_path / "run")
    assert [len(c) for c in chunks] == [4, 4, 2]  # 2 prompts x K=2, 2 x 2, then the last prompt
    rows = [json.loads(line) for line in (tmp_path / "run" / "responses.jsonl").read_text().splitlines()]
    assert [r for c in chunks for r in c] == rows
    assert [r["prompt_id"] for r in rows] == [10, 10, 11, 11, 12, 12, 13, 13, 14, 14]
    assert [r["prompt_index"] for r in rows] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    assert set(rows[0]) == {"prompt", "prompt_index", "prompt_id", "text", "token_count", "finish_reason",
                            "sampling", "model"}
    status = json.loads((tmp_path / "run" / "status.json").read_text())
    assert (status["state"], status["step"], status["total"], status["chunks"]) == ("done", 10, 10, 3)
    # the same seed gives the same chunks
    assert cli([*args, "--out", str(tmp_path / "again")]) == 0
    assert _read_chunks(tmp_path / "again") == chunks


def test_cli_chunks_fill_one_decoding_batch_by_default(tiny_model_dir, tmp_path):
    # a chunk is one sampler call: by default it holds the prompts whose K responses fill the batch,
    # --batch-size 6 at K = 3: 2 prompts a chunk (and without --batch-size, the device's batch / K)
    from pipeline.config import GenerateConfig
    from pipeline.generate import chunk_size

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"question {i}?"}) for i in range(5)) + "\n")
    out = tmp_path / "run"
    assert cli(["generate", "--prompts", str(prompts), "--out", str(out), "--model", str(tiny_model_dir),
                "--k", "3", "--max-new-tokens", "4", "--device", "cpu", "--batch-size", "6"]) == 0
    assert [len(c) for c in _read_chunks(out)] == [6, 6, 3]
    assert json.loads((out / "config.json").read_text())["chunk_prompts"] == 2
    assert chunk_size(GenerateConfig(k=4), "cpu") == 16  # 64 rows on a CPU
    assert chunk_size(GenerateConfig(k=100, batch_size=8), "cpu") == 1


def test_cli_select_uncertain_writes_only_the_kept_prompts(tiny_model_cfg, tmp_path):
    from pipeline.models import load_scalar_model
    from pipeline.saving import save_scalar_model

    rm, tok = load_scalar_model(tiny_model_cfg.model, kind="reward", cfg=tiny_model_cfg)
    save_scalar_model(rm, tok, tmp_path / "rm")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"question {i}?", "id": i}) for i in range(5)) + "\n")
    out = tmp_path / "run"
    assert cli(["generate", "--prompts", str(prompts), "--out", str(out), "--model", tiny_model_cfg.model,
                "--k", "3", "--max-new-tokens", "4", "--device", "cpu", "--chunk-prompts", "2",
                "--select-uncertain", "3", "--reward", str(tmp_path / "rm")]) == 0
    chunks = _read_chunks(out)
    assert [len(c) for c in chunks] == [6, 3]
    rows = [r for c in chunks for r in c]
    assert len({r["prompt_id"] for r in rows}) == 3 and [r["prompt_index"] for r in rows] == [0] * 3 + [1] * 3 + [2] * 3
    assert json.loads((out / "status.json").read_text())["state"] == "done"
