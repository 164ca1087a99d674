"""Files a user hands megatrain, and files megatrain writes: defensive reads, atomic writes, path checks.

Where it sits: below every command that reads a user's file or writes an output. Nothing here imports torch:
the CLI checks paths before it imports anything heavy. Run its tests:
`.venv/bin/pytest tests/test_nothing_lost.py tests/test_cli_hostile.py`.

Reading (`read_regular`, `read_json`, `json_lines`): regular files only (a FIFO, a device or a folder given as a file is
refused before any read: opening with O_NONBLOCK, a FIFO with no writer does not hang), under a size cap,
JSON parsed with a nesting limit. One line names the file; the caller picks the error class.

Writing (`write_atomic`, `atomic_open`): a temporary file in the target's folder, fsynced, renamed over the
target (which replaces a symbolic link at the path instead of writing through it), then the folder fsynced.
On any failure (a full disk, a kill) the previous file is intact, the temporary one is gone, and the error is
one line naming the path. `append_open` is the one exception, for append logs (metrics JSONL): each line is
flushed as it is written, and a torn last line left by a kill is ended before anything is appended.

Checking (`output_path` / `input_path` as argparse types, `check_outputs` before any work): an empty path is
refused; an output whose target exists and is not a regular file or a link (a FIFO, a device, a folder) is
refused; an output that is, or lies inside, one of the run's inputs or a checkpoint folder, or that equals
another output, is refused; each output (an existing file and its folder) must be writable now, not after hours
of training.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

MAX_JSON_DEPTH = 64


# -- reading -----------------------------------------------------------------------------------------------------
def read_regular(path: str | Path, cap: int, what: str, error: type[Exception] = ValueError) -> bytes:
    """The bytes of the regular file `path` (a link to one is fine) of at most `cap` bytes; `what` names
    the file's role in messages ("a run file", "a tokenizer file")."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        with open(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise error(f"{path}: not a regular file; pass {what} itself")
            data = f.read(cap + 1)
    except OSError as e:
        raise error(f"{path}: cannot read {what} ({e.strerror}); check the path exists and is readable") from None
    if len(data) > cap:
        raise error(f"{path}: larger than {cap:,} bytes, too large for {what}; check it is the right file")
    return data


def json_lines(path: str | Path, what: str, error: type[Exception] = ValueError, cap: int | None = None,
               line_cap: int | None = None, too_long: str = "too long to read; split the record or drop the line"
               ) -> Iterator[tuple[int, object]]:
    """(line number, parsed value) of each non-blank line of the JSON Lines file `path`, read line by line (a
    regular file only, at most `cap` bytes if given) with the nesting limit; a line that is not UTF-8 or not
    JSON raises `error` naming the file and the line, and so does a line of more than `line_cap` bytes, before
    it is held whole (`too_long`: what to do about it)."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        f = open(fd, "rb")
    except OSError as e:
        raise error(f"{path}: cannot read {what} ({e.strerror}); check the path exists and is readable") from None
    with f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise error(f"{path}: not a regular file; pass {what} itself")
        read, n = 0, 0
        while raw := f.readline(-1 if line_cap is None else line_cap + 1):
            n += 1
            read += len(raw)
            if cap is not None and read > cap:
                raise error(f"{path}: larger than {cap:,} bytes, too large for {what}; check it is the right file")
            if line_cap is not None and len(raw) > line_cap and not raw.endswith(b"\n"):
                raise error(f"{path}:{n}: a record of more than {line_cap:,} bytes, {too_long}")
            value = json_line(raw, f"{path}:{n}", error)
            if value is not None:
                yield n, value


def json_line(raw: bytes, where: str, error=ValueError):
    """One line of a JSONL file as its value (None for a blank line), or `error` naming `where`: not UTF-8,
    not JSON, or nested deeper than MAX_JSON_DEPTH."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise error(f"{where}: not UTF-8 text; re-save the file as UTF-8") from None
    if not line.strip():
        return None
    try:
        value = json.loads(line)
    except json.JSONDecodeError as e:
        raise error(f"{where}: not valid JSON ({e.msg} at column {e.colno}); write one JSON object per line") from None
    except (RecursionError, MemoryError, ValueError) as e:
        raise error(f"{where}: not valid JSON ({type(e).__name__}: nested too deeply or too large); "
                    "write one JSON object per line") from None
    if json_depth(value) > MAX_JSON_DEPTH:
        raise error(f"{where}: nested more than {MAX_JSON_DEPTH} levels deep; write flat records")
    return value


