"""transformers' own common test mixins (ModelTesterMixin, ConfigTester, TensorParallelTesterMixin, ...),
fetched from the sdist of the installed transformers version and importable under a package name of
their own.

    load() -> types.ModuleType   the package; its modules: load().test_modeling_common, ...

Fetching: `pip download --no-deps --no-binary :all: transformers==<installed version>` (the sdist,
about 10 MB; pip prepares its metadata, about 10 s in all), of which only `tests/*.py` (about 1 MB) is
kept, in `<cache>/transformers-<version>-tests/` (cache: $KIMI_HF_CACHE, else $XDG_CACHE_HOME/kimi_hf,
else ~/.cache/kimi_hf). It is extracted once: under an exclusive file lock, into a temporary folder
beside it, then renamed into place, so parallel runs neither download twice nor see a half-written
folder. The sdist's PKG-INFO must name the installed version. `FetchError` is raised only when the
download itself fails (no network, pip refuses): the caller skips then; anything else is an error.

Importing: the files import `transformers.testing_utils` (installed) and each other relatively
(`from .test_configuration_common import ...`), as transformers' `tests` package. Here they become the
package `_kimi_hf_transformers_tests` (a module object with `__path__` = the cached folder, put in
`sys.modules`), so they never collide with this repo's own `tests` package, and pytest never collects
them (they lie outside the repo and only mixins, not `Test*` classes, are imported from them).

What the sdist does not ship: transformers' sdist carries the top-level `tests/*.py` only, not the
sub-packages they import (`tests/generation/test_utils.py`, `tests/exporters/test_export.py`,
`tests/utils/test_configuration_utils.py`, `tests/distributed_testing_utils.py`), nor
`tests/causal_lm_tester.py`, `tests/vlm_tester.py` and `tests/models/`. For the first four, this module
installs substitutes written here (each only where the sdist lacks the file):

    generation.test_utils.GenerationTesterMixin   an empty class (no generate tests; only
                                                  `test_generation_tester_mixin_inheritance` names it)
    exporters.test_export.ExportTesterMixin       an empty base class of ModelTesterMixin (no export tests)
    utils.test_configuration_utils.config_common_kwargs
                                                  non-default values of PreTrainedConfig's own fields
    distributed_testing_utils.run_distributed     spawns `world_size` CPU processes on gloo
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.machinery
import os
import subprocess
import sys
import tarfile
import tempfile
import types
from pathlib import Path

import transformers


PACKAGE = "_kimi_hf_transformers_tests"
VERSION = transformers.__version__
MARKER = ".kimi_hf_complete"  # written last into the staged folder


class FetchError(RuntimeError):
    """The sdist could not be downloaded (no network, or pip failed)."""


def cache_root() -> Path:
    if os.environ.get("KIMI_HF_CACHE"):
        return Path(os.environ["KIMI_HF_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kimi_hf"


def tests_dir(version: str = VERSION) -> Path:
    return cache_root() / f"transformers-{version}-tests"


@contextlib.contextmanager
def _locked(path: Path):
    try:
        import fcntl
    except ImportError:  # not POSIX: the atomic rename alone keeps the folder whole
        yield
        return
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _download_sdist(version: str, into: Path) -> Path:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--no-binary",
        ":all:",
        "--disable-pip-version-check",
        "-q",
        "-d",
        str(into),
        f"transformers=={version}",
    ]
    try:
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise FetchError(f"`{' '.join(cmd)}` could not run: {e}") from e
    tarballs = sorted(into.glob(f"transformers-{version}.tar.gz"))
    if proc.returncode or not tarballs:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
        raise FetchError(f"`pip download` of the transformers {version} sdist failed (exit {proc.returncode}): {tail}")
    return tarballs[0]


def _extract_tests(tarball: Path, version: str, into: Path) -> None:
    """Extracts the sdist's tests/**.py into `into` (checks the version in PKG-INFO)."""
    top = f"transformers-{version}/"
    with tarfile.open(tarball) as tar:
        info = tar.extractfile(top + "PKG-INFO")
        meta = info.read().decode() if info else ""
        if f"\nVersion: {version}\n" not in meta:
            raise RuntimeError(f"{tarball.name}: PKG-INFO does not name version {version}")
        members = [
            m
            for m in tar.getmembers()
            if m.name.startswith(top + "tests/") and m.isfile() and m.name.endswith((".py", ".json"))
        ]
        if not any(m.name == top + "tests/test_modeling_common.py" for m in members):
            raise RuntimeError(f"{tarball.name} has no tests/test_modeling_common.py")
        for m in members:
            rel = Path(m.name[len(top + "tests/") :])
            if rel.is_absolute() or ".." in rel.parts:
                raise RuntimeError(f"{tarball.name}: unsafe member {m.name}")
            dest = into / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(tar.extractfile(m).read())
    # transformers' repo has an empty tests/__init__.py, which the sdist lacks: test_configuration_common runs
    # `direct_transformers_import(Path(__file__).parent)`, which executes it
    init = into / "__init__.py"
    if not init.exists():
        init.write_text("")
    (into / MARKER).write_text(f"transformers {version} tests, from its sdist\n")


