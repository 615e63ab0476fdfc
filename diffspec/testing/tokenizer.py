"""Offline word-level tokenizers for tiny test checkpoints.

Built in code with the ``tokenizers`` library and saved as a normal HF tokenizer folder
(``tokenizer.json`` + ``tokenizer_config.json`` + ``special_tokens_map.json``), so that
``AutoTokenizer.from_pretrained(path)`` and the engines load it like a real one.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_word_tokenizer(
    words: Sequence[str],
    special_tokens: Sequence[str],
    *,
    unk_token: str = "<unk>",
):
    """Return a ``PreTrainedTokenizerFast`` whose ids are: specials first (in order),
    then ``unk_token`` (if not already special), then ``words`` in order.

    Text is split on whitespace; decoding joins words with single spaces.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab: dict[str, int] = {}
    for tok in [*special_tokens, unk_token, *words]:
        if tok not in vocab:
            vocab[tok] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=unk_token))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tok.add_special_tokens(list(special_tokens))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=unk_token)


def save_tokenizer(
    tokenizer,
    path: str | Path,
    *,
    eos_token: str | None = None,
    pad_token: str | None = None,
    bos_token: str | None = None,
    mask_token: str | None = None,
    chat_template: str | None = CHAT_TEMPLATE,
    model_max_length: int = 4096,
) -> None:
    """Save ``tokenizer`` to ``path`` with the named special tokens and a chat template."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if eos_token is not None:
        tokenizer.eos_token = eos_token
    if pad_token is not None:
        tokenizer.pad_token = pad_token
    if bos_token is not None:
        tokenizer.bos_token = bos_token
    if mask_token is not None:
        tokenizer.mask_token = mask_token
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    tokenizer.model_max_length = model_max_length
    tokenizer.save_pretrained(str(path))
    # Make sure the config names the class explicitly (some loaders read it).
    cfg_path = path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2))
