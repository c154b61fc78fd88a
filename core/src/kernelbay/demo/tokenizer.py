"""The demo model's byte-level tokenizer, in the Hugging Face ``tokenizers`` JSON format.

Each UTF-8 byte is one token (id = byte value) through the byte-level pre-tokenizer's
byte-to-character table, with no merges; special tokens take the ids after 255, and encoding
a text prepends ``<|bos|>`` as training did.
"""

from __future__ import annotations

from typing import Any

from kernelbay.demo import SPECIAL_TOKENS, VOCAB_SIZE

__all__ = ["build_tokenizer"]


def _bytes_to_unicode() -> dict[int, str]:
    # The byte-level table: printable bytes map to themselves, the rest to code points >= 256.
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def build_tokenizer() -> Any:
    """A ``tokenizers.Tokenizer`` mapping text to its UTF-8 bytes (ids 0-255)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = sorted(SPECIAL_TOKENS.items(), key=lambda kv: kv[1])
    tokenizer.add_special_tokens([AddedToken(name, special=True) for name, _ in specials])
    for name, token_id in specials:
        if tokenizer.token_to_id(name) != token_id:
            raise AssertionError(f"special token {name} got id {tokenizer.token_to_id(name)}, "
                                 f"expected {token_id}")
    # Training windows start with BOS, so prompts do too.
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", special_tokens=[("<|bos|>", SPECIAL_TOKENS["<|bos|>"])])
    if tokenizer.get_vocab_size() > VOCAB_SIZE:
        raise AssertionError(f"tokenizer has {tokenizer.get_vocab_size()} ids > {VOCAB_SIZE}")
    return tokenizer
