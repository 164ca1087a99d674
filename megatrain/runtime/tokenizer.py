"""Tokenizers: the byte tokenizer and a Hugging Face model folder's `tokenizer.json`, behind one interface.

Where it sits: between text and token files. `megatrain prepare` and the instruction data (chat.py) tokenize
through `Tokenizer`; the token-file sidecars record its `name` and `sha256`; export copies its `files`.
Try it: `.venv/bin/python -c "from megatrain.runtime.tokenizer import Tokenizer; print(Tokenizer.from_dir('DIR'))"`.
Run its tests: `.venv/bin/pytest tests/runtime/test_tokenizer.py`.

- `Tokenizer.bytes()` is runtime/data.py's tokenizer: token = UTF-8 byte, vocabulary 256, eos = DOC_END (0).
- `Tokenizer.from_dir(DIR)` loads DIR/tokenizer.json with the `tokenizers` library (the `hf` extra); never
  `transformers`, never the network. It resolves what `transformers.AutoTokenizer.from_pretrained(DIR)` (5.x,
  its `TokenizersBackend`) resolves from the same files, so ids and special tokens agree with it:
  * special tokens from tokenizer_config.json (`bos_token`, ... as strings or AddedToken objects; other
    `*_token` string keys and an `extra_special_tokens` object are model-specific named tokens), then, only
    when the config has no `added_tokens_decoder` (as v5 and pre-4.34 folders), special_tokens_map.json,
    whose standard entries override the config's; a `pad_token` may also come from tokenizer.json's padding;
  * the config's `added_tokens_decoder` entries, and any special token the backend does not yet hold as an
    added token, are added to it (transformers does so at load time, so a special token missing from
    tokenizer.json gets the next id);
  * `split_special_tokens` in the config makes special tokens encode as plain text;
  * the chat template from chat_template.jinja (plus additional_chat_templates/*.jinja), else the config's
    `chat_template`: a string, or a list of {"name", "template"} of which "default" is the template.
  The eos id falls back to generation_config.json's, then config.json's `eos_token_id` (an int or a list: the
  first) when no eos token is named.
- Text is encoded without the post-processor's special tokens (`add_special_tokens=False`), as
  `apply_chat_template` tokenizes; plain-text documents (`encode_documents`) with them, as `tokenizer(text)`
  does (the post-processor rebuilt from add_bos_token / add_eos_token where transformers 5 rebuilds it); a
  Llama tokenizer's pipeline is rebuilt as transformers 5's LlamaTokenizer builds it (`_as_transformers_class`); truncation and padding baked into tokenizer.json are switched off, as
  transformers does for a plain call. Decoding keeps special tokens.
- Files are read only when they are regular files (links to them included: the Hugging Face cache is links)
  under MAX_FILE_BYTES; any problem a user can fix raises `DataError` with one line naming the file and the fix.

NOTE: model-specific tokenizer classes of transformers 5 that rebuild their backend in Python (a class with
its own `__init__` named by `tokenizer_class`) may differ from tokenizer.json where the file disagrees with
the class's own pipeline; we always follow tokenizer.json, as `TokenizersBackend` does.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from megatrain.files import read_json, read_regular

from .data import DOC_END, VOCAB_SIZE, DataError
from .data import decode as decode_bytes

MAX_FILE_BYTES = 64 << 20  # the largest tokenizer or config file we read (tokenizer.json of a 256k vocab: ~20 MB)
STANDARD_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
TOKENIZER_FILES = (  # the files of a tokenizer, where they exist: export copies them
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
    "chat_template.json", "added_tokens.json", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model",
    "vocab.json", "merges.txt", "vocab.txt", "tiktoken.model", "tekken.json",
)
CHAT_TEMPLATE_DIR = "additional_chat_templates"
_ADDED_TOKEN_FLAGS = ("single_word", "lstrip", "rstrip", "normalized", "special")


def resave_command(folder: Path) -> str:
    """The command that writes a folder's tokenizer.json (and a clean config) with transformers."""
    where = repr(str(folder))
    return (f"`python -c \"import transformers; transformers.AutoTokenizer.from_pretrained({where})"
            f".save_pretrained({where})\"`")


