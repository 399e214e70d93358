"""A tiny tokenizer trained in-process with sentencepiece, saved for ``transformers.AutoTokenizer``.

For the tiny CPU models (a 128-entry vocabulary) on small corpora such as the arithmetic task of
:mod:`cooper_mcore.data.mathgen`. Training uses sentencepiece (BPE by default, or unigram) with
the identity normalisation, no dummy prefix and no whitespace folding, so that decoding gives
back the text exactly; digits are split one per token by default. The trained pieces are then
written as a ``tokenizers`` model (``tokenizer.json``) with the same segmentation, so the result
loads offline with ``AutoTokenizer.from_pretrained(out_dir)``; the sentencepiece model is kept
next to it as ``spm.model``.

Special tokens have fixed ids::

    0 <|pad|>        padding
    1 <|endoftext|>  BOS / document separator (never added automatically)
    2 <unk>          unknown character
    3 <|im_start|>   chat turn start
    4 <|im_end|>     chat turn end, and the EOS token (generation stops there)

The chat template is ChatML (``<|im_start|>user\\n...<|im_end|>\\n<|im_start|>assistant\\n``).

No byte fallback: it needs about 256 byte pieces, more than a tiny vocabulary has. Characters
seen neither in the training texts nor in ``required_chars`` become ``<unk>``.
"""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
from collections.abc import Iterable, Mapping
from typing import Any, Optional

import sentencepiece as spm
import transformers
from tokenizers import Tokenizer, decoders, models, normalizers

from cooper_mcore.files import read_json_object

logger = logging.getLogger(__name__)

PAD, BOS, UNK, IM_START, IM_END = "<|pad|>", "<|endoftext|>", "<unk>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (PAD, BOS, UNK, IM_START, IM_END)  # in id order: ids 0..4
EOS = IM_END
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# The characters the chat template itself writes (role names, newline), always in the vocabulary.
CHAT_CHARS = "".join(sorted(set("system user assistant\n")))
SPIECE_SPACE = "\u2581"
MODEL_TYPES = ("bpe", "unigram")
SPM_FILE = "spm.model"


def _train_spm(texts: list[str], vocab_size: int, model_type: str, split_digits: bool, required: str,
               isolate: str = "") -> bytes:

    model = io.BytesIO()
    # sentencepiece < 0.2.3 aborts the process (a CHECK, not an exception) when a required
    # character never occurs in the corpus: give the missing ones one line of their own.
    seen = set().union(*map(set, texts)) if texts else set()
    missing = "".join(sorted(set(required) - seen))
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter([*texts, missing] if missing else texts),
            model_writer=model,
            model_type=model_type,
            vocab_size=vocab_size,
            hard_vocab_limit=False,  # tiny corpora have fewer possible pieces than vocab_size
            character_coverage=1.0,
            required_chars=required,
            normalization_rule_name="identity",
            add_dummy_prefix=False,
            remove_extra_whitespaces=False,
            split_digits=split_digits,
            byte_fallback=False,
            pad_id=0,
            pad_piece=PAD,
            eos_id=1,
            eos_piece=BOS,
            unk_id=2,
            unk_piece=UNK,
            bos_id=-1,
            control_symbols=[IM_START, IM_END],
            user_defined_symbols=list(isolate),  # always a piece of their own, never merged
            num_threads=1,  # deterministic
            minloglevel=2,
        )
    except RuntimeError as e:
        raise ValueError(f"sentencepiece training failed (vocab_size={vocab_size}, {model_type}): {e}") from e
    return model.getvalue()