def fetch(version: str = VERSION) -> Path:
    """The folder holding transformers `version`'s tests/ (downloaded and extracted on first use)."""
    final = tests_dir(version)
    if (final / MARKER).is_file():
        return final
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root / f"transformers-{version}-tests.lock"):
        if (final / MARKER).is_file():  # another process finished it meanwhile
            return final
        with tempfile.TemporaryDirectory(dir=root, prefix=f".transformers-{version}-") as tmp:
            tmp = Path(tmp)
            tarball = _download_sdist(version, tmp / "sdist")
            staged = tmp / "tests"
            _extract_tests(tarball, version, staged)
            if final.exists():  # left by an older layout of this cache (no marker): replace it
                final.rename(tmp / "stale")
            os.replace(staged, final)  # atomic: the folder appears whole or not at all
    return final


# ---------------------------------------------------------------------------------------------------
# Substitutes for the modules the sdist's tests import but the sdist does not ship
# ---------------------------------------------------------------------------------------------------


class GenerationTesterMixin:
    """Stands in for tests/generation/test_utils.py's mixin, which the sdist lacks: no generate tests."""


class ExportTesterMixin:
    """Stands in for tests/exporters/test_export.py's mixin (ModelTesterMixin's base class): no export tests."""


# A value other than PreTrainedConfig's default for each of its own (model-independent) fields in
# transformers 5.x: ConfigTester.check_config_arguments_init passes them and checks they stick.
config_common_kwargs = {
    "return_dict": False,
    "output_hidden_states": True,
    "output_attentions": True,
    "dtype": "float16",
    "chunk_size_feed_forward": 5,
    "architectures": ["KimiHybridForCausalLM"],
    "id2label": {0: "a", 1: "b"},
    "label2id": {"a": 0, "b": 1},
    "problem_type": "single_label_classification",
}


def _find_free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _distributed_worker(rank: int, world_size: int, port: int, module: str, name: str, payload: bytes) -> None:
    """One rank (a spawned process): registers the package again, joins a gloo group, runs module.name(rank, *args).
    The arguments come pickled, to be unpickled only after fla is hidden (they may name transformers' model classes,
    whose modules look for fla on import)."""
    sys.modules.setdefault("fla", None)  # as in tests/conftest.py: fla's Triton kernels crash on CPU
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    import pickle

    import torch.distributed as dist

    import kimi_hf  # noqa: F401  (registers our model types in this process too)

    load()
    fn = getattr(importlib.import_module(module), name)
    args = pickle.loads(payload)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        fn(rank, *args)
    finally:
        dist.destroy_process_group()


def run_distributed(world_size: int = 2):
    """`run_distributed(world_size)(fn)(*args)` runs fn(rank, *args) in `world_size` fresh processes (a gloo
    group on localhost) and raises if any rank fails. fn must be a module-level function."""

    def decorator(fn):
        def runner(*args):
            import pickle

            import torch.multiprocessing as mp

            mp.spawn(
                _distributed_worker,
                nprocs=world_size,
                join=True,
                args=(world_size, _find_free_port(), fn.__module__, fn.__qualname__, pickle.dumps(args)),
            )

        return runner

    return decorator


def _module(name: str, **attrs) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    return mod


def _install_substitutes(pkg: types.ModuleType, root: Path) -> None:
    substitutes = {
        "generation.test_utils": {"GenerationTesterMixin": GenerationTesterMixin},
        "exporters.test_export": {"ExportTesterMixin": ExportTesterMixin},
        "utils.test_configuration_utils": {"config_common_kwargs": config_common_kwargs},
        "distributed_testing_utils": {"run_distributed": run_distributed},
    }
    for dotted, attrs in substitutes.items():
        if (root / (dotted.replace(".", "/") + ".py")).is_file():
            continue  # a later sdist ships it: use the real one
        parent = pkg
        parts = dotted.split(".")
        for i, part in enumerate(parts):
            full = f"{PACKAGE}.{'.'.join(parts[: i + 1])}"
            if full not in sys.modules:
                last = i == len(parts) - 1
                mod = _module(full, **(attrs if last else {}))
                if not last:
                    mod.__path__ = [str(root / Path(*parts[: i + 1]))]
                sys.modules[full] = mod
                setattr(parent, part, mod)
            parent = sys.modules[full]


def load(version: str = VERSION) -> types.ModuleType:
    """The sdist's tests as the package `_kimi_hf_transformers_tests` (fetching them first if needed).
    Raises FetchError when the download is impossible."""
    if PACKAGE in sys.modules:
        return sys.modules[PACKAGE]
    root = fetch(version)
    pkg = _module(PACKAGE, __path__=[str(root)], __file__=str(root / "__init__.py"), __package__=PACKAGE)
    pkg.__spec__ = importlib.machinery.ModuleSpec(PACKAGE, None, is_package=True)
    pkg.__spec__.submodule_search_locations = [str(root)]
    sys.modules[PACKAGE] = pkg
    try:
        _install_substitutes(pkg, root)
        for name in (
            "test_configuration_common",
            "test_modeling_common",
            "test_tensor_parallel_mixin",
            "test_expert_parallel_mixin",
            "test_training_mixin",
        ):
            setattr(pkg, name, importlib.import_module(f"{PACKAGE}.{name}"))
    except BaseException:
        for key in [k for k in sys.modules if k == PACKAGE or k.startswith(PACKAGE + ".")]:
            del sys.modules[key]
        raise
    return pkg