# -- reading files defensively ------------------------------------------------------------------------------
def read_file_bytes(path: Path, cap: int | None = None) -> bytes:
    """The bytes of a regular file (a link to one is fine) of at most `cap` (MAX_FILE_BYTES) bytes, else a
    DataError."""
    return read_regular(path, MAX_FILE_BYTES if cap is None else cap, "a tokenizer file", DataError)


def read_json_object(path: Path, fix: str) -> dict:
    """A JSON object from a regular file under the size cap; anything else is a one-line DataError ending in `fix`."""
    value = read_json(path, MAX_FILE_BYTES, "a tokenizer file", DataError, fix)
    if not isinstance(value, dict):
        raise DataError(f"{path}: expected a JSON object, got {type(value).__name__}; {fix}")
    return value


def _optional_json(path: Path, fix: str) -> dict | None:
    return read_json_object(path, fix) if path.exists() else None


# -- special tokens as transformers resolves them -----------------------------------------------------------
def _token_value(value, where: str, fix: str):
    """A special-token value: a string, or an AddedToken object as a dict with its flags; None stays None."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        flags = {k: value[k] for k in _ADDED_TOKEN_FLAGS if k in value}
        if not all(isinstance(v, bool) for v in flags.values()):
            raise DataError(f"{where}: the flags of an added token must be true or false; {fix}")
        return {"content": value["content"], **flags}
    raise DataError(f"{where}: expected a string or an object with a string \"content\", "
                    f"got {json.dumps(value)[:60]}; {fix}")


def _content(value) -> str:
    return value["content"] if isinstance(value, dict) else value


def _is_added_token_object(value) -> bool:
    return isinstance(value, dict) and value.get("__type") == "AddedToken"


def resolve_special_tokens(config: dict, special_map: dict | None, config_path: Path, map_path: Path,
                           padding: dict | None = None) -> tuple[dict, list]:
    """(named special tokens, extra special tokens) as transformers 5 resolves them from the two files.

    Named tokens are the standard seven plus model-specific `*_token` names, in transformers' order; values
    are strings or AddedToken dicts. Mirrors `PreTrainedTokenizerBase._from_pretrained` and `__init__`.
    """
    fix = f"fix the file or re-save the tokenizer with {resave_command(config_path.parent)}"
    kw = dict(config)
    if "additional_special_tokens" in kw and not kw.get("extra_special_tokens"):
        kw["extra_special_tokens"] = kw.pop("additional_special_tokens")
    # model-specific names (string values) found in the config itself, and an extra_special_tokens object
    explicit = {k: kw.pop(k) for k in list(kw)
                if k not in STANDARD_SPECIAL and k.endswith("_token") and isinstance(kw[k], str)}
    if isinstance(kw.get("extra_special_tokens"), dict):
        explicit.update(kw.pop("extra_special_tokens"))
    if "added_tokens_decoder" not in kw and special_map is not None:
        for key, value in special_map.items():
            if key == "extra_special_tokens" and isinstance(value, list):
                existing = list(kw.get("extra_special_tokens") or [])
                value = existing + [t for t in value if t not in existing]
            elif isinstance(value, dict):
                value = {**value, "special": True, "__type": "AddedToken"}
            kw[key] = value
        if isinstance(kw.get("extra_special_tokens"), dict):
            explicit.update(kw.pop("extra_special_tokens"))
    if padding is not None and padding.get("pad_token") is not None:
        kw.setdefault("pad_token", padding["pad_token"])
    if "additional_special_tokens" in kw and "extra_special_tokens" not in kw:
        kw["extra_special_tokens"] = kw.pop("additional_special_tokens")

    def where(key):
        return f"{map_path if special_map is not None and key in special_map else config_path}: {key}"

    named: dict = {k: None for k in STANDARD_SPECIAL}
    extras: list = []
    auto = {}
    for key, value in kw.items():
        if key in STANDARD_SPECIAL:
            named[key] = _token_value(value, where(key), fix)
        elif key == "extra_special_tokens" and value is not None:
            if isinstance(value, dict):
                named.update({k: _token_value(v, where(f"{key}.{k}"), fix) for k, v in value.items()})
            elif isinstance(value, list):
                extras = [_token_value(v, where(f"{key}[{i}]"), fix) for i, v in enumerate(value)]
            else:
                raise DataError(f"{where(key)}: expected a list of tokens or an object of named tokens; {fix}")
        elif key.endswith("_token") and (isinstance(value, str) or _is_added_token_object(value)):
            auto[key] = _token_value(value, where(key), fix)
    for key, value in {**auto, **explicit}.items():
        named[key] = _token_value(value, where(key), fix)
    if any(v is None for v in extras):
        raise DataError(f"{where('extra_special_tokens')}: holds a null token; {fix}")
    return {k: v for k, v in named.items() if v is not None}, extras


def resolve_chat_templates(folder: Path, config: dict, config_path: Path) -> tuple[dict[str, str], Path | None]:
    """The folder's chat templates by name ("default" is the one used) and the file they came from."""
    templates, source = {}, None
    jinja = folder / "chat_template.jinja"
    if jinja.exists():
        templates["default"], source = _read_text(jinja), jinja
    extra_dir = folder / CHAT_TEMPLATE_DIR
    if extra_dir.is_dir():
        for path in sorted(extra_dir.glob("*.jinja")):
            templates[path.name.removesuffix(".jinja")] = _read_text(path)
            source = source or extra_dir
    if templates:  # template files take priority over the config's entries, as in transformers
        return templates, source
    value = config.get("chat_template")
    fix = "it must be a string or a list of {\"name\": ..., \"template\": ...} objects"
    if value is None:
        return {}, None
    if isinstance(value, str):
        return {"default": value}, config_path
    if isinstance(value, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                       and isinstance(t.get("template"), str) for t in value):
        return {t["name"]: t["template"] for t in value}, config_path
    raise DataError(f"{config_path}: chat_template: {fix}")


