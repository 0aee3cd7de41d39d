"""A vision-language model pushed into a real SGLang engine, with image prompts (issue 39
item 1): a tiny PaliGemma built from its transformers config, served by SGLang's
Transformers backend (the one SGLang VLM that serves images on CPU with the `sgl_kernel`
stand-in). The same image is asked before and after each push; after it, the answer
(tokens and logprobs) equals SGLang freshly started on the pushed weights. Two pushes:
the vision tower alone changed (the image answer must move, and equal the fresh load),
then the language model changed with the tower kept (`keep=`: a frozen tower).

Starts three engines (minutes on 2 cores): outside CI, run with ENGINEHOOKS_VLM_CELLS=1
(`scripts/run.sh sglang python -m pytest tests/sglang/test_vlm_push.py`); the result is
recorded in docs/sglang.md.
"""

from __future__ import annotations

import base64
import io
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from enginehooks import WeightSync
from enginehooks_testkit.engines import SGLangInProcess

pytestmark = pytest.mark.skipif(os.environ.get("ENGINEHOOKS_VLM_CELLS") != "1",
                                reason="starts three SGLang engines: ENGINEHOOKS_VLM_CELLS=1")

PROMPT = "<image> w5 w6 w7"
PROCESSOR_FILES = ("processor_config.json", "tokenizer.json", "tokenizer_config.json")


def build_paligemma(folder: Path) -> Path:
    """The matrix's tiny PaliGemma, with a tokenizer whose id 255 is `<image>` (the
    config's image token) and a PaliGemma processor (SigLIP image processor, 4 image
    tokens for a 28x28 image in 14x14 patches)."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    from enginehooks_testkit.tiny import save_tiny
    from tests.engines.conformance.families import FAMILIES

    family = FAMILIES["paligemma"]
    config = getattr(transformers, family.config)(**family.config_kwargs("sglang"))
    save_tiny(folder, config, model_class=family.model_class, seed=0)
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    vocab.update({f"w{i}": i for i in range(4, 255)})
    vocab["<image>"] = 255
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                                                pad_token="<pad>", bos_token="<s>",
                                                eos_token="</s>")
    images = transformers.SiglipImageProcessor(size={"height": 28, "width": 28})
    images.image_seq_length = 4
    processor = transformers.PaliGemmaProcessor(image_processor=images, tokenizer=fast)
    assert processor.image_token_id == 255
    processor.save_pretrained(folder)
    return folder


def image_url(seed: int) -> str:
    import numpy as np
    from PIL import Image

    pixels = (np.random.default_rng(seed).random((28, 28, 3)) * 255).astype("uint8")
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def ask(engine: SGLangInProcess, image: str) -> tuple[list[int], list[float]]:
    sp = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}
    out = engine.engine_obj.generate(prompt=PROMPT, image_data=image, sampling_params=sp,
                                     return_logprob=True)
    return list(out["output_ids"]), [float(x[0]) for x in out["meta_info"]["output_token_logprobs"]]


def fresh(model: Any, base: Path, folder: Path, image: str) -> tuple[list[int], list[float]]:
    model.save_pretrained(folder)
    for name in PROCESSOR_FILES:
        shutil.copy(base / name, folder / name)
    engine = SGLangInProcess(folder)
    try:
        return ask(engine, image)
    finally:
        engine.close()


def perturb_under(model: Any, prefix: str, seed: int) -> Any:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if name.startswith(prefix) and t.is_floating_point():
                t.add_(torch.randn(t.shape, generator=g) * 0.3)
    return model


def test_a_vlm_push_answers_the_same_image_as_a_fresh_load(tmp_path: Path) -> None:
    import transformers

    base = build_paligemma(tmp_path / "base")
    trainer = transformers.PaliGemmaForConditionalGeneration.from_pretrained(
        base, dtype=torch.float32)
    tower = "model.vision_tower"
    assert any(n.startswith(tower + ".") for n in trainer.state_dict())
    image = image_url(7)
    engine = SGLangInProcess(base)
    try:
        before = ask(engine, image)
        assert ask(engine, image) == before  # the same image, answered the same
        with WeightSync("gloo", bucket_bytes=64 << 10, timeout_s=300, pause=True,
                        verify=True) as sync:
            sync.add_replica(engine.handle("sglang-vlm"))
            perturb_under(trainer, tower, seed=1)  # the vision tower alone changes
            sync.push(trainer, version="tower")
            after_tower = ask(engine, image)
            perturb_under(trainer, "model.language_model", seed=2)
            frozen = {n: t.clone() for n, t in trainer.state_dict().items()
                      if n.startswith(tower + ".")}
            perturb_under(trainer, tower, seed=3)  # the trainer's copy drifts; not sent
            # `keep` names checkpoint modules: this checkpoint's tower is `vision_tower`
            report = sync.push(trainer, version="lm", keep=["vision_tower"])
            after_lm = ask(engine, image)
        info = engine.handle().info(60)[0]
    finally:
        engine.close()
    assert after_tower[0] != before[0] or after_tower[1] != before[1]
    assert report.tensors < len(trainer.state_dict())
    assert info["verification"]["last"]["ok"] is True, info["verification"]
    # what SGLang answers freshly started on those weights
    trainer.load_state_dict(frozen, strict=False)  # the tower the engine kept
    assert after_lm == fresh(trainer, base, tmp_path / "lm", image)
