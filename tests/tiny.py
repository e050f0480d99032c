"""Tiny randomly initialised Llama-style models and a tokenizer, built offline in milliseconds.

Used by the tests and by the `--quick` benchmark modes, so neither depends on downloading or
converting a real model. The tokenizer is a byte-level BPE trained on a small built-in corpus
(any text round-trips through it), with ChatML special tokens and a chat template like SmolLM2's.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

PAD, BOS, EOS = "<|endoftext|>", "<|im_start|>", "<|im_end|>"

# ChatML, as SmolLM2-Instruct uses (without its default system prompt).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

CORPUS = [
    "How can I shop for the lowest prices? Compare stores, use coupons and buy in bulk.",
    "What are some hot dog toppings besides ketchup or mustard? Try onions, relish or chili.",
    "The quick brown fox jumps over the lazy dog. A stitch in time saves nine.",
    "Human: What is the capital of France? Assistant: The capital of France is Paris.",
    "Can you tell me how to bake bread? Mix flour, water, salt and yeast, then let it rise.",
    "I would like to learn to play the guitar. Start with simple chords and practise daily.",
    "user assistant system: you are a helpful assistant. Thank you! You're welcome.",
    "Numbers 0 1 2 3 4 5 6 7 8 9 and punctuation , . ; : ! ? ' \" ( ) - are common.",
]


def build_tiny_tokenizer(vocab_size: int = 320, pad_is_eos: bool = False):
    """A PreTrainedTokenizerFast with eos/pad/bos and a chat template (trained in ~10 ms).

    pad_is_eos=True mimics SmolLM2, whose pad token *is* its EOS token.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[PAD, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=EOS if pad_is_eos else PAD,
        padding_side="left",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_tiny_model(tokenizer, seed: int = 0, hidden: int = 32, layers: int = 2):
    """A LlamaForCausalLM with random weights sized for `tokenizer` (about 30k parameters)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):  # leave the caller's RNG stream alone
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model.eval()


def save_tiny_model_dir(out_dir: str | os.PathLike, seed: int = 0, pad_is_eos: bool = False) -> Path:
    """Write a tiny model + tokenizer as a Hugging Face folder that load_policy can open."""
    out = Path(out_dir)
    tokenizer = build_tiny_tokenizer(pad_is_eos=pad_is_eos)
    build_tiny_model(tokenizer, seed=seed).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