def _read_text(path: Path) -> str:
    try:
        return read_file_bytes(path).decode("utf-8")
    except UnicodeDecodeError:
        raise DataError(f"{path}: not UTF-8 text; re-save the chat template as UTF-8") from None


def _eos_fallback(folder: Path) -> int | None:
    """eos_token_id from generation_config.json, else config.json (an int, or a list: its first)."""
    for name in ("generation_config.json", "config.json"):
        path = folder / name
        if not path.exists():
            continue
        value = read_json_object(path, f"fix {name} or remove it").get("eos_token_id")
        if isinstance(value, list) and value:
            value = value[0]
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    return None


# -- the tokenizer ------------------------------------------------------------------------------------------
class Tokenizer:
    """Text to token ids and back: the byte tokenizer (`Tokenizer.bytes()`) or a Hugging Face folder's
    tokenizer.json (`Tokenizer.from_dir(DIR)`). Attributes: see the module docstring and `from_dir`."""

    def __init__(self, name: str, *, vocab_size: int, eos_id: int | None, bos_id: int | None = None,
                 pad_id: int | None = None, special_tokens: dict[str, str] | None = None,
                 chat_template: str | None = None, chat_templates: dict[str, str] | None = None,
                 chat_template_source: str | None = None, files: list[Path] | None = None,
                 sha256: str | None = None, backend=None):
        self.name = name
        self.sha256 = sha256
        self.vocab_size = vocab_size
        self.eos_id, self.bos_id, self.pad_id = eos_id, bos_id, pad_id
        self.special_tokens = dict(special_tokens or {})
        self.chat_template = chat_template
        self.chat_templates = dict(chat_templates or {})  # every named template; "default" is chat_template
        self.chat_template_source = chat_template_source  # the file the template came from, for messages
        self.files = list(files or [])
        self._backend = backend  # a tokenizers.Tokenizer, or None for bytes

    def __repr__(self) -> str:
        return (f"Tokenizer({self.name!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id}, "
                f"bos_id={self.bos_id}, chat_template={'yes' if self.chat_template else 'no'})")

    @classmethod
    def bytes(cls) -> Tokenizer:
        """The byte tokenizer of runtime/data.py: token = UTF-8 byte, eos = DOC_END."""
        return cls("bytes", vocab_size=VOCAB_SIZE, eos_id=DOC_END)

    @classmethod
    def from_dir(cls, folder: str | Path) -> Tokenizer:
        """Load a Hugging Face model folder's tokenizer.json and the files beside it (see the module docstring)."""
        folder = Path(folder)
        if not folder.is_dir():
            raise DataError(f"{folder}: not a folder; pass the Hugging Face model folder that holds tokenizer.json")
        tokenizer_json = folder / "tokenizer.json"
        if not tokenizer_json.exists():
            if (folder / "tokenizer.model").exists():
                raise DataError(f"{tokenizer_json}: missing; the folder has only a SentencePiece tokenizer.model: "
                                f"convert it once with {resave_command(folder)}")
            raise DataError(f"{tokenizer_json}: missing; pass a Hugging Face model folder with a tokenizer.json "
                            "(a fast tokenizer, as saved by transformers)")
        try:
            import tokenizers
        except ImportError:
            raise DataError("loading a Hugging Face tokenizer needs the `tokenizers` package: "
                            "pip install tokenizers (from the megatrain checkout: pip install -e '.[hf]')") from None
        raw = read_file_bytes(tokenizer_json)
        try:
            backend = tokenizers.Tokenizer.from_str(raw.decode("utf-8"))
        except Exception as e:  # noqa: BLE001  (tokenizers raises plain Exceptions for a bad file)
            reason = " ".join(str(e).split())[:200]
            raise DataError(f"{tokenizer_json}: not a tokenizer.json the tokenizers library can load ({reason}); "
                            f"re-save the tokenizer with {resave_command(folder)}") from None

        config_path, map_path = folder / "tokenizer_config.json", folder / "special_tokens_map.json"
        config = _optional_json(config_path, f"fix it or re-save the tokenizer with {resave_command(folder)}") or {}
        special_map = _optional_json(map_path, "fix it or delete it")
        named, extras = resolve_special_tokens(config, special_map, config_path, map_path, backend.padding)
        _add_tokens_as_transformers(backend, folder, config, named, extras)
        if not isinstance(config.get("split_special_tokens", False), bool):
            raise DataError(f"{config_path}: split_special_tokens: expected true or false")
        backend.encode_special_tokens = config.get("split_special_tokens", False)
        backend.no_truncation()
        backend.no_padding()
        _as_transformers_class(backend, config, tokenizer_json)
        _document_post_processor(backend, config, named)

        templates, source = resolve_chat_templates(folder, config, config_path)
        vocab = backend.get_vocab(with_added_tokens=True)

        def token_id(key):
            return backend.token_to_id(_content(named[key])) if key in named else None

        eos_id = token_id("eos_token")
        files = [folder / n for n in TOKENIZER_FILES if (folder / n).is_file()]
        if (folder / CHAT_TEMPLATE_DIR).is_dir():
            files += sorted((folder / CHAT_TEMPLATE_DIR).glob("*.jinja"))
        return cls(
            f"hf:{folder.resolve().name}", sha256=hashlib.sha256(raw).hexdigest(),
            vocab_size=max(vocab.values(), default=-1) + 1,
            eos_id=eos_id if eos_id is not None else _eos_fallback(folder),
            bos_id=token_id("bos_token"), pad_id=token_id("pad_token"),
            special_tokens={k: _content(v) for k, v in named.items()},
            chat_template=templates.get("default"), chat_templates=templates,
            chat_template_source=str(source) if source else None, files=files, backend=backend,
        )

    @property
    def chat_template_sha256(self) -> str | None:
        """The hash of the chat template examples are rendered with (token-file sidecars record it)."""
        return hashlib.sha256(self.chat_template.encode()).hexdigest() if self.chat_template is not None else None

    # -- encoding -----------------------------------------------------------------------------------------
    def encode_documents(self, texts: list[str]) -> list[list[int]]:
        """Ids of plain-text documents as `tokenizer(text)["input_ids"]` gives them: with the special tokens of
        the tokenizer's post-processor (its bos, where it adds one), or of its add_bos_token / add_eos_token."""
        if self._backend is None:
            return [self.encode(t) for t in texts]
        return [e.ids for e in self._backend.encode_batch(list(texts), add_special_tokens=True)]

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without the post-processor's special tokens (add_special_tokens=False)."""
        if self._backend is None:
            return list(text.encode("utf-8"))
        return self._backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """`encode` of each text; the tokenizers library spreads a batch over every core."""
        if self._backend is None:
            return [self.encode(t) for t in texts]
        return [e.ids for e in self._backend.encode_batch(list(texts), add_special_tokens=False)]

    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids and the (start, end) character span in `text` of each token."""
        if self._backend is None:
            ids, spans = [], []
            for i, ch in enumerate(text):
                b = ch.encode("utf-8")
                ids += b
                spans += [(i, i + 1)] * len(b)
            return ids, spans
        encoding = self._backend.encode(text, add_special_tokens=False)
        return encoding.ids, [tuple(o) for o in encoding.offsets]

    def decode(self, ids) -> str:
        """Text of token ids, special tokens included (invalid UTF-8 from partial bytes becomes U+FFFD)."""
        if self._backend is None:
            return decode_bytes(ids)
        return self._backend.decode([int(i) for i in ids], skip_special_tokens=False)

    def token_id(self, token: str) -> int | None:
        """The id of one token (an added token's content or a vocabulary entry), None if there is none."""
        if self._backend is None:
            b = token.encode("utf-8")
            return b[0] if len(b) == 1 else None
        return self._backend.token_to_id(token)


def _document_post_processor(backend, config: dict, named: dict) -> None:
    """transformers 5 rebuilds the post-processor from add_bos_token / add_eos_token (default false) when the
    config names either or tokenizer.json has none; otherwise tokenizer.json's own is used."""
    from tokenizers import processors

    if not ("add_bos_token" in config or "add_eos_token" in config or backend.post_processor is None):
        return
    single, pair, specials = "$A:0", "$B:1", []
    for key, flag in (("bos_token", "add_bos_token"), ("eos_token", "add_eos_token")):
        token = _content(named[key]) if key in named else None
        if config.get(flag) is True and token is not None and backend.token_to_id(token) is not None:
            single = f"{token}:0 {single}" if key == "bos_token" else f"{single} {token}:0"
            pair = f"{token}:1 {pair}" if key == "bos_token" else f"{pair} {token}:1"
            specials.append((token, backend.token_to_id(token)))
    backend.post_processor = processors.TemplateProcessing(single=single, pair=f"{single} {pair}",
                                                           special_tokens=specials)


LLAMA_CLASSES = ("LlamaTokenizer", "LlamaTokenizerFast")


def _as_transformers_class(backend, config: dict, tokenizer_json: Path) -> None:
    """transformers 5 does not read a Llama tokenizer's pipeline from tokenizer.json: LlamaTokenizer rebuilds
    it (no normalizer; a Metaspace pre-tokenizer that prepends "▁" to the first piece of text only, unless
    `legacy`, or to none without add_prefix_space). Llama-2 folders saved by transformers 4 hold the older
    pipeline (a normalizer that prepends "▁" after every special token too), so we rebuild as it does; a
    Llama tokenizer that is not a BPE model cannot be, and is refused naming the difference."""
    if config.get("tokenizer_class") not in LLAMA_CLASSES:
        return
    from tokenizers import decoders, pre_tokenizers

    kind = type(backend.model).__name__
    if kind != "BPE":
        raise DataError(f"{tokenizer_json}: a {config['tokenizer_class']} whose model is {kind}, "
                        "not BPE: transformers 5 rebuilds Llama tokenizers as BPE, so the ids would differ; "
                        f"re-save it with {resave_command(tokenizer_json.parent)}")
    prefix = config.get("add_prefix_space")
    prefix = True if prefix is None else prefix
    scheme = ("always" if config.get("legacy", False) else "first") if prefix else "never"
    model = backend.model  # BPE(vocab, merges, fuse_unk=True, byte_fallback=True), with no unk token
    model.unk_token, model.fuse_unk, model.byte_fallback, model.dropout, model.ignore_merges = None, True, True, None, False
    backend.normalizer = None
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme, split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + ([decoders.Strip(content=" ", left=1)] if prefix else []))