def json_depth(value, limit: int = MAX_JSON_DEPTH) -> int:
    """Nesting depth of a parsed JSON/TOML value, counting no further than `limit` + 1."""
    depth, level = 0, [value]
    while level and depth <= limit:
        nxt = []
        for v in level:
            if isinstance(v, dict):
                nxt += v.values()
            elif isinstance(v, list):
                nxt += v
        if not nxt:
            break
        depth += 1
        level = nxt
    return depth


def read_json(path: str | Path, cap: int, what: str, error: type[Exception] = ValueError, fix: str = ""):
    """A JSON value from a regular file under `cap` bytes, nested at most MAX_JSON_DEPTH deep."""
    return _parse(Path(path), read_regular(path, cap, what, error), "JSON", what, error, fix)


def read_structured(path: str | Path, cap: int, what: str, error: type[Exception] = ValueError, fix: str = ""):
    """A JSON (.json) or TOML (.toml) document from a regular file under `cap` bytes, nested at most
    MAX_JSON_DEPTH deep; anything else is one line naming the file."""
    kind = "TOML" if Path(path).suffix.lower() == ".toml" else "JSON"
    return _parse(Path(path), read_regular(path, cap, what, error), kind, what, error, fix)


def _parse(path: Path, data: bytes, kind: str, what: str, error: type[Exception], fix: str):
    import tomllib

    tail = f"; {fix}" if fix else ""
    try:
        text = data.decode("utf-8")
        value = json.loads(text) if kind == "JSON" else tomllib.loads(text)
    except UnicodeDecodeError:
        raise error(f"{path}: not UTF-8 text{tail}") from None
    except json.JSONDecodeError as e:
        raise error(f"{path}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno}){tail}") from None
    except tomllib.TOMLDecodeError as e:
        raise error(f"{path}: not valid TOML ({' '.join(str(e).split())[:160]}){tail}") from None
    except (RecursionError, MemoryError, ValueError) as e:  # ValueError: e.g. an integer too long to convert
        raise error(f"{path}: not valid {kind} ({type(e).__name__}: nested too deeply or too large){tail}") from None
    if json_depth(value) > MAX_JSON_DEPTH:
        raise error(f"{path}: nested more than {MAX_JSON_DEPTH} levels deep, which {what} never is{tail}")
    return value


# -- writing -----------------------------------------------------------------------------------------------------
def fsync_dir(folder: Path) -> None:
    """fsync a folder so a rename inside it is durable."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return  # NOTE: not every platform opens folders; the rename is still atomic
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_open(path: str | Path, mode: str = "w", what: str = "") -> Iterator[io.IOBase]:
    """A file object ("w": UTF-8 text, "wb": bytes) whose contents replace `path` whole when the block ends
    without an error; on an error the previous file stays as it was. OS errors are one line naming the path."""
    out = Path(path)
    label = f"{what} {out}".strip()
    try:
        fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    except OSError as e:
        raise ValueError(f"cannot write {label}: {e.strerror or e} (in {out.parent}); choose a writable path") from None
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it private; an output gets a normal file's mode
    try:
        binary = "b" in mode
        with os.fdopen(fd, "wb" if binary else "w", **({} if binary else {"encoding": "utf-8"})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
        fsync_dir(out.parent)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        raise ValueError(f"cannot write {label}: {e.strerror or e}; the previous file, if any, is unchanged") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_atomic(path: str | Path, data: str | bytes, what: str = "") -> Path:
    """Replace `path` with `data` atomically (see atomic_open)."""
    with atomic_open(path, "wb" if isinstance(data, bytes) else "w", what) as f:
        f.write(data)
    return Path(path)


@contextmanager
def append_open(path: str | Path, what: str = "") -> Iterator[_AppendLog]:
    """An append log: a torn last line (a kill mid-write) is ended first, so new lines stand on their own;
    each write is the caller's line, flushed when written (line buffering)."""
    out = Path(path)
    label = f"{what} {out}".strip()
    created = not os.path.lexists(out)
    try:
        if out.is_file() and out.stat().st_size:
            with open(out, "rb") as f:
                f.seek(-1, os.SEEK_END)
                torn = f.read(1) != b"\n"
        else:
            torn = False
        f = open(out, "a", encoding="utf-8", buffering=1)
    except OSError as e:
        raise ValueError(f"cannot write {label}: {e.strerror or e}; choose a writable path") from None
    log = _AppendLog(f, label, created)
    try:
        if torn:
            log.write("\n")
        yield log
    except BaseException:
        with contextlib.suppress(OSError):
            f.close()
        if created and log.lines == 0:  # a failed first write leaves no empty file behind
            with contextlib.suppress(OSError):
                if out.stat().st_size == 0:
                    out.unlink()
        raise
    else:
        f.close()


