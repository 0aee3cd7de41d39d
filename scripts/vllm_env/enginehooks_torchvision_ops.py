"""Lets torchvision's pure-Python parts import in the vLLM CPU environment.

Installed beside torchvision by `scripts/setup-vllm-env.sh` (never part of the
enginehooks wheel), with a one-line `.pth` that imports this module at interpreter
start. Why: vLLM's vision-language model modules and transformers' fast image
processors import torchvision (its transforms). The only torchvision wheel the package
indexes hold for torch 2.13 (0.28.0) is a CUDA build: its compiled ops (`_C.so`) link
libtorch_cuda, so they cannot load beside the CPU torch, and torchvision then fails at
import, in `_meta_registrations`, which registers a fake kernel for `torchvision::nms`
(and `qnms`) whether or not the ops loaded ("operator torchvision::nms does not exist").

What it does: nothing at start but put a finder on `sys.meta_path` (no torch import, so
no python start is slowed). When `torchvision.extension` is imported and reports that
the compiled ops did not load, it defines the schemas of the two operators that
torchvision's import registers kernels for unconditionally (`nms`, `qnms`), each with a
CPU kernel that raises a clear error. Every other torchvision op is guarded by
torchvision itself (`_has_ops()`), and its Python wrappers (`torchvision.ops.nms`,
`roi_align`, ...) raise torchvision's own "Couldn't load custom C++ ops" error.

So: torchvision's transforms (what image processors use) work; its detection ops
(nms, roi_align, roi_pool, deform_conv2d, ...), which no vision-language model's
processor or vision tower calls, fail with a clear error instead of computing anything.
With a torchvision whose ops load (a CPU build), this module does nothing.
"""

from __future__ import annotations

import sys
from importlib.machinery import ModuleSpec, PathFinder
from typing import Any

#: the operators torchvision's import registers kernels for without checking that its
#: compiled ops loaded (torchvision/_meta_registrations.py: `register_fake`)
SCHEMAS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}
WHY = ("torchvision::{op} has no kernel in this environment: torchvision's compiled ops "
       "(a CUDA build) cannot load beside the CPU torch that vLLM's CPU build pins; only "
       "torchvision's pure-Python parts (transforms) work here "
       "(scripts/vllm_env/enginehooks_torchvision_ops.py)")

_libraries: list[Any] = []  # a torch.library.Library lives as long as it is referenced


def define_schemas() -> None:
    """Define the operators torchvision's import needs, each with a CPU kernel that
    raises (called only when its compiled ops did not load)."""
    import torch

    lib = torch.library.Library("torchvision", "FRAGMENT")
    for op, schema in SCHEMAS.items():
        if hasattr(torch.ops.torchvision, op):
            continue

        def no_kernel(*args: Any, _op: str = op, **kwargs: Any) -> Any:
            raise NotImplementedError(WHY.format(op=_op))

        lib.define(schema)
        lib.impl(op, no_kernel, "CPU")
    _libraries.append(lib)


class _Loader:
    """Runs torchvision.extension, then defines the schemas if its ops did not load."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: ModuleSpec) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        if not module._has_ops():
            define_schemas()

    def __getattr__(self, name: str) -> Any:  # get_resource_reader, is_package, ...
        return getattr(self._loader, name)


class _Finder:
    """Wraps the loader of `torchvision.extension` only; every other import goes on."""

    @staticmethod
    def find_spec(fullname: str, path: Any = None, target: Any = None) -> ModuleSpec | None:
        if fullname != "torchvision.extension":
            return None
        spec = PathFinder.find_spec(fullname, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


def install() -> None:
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


install()
