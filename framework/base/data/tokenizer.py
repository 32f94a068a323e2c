"""Byte-level BPE tokenizer, trained locally with HuggingFace ``tokenizers``.

Why byte-level: every byte string has an encoding (no unknown token), and ``decode(encode(s))
== s`` for any ``str`` - code keeps its exact whitespace. The layout follows GPT-2: a
``ByteLevel`` pre-tokenizer (GPT-2 split regex, no added prefix space) maps bytes to 256
printable symbols, BPE merges are learned on top, and a ``ByteLevel`` decoder maps back.

Vocabulary: id 0 is ``<|endoftext|>`` (the document separator), then the 256 byte symbols,
then up to ``vocab_size - 257`` merges. A small corpus can run out of pairs to merge, so the
trained size may be *below* the requested one; use :func:`vocab_size` of the trained tokenizer
(the token cache records it), never the requested number.

The separator is inserted by id between documents (see :mod:`framework.base.data.tokens`); the
literal text ``<|endoftext|>`` inside a document is encoded as ordinary text
(``encode_special_tokens = True``), so a document can never forge a boundary.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOT = "<|endoftext|>"  # document separator; id 0


def build_untrained() -> Tokenizer:
    """An empty byte-level BPE pipeline (pre-tokenizer + decoder, no merges yet)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return tok


def train_tokenizer(
    texts: Iterable[str], *, vocab_size: int, length: int | None = None, show_progress: bool = False
) -> Tokenizer:
    """Train a byte-level BPE on ``texts`` (the train split; never val).

    Args:
        texts: documents (any iterable of ``str``; consumed once).
        vocab_size: requested vocabulary size including ``<|endoftext|>`` and the 256 bytes
            (>= 257; ``DataConfig`` requires >= 260).
        length: number of documents, for the trainer's progress bar only.
        show_progress: let the Rust trainer draw its progress bar on stderr.

    Returns:
        The trained tokenizer; ``vocab_size(tok) <= vocab_size``; ``EOT`` has id 0.

    Raises:
        ValueError: ``vocab_size`` < 257.
    """
    if vocab_size < 257:
        raise ValueError(f"vocab_size={vocab_size} must be >= 257 (256 bytes + {EOT})")
    tok = build_untrained()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=length)
    tok.encode_special_tokens = True
    return tok


def load_tokenizer(path: str) -> Tokenizer:
    """Load a tokenizer saved with ``Tokenizer.save`` and restore the runtime settings.

    ``encode_special_tokens`` is not part of ``tokenizer.json``, so it is set here.
    """
    tok = Tokenizer.from_file(str(path))
    tok.encode_special_tokens = True
    return tok


def eot_id(tok: Tokenizer) -> int:
    """Id of ``<|endoftext|>``. Raises ``ValueError`` if the tokenizer lacks it."""
    i = tok.token_to_id(EOT)
    if i is None:
        raise ValueError(f"tokenizer has no {EOT} token")
    return i


def vocab_size(tok: Tokenizer) -> int:
    """Number of ids the tokenizer can emit (special tokens included)."""
    return tok.get_vocab_size(with_added_tokens=True)