def _add_tokens_as_transformers(backend, folder: Path, config: dict, named: dict, extras: list) -> None:
    """Add to the backend what transformers adds at load time: the config's `added_tokens_decoder` (or, in
    older folders, added_tokens.json), then every special token not yet among the backend's added tokens."""
    from tokenizers import AddedToken

    config_path = folder / "tokenizer_config.json"
    fix = f"fix the file or re-save the tokenizer with {resave_command(folder)}"
    entries = []  # (index, AddedToken kwargs)
    decoder = config.get("added_tokens_decoder")
    if decoder is not None:
        if not isinstance(decoder, dict):
            raise DataError(f"{config_path}: added_tokens_decoder: expected an object of id -> token; {fix}")
        for index, value in decoder.items():
            token = _token_value(value, f"{config_path}: added_tokens_decoder[{index}]", fix)
            if not isinstance(token, dict) or not index.isdigit():
                raise DataError(f"{config_path}: added_tokens_decoder[{index}]: expected an id and an object "
                                f"with \"content\"; {fix}")
            entries.append((int(index), token))
    elif (folder / "added_tokens.json").exists():  # legacy: content -> index, special if a special token
        legacy = read_json_object(folder / "added_tokens.json", "fix it or delete it")
        specials = {_content(v) for v in [*named.values(), *extras]}
        present = set(backend.get_added_tokens_decoder())
        for content, index in legacy.items():
            if not isinstance(index, int) or isinstance(index, bool):
                raise DataError(f"{folder / 'added_tokens.json'}: {content}: expected an integer id; fix it or delete it")
            if index not in present:
                special = content in specials
                entries.append((index, {"content": content, "normalized": not special, "special": special}))
    to_add = [AddedToken(**token) for _, token in sorted(entries, key=lambda e: e[0])]
    have = {t.content for t in backend.get_added_tokens_decoder().values()} | {t.content for t in to_add}
    named_contents = {_content(v) for v in named.values()}
    for value in [*named.values(), *extras]:
        if isinstance(value, dict):  # an AddedToken keeps its flags; a named token is always special
            token = AddedToken(**{**value, "special": value.get("special", False) or value["content"] in named_contents})
        else:
            token = AddedToken(value, special=True)
        if token.content not in have:
            to_add.append(token)
            have.add(token.content)
    if to_add:
        backend.add_tokens(to_add)


