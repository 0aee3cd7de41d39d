"""CPU-ONLY stand-in for SGLang's kernel package ``sgl_kernel`` (``sglang-kernel``), for the
demo and the tests (shipped with ``enginehooks.demo``: ``enginehooks demo --engine sglang``
starts SGLang on CPU).

Why it exists: the registry has no CPU build of ``sgl_kernel``; the one that installs
with ``sglang`` needs ``libcuda.so.1`` and fails to import on a machine without a GPU.
With ``SGLANG_USE_CPU_ENGINE=1`` SGLang still imports a few of its names (9 at startup
of SGLang 0.5.23), but calls none of them when decoding a small Llama with
``attention_backend="torch_native"``. Putting the folder that holds this package
first on ``PYTHONPATH`` lets the real SGLang engine start on CPU (the demo, the tests).

It is deliberately loud: every attribute is a function that raises ``RuntimeError``
naming itself when called. A code path that really needs a kernel thus
fails the test instead of passing silently. Never put this on a production path.

One exception, in ``torch.ops.sgl_kernel``: four CPU ops that SGLang binds when its
Qwen3.5 model module is imported (which every Qwen-VL-style multimodal processor
imports), implemented in plain torch after SGLang's own references (``_torch_ops.py``,
registered on import): ``fused_sigmoid_mul_cpu``, ``fused_qk_gemma_rmsnorm_cpu``,
``fused_qk_gemma_rmsnorm_with_gate_cpu``,
``fused_qkvzba_split_reshape_cat_contiguous_cpu``. All four compute; none is a
bind-only placeholder. Without them SGLang hides the import error and reports "No
processor registered" for those VLMs.

It has no public submodules on purpose: SGLang imports ``sgl_kernel.<submodule>`` (e.g.
``sgl_kernel.scalar_type``) inside ``try/except ImportError`` with its own fallbacks,
and a stub submodule would defeat those (``scalar_types.uint4b8`` at import time);
``_torch_ops`` is private, a name SGLang never imports. Its AMX CPU path is also off:
``torch.ops.sgl_kernel`` has no ``convert_weight_packed``, the op SGLang probes for it.
"""

# Underscored: every public attribute of this module is a loud stand-in (below).
from collections.abc import Callable as _Callable
from typing import Any as _Any
from typing import NoReturn as _NoReturn

from . import _torch_ops

_torch_ops.register()

#: Names looked up so far in this process (for diagnostics only).
touched: set[str] = set()


def _raiser(qualname: str) -> _Callable[..., _NoReturn]:
    def _missing(*args: _Any, **kwargs: _Any) -> _NoReturn:
        raise RuntimeError(
            f"{qualname} was called, but sgl_kernel here is the CPU-only stub "
            "(enginehooks/demo/sgl_kernel_stub): no real SGLang kernel is available on CPU"
        )

    _missing.__name__ = qualname.rsplit(".", 1)[-1]
    _missing.__qualname__ = qualname
    return _missing


def _make_getattr(modname: str) -> _Callable[[str], _Callable[..., _NoReturn]]:
    def __getattr__(name: str) -> _Callable[..., _NoReturn]:
        if name.startswith("__"):  # keep Python's own protocol probes honest
            raise AttributeError(name)
        qualname = f"{modname}.{name}"
        touched.add(qualname)
        return _raiser(qualname)

    return __getattr__


__getattr__ = _make_getattr(__name__)
