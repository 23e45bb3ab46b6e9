"""kimi_hf_kernels: Triton kernels behind kimi_hf.ops (CUDA; CPU only under TRITON_INTERPRET=1).

Installed from the repository's top-level `kernels/` folder under this name, never as a top-level
`kernels` module (that name belongs to Hugging Face's `kernels` package, which transformers imports).

Where the repository's root is on sys.path ahead of site-packages (pytest's rootdir, PYTHONPATH=., `python -c` in
the checkout), `import kernels` finds this folder first; it then hands the import over to the installed Hugging Face
package when one is installed (transformers >= 5.25 depends on it and imports it at start-up; 5.24 imports it when
installed), and stays this docstring-only module when none is.
"""

if __name__ == "kernels":  # imported as the top-level `kernels`, not as kimi_hf_kernels
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _elsewhere = [p for p in sys.path if os.path.abspath(p or os.curdir) != _root]
    _spec = importlib.machinery.PathFinder.find_spec("kernels", _elsewhere)
    # without it, this module stays what the import found: no version, so transformers reads the package as absent
    if _spec is not None:
        _module = importlib.util.module_from_spec(_spec)
        sys.modules["kernels"] = _module  # the import statement returns what sys.modules holds once this file ran
        _spec.loader.exec_module(_module)
