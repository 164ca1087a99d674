"""Loading a Hugging Face model folder's weights into the host store, tensor by tensor.

Where it sits: the Trainer (trainer.py) trains `--model DIR` from the folder's weights with fresh optimizer
state: `check_weights` reads every shard's header before anything large is allocated (a missing or corrupt
shard, a tensor of the wrong shape, a missing or unexpected tensor is one line naming it), then
`load_weights` streams each tensor from its file straight into the store's fp32 masters. Only one tensor's
bytes (the largest in a lower precision, e.g. bf16 embeddings) exist beside the store at any time: files are
read with `readinto`, not memory-mapped, so the page cache is not counted against the process.
Run its tests: `.venv/bin/pytest tests/runtime/test_hf.py`.

Folders hold `model.safetensors`, or shards listed by `model.safetensors.index.json` (its `weight_map`
names each tensor's file). `pytorch_model.bin` is never loaded: it is a pickle.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from megatrain.models.eager import param_shapes
from megatrain.models.hf import IGNORED, HFConfigError, our_name, read_json

from .tensorfiles import SafetensorsFile
from .tokenizer import CHAT_TEMPLATE_DIR, TOKENIZER_FILES

INDEX = "model.safetensors.index.json"
# What a model folder holds besides its weights: carried in every checkpoint (hf/...) and written by export.
SOURCE_FILES = ("config.json", "generation_config.json", *TOKENIZER_FILES)
SINGLE = "model.safetensors"
NAMED_TEMPLATE = "hf/" + CHAT_TEMPLATE_DIR + "--{}.jinja"  # a named chat template as a checkpoint's flat file name
_FLAT_NAME = re.compile(r"[A-Za-z0-9_.-]+")


def source_files(model_dir: Path | None) -> dict[str, Path]:
    """What a checkpoint carries of the folder a run started from, by the name it has there: SOURCE_FILES
    under hf/, and each named chat template (additional_chat_templates/NAME.jinja) as one flat file, since a
    checkpoint holds no subfolders. Export writes them back where they came from."""
    if model_dir is None:
        return {}
    out = {f"hf/{name}": model_dir / name for name in SOURCE_FILES if (model_dir / name).is_file()}
    folder = model_dir / CHAT_TEMPLATE_DIR
    if folder.is_dir():
        out.update({NAMED_TEMPLATE.format(p.stem): p for p in sorted(folder.glob("*.jinja"))
                    if p.is_file() and _FLAT_NAME.fullmatch(p.stem)})
    return out


@dataclass(frozen=True)
class WeightPlan:
    """What load_weights reads: per file, Hugging Face tensor name -> eager parameter name."""

    folder: Path
    files: tuple[tuple[Path, dict[str, str]], ...]

    @property
    def n_tensors(self) -> int:
        return sum(len(names) for _, names in self.files)


def weight_files(folder: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The safetensors files of a model folder and the index's weight map (None without an index)."""
    index = folder / INDEX
    if index.exists():
        data = read_json(index, "expected a safetensors index with a weight_map", cap=256 * 2**20)
        wmap = data.get("weight_map")
        if not isinstance(wmap, dict) or not wmap or not all(isinstance(k, str) and isinstance(v, str)
                                                              for k, v in wmap.items()):
            raise HFConfigError(f"{index}: weight_map must map tensor names to shard file names")
        files = []
        for name in sorted(set(wmap.values())):
            path = folder / name
            if Path(name).name != name:
                raise HFConfigError(f"{index}: shard {name!r} is not a file name inside the model folder")
            if not path.is_file():
                raise HFConfigError(f"{path}: shard listed in {INDEX} is missing; copy the whole model folder again")
            files.append(path)
        return files, wmap
    if (folder / SINGLE).is_file():
        return [folder / SINGLE], None
    if any(folder.glob("*.bin")):
        raise HFConfigError(f"{folder}: holds PyTorch .bin weights, which megatrain does not load (a pickle can run "
                            "code); convert them with transformers: AutoModelForCausalLM.from_pretrained(DIR)"
                            ".save_pretrained(DIR, safe_serialization=True)")
    raise HFConfigError(f"{folder}: no {SINGLE} or {INDEX}; a model folder to train from needs its weights "
                        "(plan and inspect need config.json only)")


