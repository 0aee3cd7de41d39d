"""What the generated matrix's VLM cells ask SGLang (tests/engines/conformance/vlm.py),
without starting an engine: which architectures are image-capable VLMs, and how SGLang
spells one image in a prompt (read from its own multimodal processors, which import only
with the `sgl_kernel` stand-in's ops)."""

from __future__ import annotations

import pytest

pytest.importorskip("sglang")


def test_sglangs_image_capable_vlms_are_the_cells() -> None:
    from tests.engines.conformance.vlm import registered_vlms

    archs = registered_vlms("sglang")
    # the Qwen-VL family imports only with the stand-in's ops (issue 39: "No processor
    # registered" before them)
    assert {"Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration",
            "Mistral3ForConditionalGeneration", "Gemma3ForConditionalGeneration"} <= set(archs)
    # not generative (CLIP) or without a vision part (audio-only models have a processor)
    assert not {"CLIPModel", "Qwen2AudioForConditionalGeneration",
                "WhisperForConditionalGeneration"} & set(archs)


def test_sglangs_image_placeholder_is_read_from_its_processor() -> None:
    from tests.engines.conformance.vlm import placeholder_tokens, sglang_image_token

    qwen = "Qwen2VLForConditionalGeneration"
    assert sglang_image_token(qwen) == "<|vision_start|><|image_pad|><|vision_end|>"
    assert placeholder_tokens("sglang", qwen) == {
        "vision_start": "<|vision_start|>", "image_pad": "<|image_pad|>",
        "vision_end": "<|vision_end|>"}
    # a literal past a comment in the constructor's call
    assert sglang_image_token("Gemma3ForConditionalGeneration") == "<start_of_image>"
    # an attribute of the processor (`self.IMAGE_TOKEN = "<image>"`)
    assert sglang_image_token("Lfm2VlForConditionalGeneration") == "<image>"
    # taken from the checkpoint's processor: the cell then writes that one's token
    assert sglang_image_token("LlavaForConditionalGeneration") is None