def check_made_with(path: Path, meta: dict, model_dir: Path) -> None:
    """A token file made for `model_dir`'s tokenizer: the same tokenizer.json and, for instruction data, the
    same chat template (its hash in the sidecar; files from before it was recorded are not checked)."""
    mine = model_dir / "tokenizer.json"
    if not mine.is_file():
        return
    if meta.get("tokenizer_sha256") != hashlib.sha256(read_file_bytes(mine)).hexdigest():
        raise DataError(f"{path}: was made with another tokenizer ({meta.get('tokenizer', 'unknown')}) than the "
                        f"model's {mine}; prepare it with `megatrain prepare ... --tokenizer {model_dir}`")
    if "examples" not in meta or "chat_template_sha256" not in meta:
        return
    config_path = model_dir / "tokenizer_config.json"
    config = _optional_json(config_path, f"fix it or re-save the tokenizer with {resave_command(model_dir)}") or {}
    template, source = resolve_chat_templates(model_dir, config, config_path)
    template = template.get("default")
    have = hashlib.sha256(template.encode()).hexdigest() if template is not None else None
    if meta["chat_template_sha256"] != have:
        raise DataError(f"{path}: was rendered with another chat template than the model's "
                        f"({source or 'it has none'}); prepare it again with `megatrain prepare ... --tokenizer "
                        f"{model_dir}`")