def check_weights(folder: str | Path, config) -> WeightPlan:
    """Read every shard's header and match its tensors to `config`'s parameters; read no tensor data."""
    folder = Path(folder)
    files, wmap = weight_files(folder)
    shapes = param_shapes(config)
    tied = "head.lm_head.weight" if config.tie_embeddings else None
    head = None
    seen: dict[str, Path] = {}
    plan = []
    for path in files:
        fix = "the file is damaged: copy the model folder again"
        sf = SafetensorsFile(path, None, fix)
        sf.close()
        names = {}
        for hf, (dtype, shape, _, _) in sf.entries.items():
            if IGNORED.fullmatch(hf):
                continue
            ours = our_name(hf)
            if ours == tied:
                head = (path, hf)  # tied to the embedding: it must hold the embedding's values (below)
                continue
            if ours not in shapes:
                raise HFConfigError(f"{path}: tensor {hf} is not part of the model config.json describes "
                                    f"({config.name}); the weights and the config do not belong together")
            if hf in seen:
                raise HFConfigError(f"{path}: tensor {hf} is also in {seen[hf].name}")
            if wmap is not None and wmap.get(hf) != path.name:
                raise HFConfigError(f"{folder / INDEX}: lists {hf} in {wmap.get(hf)!r} but it is in {path.name}")
            if shape != shapes[ours]:
                raise HFConfigError(f"{path}: tensor {hf} has shape {list(shape)} but config.json makes it "
                                    f"{list(shapes[ours])}")
            if str(dtype).removeprefix("torch.") not in ("float32", "float16", "bfloat16", "float64"):
                raise HFConfigError(f"{path}: tensor {hf} is {dtype}; megatrain loads float32, float16, bfloat16 "
                                    "and float64 weights (quantised checkpoints are not supported)")
            seen[hf] = path
            names[hf] = ours
        plan.append((path, names))
    missing = sorted(set(shapes) - set(seen_name for _, ns in plan for seen_name in ns.values()))
    if missing:
        raise HFConfigError(f"{folder}: the weights lack {missing[0]}{f' and {len(missing) - 1} more' if len(missing) > 1 else ''}"
                            f" (as Hugging Face names it: {_hf_of(missing[0])}); the model folder is incomplete")
    if wmap is not None:
        extra = sorted(set(wmap) - set(seen) - {n for n in wmap if IGNORED.fullmatch(n) or our_name(n) == tied})
        if extra:
            raise HFConfigError(f"{folder / INDEX}: lists {extra[0]}, which no shard holds")
    if head is not None:
        embed = next((p, hf) for p, names in plan for hf, ours in names.items() if ours == "embed.embed_tokens.weight")
        _check_tied_head(head, embed)
    return WeightPlan(folder, tuple(plan))


def _check_tied_head(head: tuple[Path, str], embed: tuple[Path, str], rows: int = 4096) -> None:
    """A folder whose config ties the head to the embedding but whose files also hold an lm_head.weight: the
    same model only if the two hold the same values (compared `rows` rows at a time); otherwise which one
    the head is depends on the loader, so it is refused."""
    from safetensors import safe_open

    with safe_open(head[0], "pt") as fh, safe_open(embed[0], "pt") as fe:
        h, e = fh.get_slice(head[1]), fe.get_slice(embed[1])
        n = h.get_shape()[0]
        for a in range(0, n, rows):
            if not h[a : a + rows].float().equal(e[a : a + rows].float()):
                raise HFConfigError(
                    f"{head[0]}: holds {head[1]}, which differs from {embed[1]}, but config.json sets "
                    "tie_word_embeddings (the head is the embedding): set tie_word_embeddings to false to train "
                    "the head the file holds, or remove it from the file to tie them")


def _hf_of(name: str) -> str:
    from megatrain.models.hf import hf_name

    return hf_name(name)


def load_weights(plan: WeightPlan, store) -> int:
    """Fill the store's fp32 masters from the checked files (cast from their dtype); returns the number of
    tensors read. (The masters are what load_params streams from: nothing else needs refreshing.)"""
    masters = store.named_master()
    for path, names in plan.files:
        sf = SafetensorsFile(path, None, "the file is damaged or changed since it was checked: copy the model "
                             "folder again")
        sf.read({hf: masters[ours] for hf, ours in names.items()}, cast=True)
        for hf, ours in names.items():  # a NaN or inf here would surface as a NaN loss blamed on training
            if not bool(masters[ours].isfinite().all()):
                raise HFConfigError(f"{path}: tensor {hf} holds NaN or inf values; the model folder is damaged "
                                    "(or was saved from a diverged run): copy it again")
    return plan.n_tensors
