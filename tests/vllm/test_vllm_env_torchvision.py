"""The vLLM environment carries torchvision (issue 39 item 2): vLLM's vision-language
model modules and transformers' image processors import it.

The only torchvision wheel for this torch is a CUDA build whose compiled ops cannot load
beside CPU torch; `scripts/vllm_env/enginehooks_torchvision_ops.py` (installed by
`scripts/setup-vllm-env.sh`) lets its import go on. Checked here: torchvision imports,
its transforms compute, vLLM's VLM modules import, and its detection ops fail with a
clear error instead of computing anything.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.vllm]


def test_torchvision_transforms_work_here() -> None:
    import torchvision
    from torchvision.transforms.v2 import functional as F

    image = torch.arange(3 * 8 * 8, dtype=torch.float32).reshape(3, 8, 8)
    small = F.resize(image, [4, 4], antialias=False)
    assert small.shape == (3, 4, 4)
    assert torchvision.__version__.startswith("0.28.")


def test_vllm_imports_its_vision_language_models() -> None:
    import importlib

    for name in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "gemma3_mm", "llava", "mistral3"):
        importlib.import_module(f"vllm.model_executor.models.{name}")


def test_detection_ops_fail_clearly_where_they_cannot_load() -> None:
    import torchvision

    if torchvision.extension._has_ops():
        pytest.skip("torchvision's compiled ops load here (a CPU build): nothing stands in")
    boxes, scores = torch.tensor([[0.0, 0.0, 1.0, 1.0]]), torch.tensor([1.0])
    with pytest.raises(NotImplementedError, match="no kernel in this environment"):
        torch.ops.torchvision.nms(boxes, scores, 0.5)
    with pytest.raises(RuntimeError, match="Couldn't load custom C\\+\\+ ops"):
        torchvision.ops.nms(boxes, scores, 0.5)