def _to_tokenizers(spm_proto: bytes, model_type: str) -> Any:
    """A ``tokenizers.Tokenizer`` with the sentencepiece model's pieces, ids and segmentation."""
    sp = spm.SentencePieceProcessor(model_proto=spm_proto)
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    assert tuple(pieces[: len(SPECIAL_TOKENS)]) == SPECIAL_TOKENS, pieces[:8]
    special = {i for i in range(len(pieces)) if sp.is_control(i) or sp.is_unknown(i)}
    if model_type == "unigram":
        vocab = [(p, 0.0 if i in special else sp.get_score(i)) for i, p in enumerate(pieces)]
        model = models.Unigram(vocab, unk_id=pieces.index(UNK), byte_fallback=False)
    else:
        # sentencepiece BPE merges the adjacent pair whose union is the highest-scored piece, and
        # piece ids follow the scores: rank every way of splitting a piece by the piece's id.
        ids = {p: i for i, p in enumerate(pieces)}
        merges = []
        for i, piece in enumerate(pieces):
            if i in special:
                continue
            splits = [(piece[:k], piece[k:]) for k in range(1, len(piece))]
            usable = [(a, b) for a, b in splits if a in ids and b in ids and not {ids[a], ids[b]} & special]
            merges.extend(sorted(usable, key=lambda s: (ids[s[0]], ids[s[1]])))
        model = models.BPE(vocab=ids, merges=merges, unk_token=UNK, fuse_unk=True, byte_fallback=False)
    tok = Tokenizer(model)
    tok.normalizer = normalizers.Replace(" ", SPIECE_SPACE)
    tok.decoder = decoders.Sequence([decoders.Replace(SPIECE_SPACE, " "), decoders.Fuse()])
    return tok


def train_tiny_tokenizer(
    texts: Iterable[str],
    out_dir: str,
    vocab_size: int = 128,
    model_type: str = "bpe",
    split_digits: bool = True,
    required_chars: str = "",
    model_max_length: Optional[int] = None,
    isolate: str = "",
) -> Any:
    """Train a sentencepiece tokenizer on ``texts`` and save it for ``AutoTokenizer``.

    Args:
        texts: the training corpus (e.g. :func:`cooper_mcore.data.mathgen.tokenizer_corpus`).
        out_dir: folder to write ``tokenizer.json``, ``tokenizer_config.json``,
            ``chat_template.jinja`` and ``spm.model`` to (created if missing).
        vocab_size: upper bound of the vocabulary, special tokens included (the result is
            smaller when the corpus has fewer pieces).
        model_type: ``"bpe"`` or ``"unigram"``.
        split_digits: one token per digit.
        required_chars: characters to include even if ``texts`` lacks them (the chat template's
            characters and the space are always included).
        model_max_length: the tokenizer's ``model_max_length`` (None: transformers' default).
        isolate: characters that are always a token of their own, never merged with a neighbour
            (``"-+*=,{}."``: a number is then the same tokens wherever it is written, ``-13`` after
            ``=``, inside ``\\boxed{}`` or as a reference answer).

    Returns:
        The saved tokenizer as loaded back by ``transformers.AutoTokenizer.from_pretrained(out_dir)``
        (pad, EOS/BOS, unknown and chat tokens set; see the module docstring).

    Raises:
        ValueError: no non-empty text, an unknown model type, or a ``vocab_size`` too small for the
            special tokens and the characters.
    """
    if model_type not in MODEL_TYPES:
        raise ValueError(f"unknown tokenizer model_type {model_type!r}; choose from {MODEL_TYPES}")
    corpus = [t for t in texts if t]
    if not corpus:
        raise ValueError("train_tiny_tokenizer: no non-empty training text")
    chars = set("".join(corpus)) | set(required_chars) | set(CHAT_CHARS)
    if vocab_size < len(SPECIAL_TOKENS) + len(chars):
        raise ValueError(
            f"vocab_size={vocab_size} is too small: {len(SPECIAL_TOKENS)} special tokens + {len(chars)} "
            "distinct characters"
        )
    # Observed with sentencepiece 0.2.3: required_chars are ignored when many of them also occur in the corpus, so
    # pass only the missing ones (spaces are stored as U+2581), then check that all made it.
    wanted = {SPIECE_SPACE if c == " " else c for c in chars}
    seen = {SPIECE_SPACE if c == " " else c for c in set("".join(corpus))}
    proto = _train_spm(corpus, vocab_size, model_type, split_digits, "".join(sorted(wanted - seen - set(isolate))),
                       isolate)
    backend = _to_tokenizers(proto, model_type)
    lost = sorted(c for c in wanted if backend.token_to_id(c) is None)
    if lost:
        raise ValueError(f"vocab_size={vocab_size}: the trained vocabulary lacks the characters {lost}")
    kwargs: dict[str, Any] = {} if model_max_length is None else {"model_max_length": model_max_length}
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        additional_special_tokens=[IM_START, IM_END],
        clean_up_tokenization_spaces=False,  # exact decoding (no " ," -> "," clean-up)
        chat_template=CHAT_TEMPLATE,
        **kwargs,
    )
    os.makedirs(out_dir, exist_ok=True)
    tok.save_pretrained(out_dir)
    with open(os.path.join(out_dir, SPM_FILE), "wb") as f:
        f.write(proto)
    _set_tokenizer_class(out_dir)
    loaded = transformers.AutoTokenizer.from_pretrained(out_dir, trust_remote_code=False)
    assert loaded.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == list(range(len(SPECIAL_TOKENS)))
    logger.info("trained a %s tokenizer with %d tokens into %s", model_type, len(loaded), out_dir)
    return loaded


