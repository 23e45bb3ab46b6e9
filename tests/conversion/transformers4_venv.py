"""A transformers 4.57 virtual environment for tests that check a saved folder loads in transformers 4.x too
(tokenizers only: transformers, tokenizers and jinja2; no torch).

    python() -> Path   the venv's interpreter (created on first use)

The venv is `<cache>/transformers-4.57-tokenizers-venv/` (cache: $KIMI_HF_CACHE, else
$XDG_CACHE_HOME/kimi_hf, else ~/.cache/kimi_hf, as for transformers' test files in
tests/models/kimi_hybrid/transformers_tests.py, whose cache and lock helpers it uses). It is built once, under an
exclusive file lock: `python -m venv`, then `pip install "transformers==4.57.*" tokenizers jinja2` (about 30 s),
a check that it imports transformers 4.57 and no torch, then a marker file written last; a folder without the
marker (an interrupted build) is removed and built again. Parallel runs neither build twice nor use a half-built
venv.

`FetchError` (transformers_tests' class) is raised only when pip could not download the packages (no network,
the index unreachable or refusing, a download timing out): the caller skips then. Any other failure (the venv not
created, pip failing otherwise, the wrong version installed) is an error.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from ..models.kimi_hybrid.transformers_tests import FetchError, _locked, cache_root


VERSION = "4.57"
REQUIREMENTS = (f"transformers=={VERSION}.*", "tokenizers", "jinja2")
MARKER = ".kimi_hf_complete"
PIP_TIMEOUT_S = 900
# what pip prints when it cannot reach the index or download from it (not a resolver or build error)
_DOWNLOAD_FAILURE = re.compile(
    r"NewConnectionError|Failed to establish a new connection|Temporary failure in name resolution|"
    r"Name or service not known|nodename nor servname|Max retries exceeded|Connection refused|Network is unreachable|"
    r"ConnectTimeout|ReadTimeout|timed out|ProxyError|SSLError|HTTP error \d{3}|\(from versions: none\)",
    re.IGNORECASE,
)


def venv_dir() -> Path:
    return cache_root() / f"transformers-{VERSION}-tokenizers-venv"


def _interpreter(folder: Path) -> Path:
    return folder / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def _run(cmd: list, timeout: float) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def _tail(proc: subprocess.CompletedProcess, lines: int = 8) -> str:
    return "\n".join(((proc.stderr or "") + (proc.stdout or "")).strip().splitlines()[-lines:])


def _build(folder: Path) -> None:
    proc = _run([sys.executable, "-m", "venv", str(folder)], timeout=300)
    py = _interpreter(folder)
    if proc.returncode or not py.exists():
        raise RuntimeError(f"`{sys.executable} -m venv {folder}` failed (exit {proc.returncode}): {_tail(proc)}")
    cmd = [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-input", *REQUIREMENTS]
    try:
        proc = _run(cmd, timeout=PIP_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        raise FetchError(f"`pip install {' '.join(REQUIREMENTS)}` took over {PIP_TIMEOUT_S} s: {e}") from e
    if proc.returncode:
        output = (proc.stderr or "") + (proc.stdout or "")
        message = f"`pip install {' '.join(REQUIREMENTS)}` failed (exit {proc.returncode}): {_tail(proc)}"
        raise (FetchError if _DOWNLOAD_FAILURE.search(output) else RuntimeError)(message)
    check = (
        "import importlib.util, transformers, tokenizers, jinja2; "
        "print(transformers.__version__, tokenizers.__version__, importlib.util.find_spec('torch') is None)"
    )
    proc = _run([str(py), "-c", check], timeout=300)
    found = proc.stdout.split()
    if proc.returncode or len(found) != 3 or not found[0].startswith(VERSION + ".") or found[2] != "True":
        raise RuntimeError(f"the venv {folder} has not transformers {VERSION} without torch: {found} {_tail(proc)}")
    (folder / MARKER).write_text(f"transformers {found[0]}, tokenizers {found[1]}; no torch\n")


def python() -> Path:
    """The interpreter of the transformers 4.57 venv, built on first use (see the module docstring)."""
    folder = venv_dir()
    if (folder / MARKER).is_file() and _interpreter(folder).exists():
        return _interpreter(folder)
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root / f"{folder.name}.lock"):
        if (folder / MARKER).is_file() and _interpreter(folder).exists():  # built by another process meanwhile
            return _interpreter(folder)
        if folder.exists():  # an interrupted build: start again
            shutil.rmtree(folder)
        try:
            _build(folder)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
    return _interpreter(folder)


def installed_versions() -> str:
    """What the venv's marker says it holds (after `python()`)."""
    return (venv_dir() / MARKER).read_text().strip()


__all__ = ["FetchError", "python", "venv_dir", "installed_versions", "VERSION"]