class _AppendLog:
    """An append log's writes: a failure of one of them (a full disk under the log) is one line naming the log;
    what fails in the caller's own work while the log is open is left to the caller."""

    def __init__(self, f: io.TextIOBase, label: str, created: bool = False):
        self._f, self._label, self._created = f, label, created
        self.lines = 0  # lines this log wrote whole

    def write(self, text: str) -> int:
        try:
            n = self._f.write(text)
        except OSError as e:
            raise self._error(e) from None
        self.lines += text.count("\n")
        return n

    def flush(self) -> None:
        try:
            self._f.flush()
        except OSError as e:
            raise self._error(e) from None

    def _error(self, e: OSError) -> ValueError:
        kept = ("the lines written before are kept" if not self._created else
                f"the {self.lines} line(s) written before are kept" if self.lines else
                "nothing had been written, and the empty file is removed")
        return ValueError(f"cannot write {self._label}: {e.strerror or e}; {kept}")


def remove_tree(path: Path) -> None:
    """Delete a folder we own (a temporary, a set-aside checkpoint, a spoiled cache entry), or the link or
    file in its place: a symbolic link is unlinked, never followed (rmtree refuses links and left them)."""
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists (one of another user counts: not ours to judge)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


# -- the cache ---------------------------------------------------------------------------------------------------
def cache_root() -> Path:
    """megatrain's cache (built kernels, the prepared default corpus, probed profiles): $MEGATRAIN_CACHE, else
    ~/.cache/megatrain. What is there is rebuilt when missing or spoiled; nothing there is a user's only copy."""
    return Path(os.environ.get("MEGATRAIN_CACHE") or Path.home() / ".cache" / "megatrain")


def cache_error(e: OSError, what: str, folder: Path | None = None) -> ValueError:
    """The one line for a cache that cannot be written (an unwritable or missing HOME, a read-only cache)."""
    return ValueError(f"cannot write {what} in megatrain's cache {folder or cache_root()} ({e.strerror or e}); "
                      "set MEGATRAIN_CACHE to a writable folder")