#: the first code point of the one-character tokens :func:`widen_tokenizer` adds (planes 2-13: no
#: tiny tokenizer's corpus holds them, and every one is a single Unicode scalar value)
WIDE_FIRST_CODE_POINT = 0x20000
_WIDE_LAST_CODE_POINT = 0xDFFFF


def widen_tokenizer(src_dir: str, out_dir: str, vocab_size: int) -> Any:
    """A copy of the tokenizer in ``src_dir`` (as :func:`train_tiny_tokenizer` writes it) whose
    vocabulary is filled up to ``vocab_size`` ids with one-character tokens (code points from
    :data:`WIDE_FIRST_CODE_POINT`), saved in ``out_dir``.

    The stand-in for a real model's tokenizer where a run has random weights at a real shape: every
    id such a policy samples then decodes to text that tokenizes back to the same id, so the reward
    model reads completions as long as the policy wrote them (with the tiny tokenizer, the ids past
    its few pieces would decode to nothing). The tiny tokenizer's own pieces and special ids are kept.

    Returns:
        The widened tokenizer as :func:`load_tokenizer` reads it back.

    Raises:
        ValueError: ``src_dir`` holds no BPE ``tokenizer.json``, or ``vocab_size`` is smaller than its
            vocabulary or larger than the code points available.
    """
    path = os.path.join(src_dir, "tokenizer.json")
    spec = read_json_object(path) if os.path.isfile(path) else {}
    vocab = spec.get("model", {}).get("vocab")
    if spec.get("model", {}).get("type") != "BPE" or not isinstance(vocab, dict):
        raise ValueError(f"widen_tokenizer: {src_dir!r} has no BPE tokenizer.json (make one with "
                         "train_tiny_tokenizer)")
    used = max([*vocab.values(), *(t["id"] for t in spec.get("added_tokens", []))]) + 1
    most = _WIDE_LAST_CODE_POINT - WIDE_FIRST_CODE_POINT + 1  # id i is the character WIDE_FIRST_CODE_POINT + i
    if not used <= vocab_size <= most:
        raise ValueError(f"widen_tokenizer: vocab_size={vocab_size} must be between the tokenizer's {used} ids and "
                         f"{most}")
    vocab.update({chr(WIDE_FIRST_CODE_POINT + i): i for i in range(used, vocab_size)})
    os.makedirs(out_dir, exist_ok=True)
    for name in os.listdir(src_dir):
        if name not in ("tokenizer.json", SPM_FILE):  # the sentencepiece model does not know the new ids
            shutil.copy(os.path.join(src_dir, name), out_dir)
    tmp = os.path.join(out_dir, "tokenizer.json.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(spec, f, ensure_ascii=False)
    os.replace(tmp, os.path.join(out_dir, "tokenizer.json"))
    return load_tokenizer(out_dir)


def _set_tokenizer_class(out_dir: str) -> None:
    """Name the generic ``PreTrainedTokenizerFast`` (known to transformers 4.x too), not v5's TokenizersBackend."""
    path = os.path.join(out_dir, "tokenizer_config.json")
    with open(path, encoding="utf-8") as f:
        cfg = json.load(f)
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(path, "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2, ensure_ascii=False)
        f.write("\n")


def load_tokenizer(path: str, trust_remote_code: bool = False) -> Any:
    """Load a tokenizer folder the way it was saved.

    transformers 5's ``AutoTokenizer`` picks the tokenizer class from a ``config.json`` in the
    same folder when there is one (a qwen2 model folder gets ``Qwen2Tokenizer``), which
    tokenizes differently from a generic fast tokenizer saved there. When
    ``tokenizer_config.json`` names ``PreTrainedTokenizerFast`` (as :func:`train_tiny_tokenizer`
    writes), that class is used directly; anything else goes through ``AutoTokenizer``.

    Args:
        path: the tokenizer (or model) folder.
        trust_remote_code: allow a folder's own Python tokenizer code to run (off unless asked).

    Raises:
        ValueError: the tokenizer files are missing or damaged (a broken ``tokenizer_config.json``
            is named with its line and column).
    """
    cfg_path = os.path.join(path, "tokenizer_config.json")
    fast = os.path.isfile(cfg_path) and read_json_object(cfg_path).get("tokenizer_class") == "PreTrainedTokenizerFast"
    try:
        if fast:
            return transformers.PreTrainedTokenizerFast.from_pretrained(path, trust_remote_code=trust_remote_code)
        return transformers.AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as e:  # tokenizers' bare Exception for a broken tokenizer.json, transformers' OSError, ...
        first = (str(e).strip().splitlines() or [""])[0][:300]
        raise ValueError(f"cannot load the tokenizer in {path!r} ({type(e).__name__}: {first}); its tokenizer "
                         "files are missing or damaged") from e


def tokenizer_size(tokenizer: Any) -> int:
    """The number of token ids a tokenizer can produce: its largest id + 1 (added tokens included),
    or ``len(tokenizer)`` when it does not list its vocabulary."""
    try:
        ids = [i for i in tokenizer.get_vocab().values() if isinstance(i, int)]
    except (AttributeError, NotImplementedError, TypeError):
        ids = []
    return max(ids) + 1 if ids else len(tokenizer)


def check_vocab_fits(size: int, vocab_size: int, what: str, model: str) -> None:
    """Refuse token ids up to ``size - 1`` for a model with ``vocab_size`` embedding rows.

    The one check of every loader (training, SFT, the reward-model jobs, ``cooper eval``, the
    rollout engine): without it an id past the embedding fails deep in the first forward with
    ``IndexError: index out of range in self``.

    Args:
        size: the ids' upper bound (a tokenizer's :func:`tokenizer_size`, or the largest id + 1).
        vocab_size: the model's vocabulary (``config.json``'s or ``cooper_model.json``'s ``vocab_size``).
        what: the ids' source for the message, e.g. ``"the tokenizer 'runs/tok'"``.
        model: the model's path for the message.

    Raises:
        ValueError: ``size > vocab_size``, naming both and both sizes.
    """
    if size > vocab_size:
        raise ValueError(
            f"{what} has {size} token ids (0..{size - 1}), the model {model!r} a vocabulary of {vocab_size} "
            f"(ids >= {vocab_size} have no embedding): use the tokenizer the model was made with "
            "(the checkpoint's hf_extra/ or the HF folder it was converted from), or a model whose vocab_size "
            f"is at least {size}"
        )


def check_tokenizer_fits(tokenizer: Any, vocab_size: int, model: str, tokenizer_path: Optional[str] = None) -> None:
    """:func:`check_vocab_fits` for a tokenizer (named by ``tokenizer_path``, default the folder it
    was loaded from)."""
    path = tokenizer_path or getattr(tokenizer, "name_or_path", "") or "?"
    check_vocab_fits(tokenizer_size(tokenizer), vocab_size, f"the tokenizer {path!r}", model)


def pad_id_of(source: Any) -> int:
    """The id used for right padding: the pad token, else the EOS token, else 0.

    Args:
        source: a tokenizer, or a model's HF config as a mapping (``config.json``).
    """
    for name in ("pad_token_id", "eos_token_id"):
        value = source.get(name) if isinstance(source, Mapping) else getattr(source, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return 0