def check_cache_writable(folder: Path, what: str) -> None:
    """Before work whose result goes into the cache (a probe's minutes of measuring): `folder` exists or is
    made, and takes a file."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".writable-"):
            pass
    except OSError as e:
        raise cache_error(e, what, folder) from None


# -- checking ----------------------------------------------------------------------------------------------------
def input_path(text: str) -> str:
    """argparse type of a path the command reads: refuses an empty one (it would mean "nothing" to some
    commands and "the current folder" to others); `~` is the home folder."""
    if not text or not text.strip():
        raise argparse.ArgumentTypeError("an empty path; pass a file or folder")
    return os.path.expanduser(text)  # `~/x` as a shell would (which leaves `--data=~/x` as it is)


def output_path(text: str) -> str:
    """argparse type of a file the command writes (see `check_output_file`)."""
    text = input_path(text)
    try:
        return str(check_output_file(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def check_output_file(path: str | Path) -> Path:
    """Refuse a target that is not a regular file (a FIFO, a device or a folder; a symbolic link is fine: it
    is replaced, its target untouched), an existing file this process may not write, or one whose folder is a
    file."""
    path = Path(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return path
    except NotADirectoryError:
        blocker = next((p for p in path.parents if p.exists() and not p.is_dir()), path.parent)
        raise ValueError(f"cannot write {path}: {blocker} is a file, not a folder; choose a writable path") from None
    except OSError as e:
        raise ValueError(f"{path}: cannot be inspected ({e.strerror}); choose another path") from None
    if stat.S_ISDIR(st.st_mode):
        raise ValueError(f"{path} is a folder; pass a file path")
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)):
        raise ValueError(f"{path} is not a regular file (a FIFO or a device?); outputs are written as files: "
                         "choose another path")
    if stat.S_ISREG(st.st_mode) and not _replaceable(path, st):
        raise ValueError(f"cannot write {path}: the file exists and is not writable (permission denied); make "
                         "it writable, remove it, or choose another path")
    return path


def _replaceable(path: Path, st: os.stat_result) -> bool:
    """Whether this process may replace the existing file `path`: it is writable (a read-only file is one its
    owner kept from changes), and in a sticky folder (/tmp) it, or the folder, is ours."""
    if not os.access(path, os.W_OK):
        return False
    try:
        folder = os.stat(path.parent)
    except OSError:
        return True  # the folder's own check says what is wrong with it
    euid = os.geteuid() if hasattr(os, "geteuid") else 0
    return not (folder.st_mode & stat.S_ISVTX) or euid in (0, st.st_uid, folder.st_uid)


def _inside(a: Path, b: Path) -> bool:
    return a == b or b in a.parents


def is_checkpoint(folder: Path) -> bool:
    """A megatrain checkpoint folder (its manifest says so) or a folder of them."""
    return (folder / "manifest.json").is_file() or any(p.is_dir() and p.name.startswith("step-") and
                                                      (p / "manifest.json").is_file() for p in _children(folder))


def _children(folder: Path):
    try:
        return list(folder.iterdir())
    except OSError:
        return []


def check_outputs(outputs: dict[str, str | None], inputs: dict[str, str | None] | None = None,
                  folders: dict[str, str | None] | None = None) -> None:
    """Before any work: every output (flag -> file path) has a writable folder, is none of the `inputs`
    (flag -> file or folder read) nor inside one of them that is a folder, is not inside a checkpoint folder,
    and differs from the other outputs and `folders` (flag -> a folder the command writes into)."""
    given = {flag: Path(p).resolve() for flag, p in outputs.items() if p}
    ins = {flag: Path(p).resolve() for flag, p in (inputs or {}).items() if p}
    dirs = {flag: Path(p).resolve() for flag, p in (folders or {}).items() if p}
    seen: dict[Path, str] = {}
    for flag, path in given.items():
        if path in seen:
            raise ValueError(f"{flag} and {seen[path]} name the same file {outputs[flag]}; one would overwrite "
                             "the other: give each its own path")
        seen[path] = flag
        for iflag, ipath in ins.items():
            if path == ipath or (ipath.is_dir() and _inside(path, ipath)):
                raise ValueError(f"{flag} {outputs[flag]} {'is' if path == ipath else 'lies inside'} the "
                                 f"{iflag} input {inputs[iflag]}; writing it would destroy what the run reads: "
                                 "choose another path")
        for dflag, dpath in dirs.items():
            if path == dpath:
                raise ValueError(f"{flag} {outputs[flag]} is the {dflag} folder; choose a file path")
        for parent in (path.parent, *path.parent.parents):
            if (parent / "manifest.json").is_file() and is_checkpoint(parent):
                raise ValueError(f"{flag} {outputs[flag]} lies inside the checkpoint {parent}; writing there "
                                 "could damage it: choose a path outside it")
        try:
            check_output_file(outputs[flag])
        except ValueError as e:
            raise ValueError(f"{flag}: {e}") from None
        writable_dir(path.parent, flag, f"{flag} {outputs[flag]}")


def writable_dir(folder: str | Path, flag: str, what: str | None = None) -> Path:
    """Create `folder` if needed and try writing in it now; one line naming the flag otherwise."""
    folder = Path(folder)
    what = what or f"{flag} {folder}"
    blocker = next((p for p in (folder, *folder.parents) if p.exists()), None)
    if blocker is not None and not blocker.is_dir():
        raise ValueError(f"cannot write {what}: {blocker} is a file, not a folder; choose a writable {flag} path")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise ValueError(f"cannot write {what}: {e.strerror or e} ({folder}); choose a writable {flag} path"
                         ) from None
    return folder
