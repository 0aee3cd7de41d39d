"""The generic builder of the matrix's vision-language cells (`vlm.py`), without an
engine: a VLM shrunk by the text rule is small in every part, its tokenizer holds the
special tokens its processor and config name, and transformers' own processor and model
take the cell's image prompt through the small vision tower."""

from __future__ import annotations

from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("torchvision")  # the processors' image transforms


def test_a_shrunk_vlm_is_small_in_every_part() -> None:
    from tests.engines.conformance.vlm import shrink_vlm

    config = transformers.Qwen2VLConfig(**shrink_vlm(transformers.Qwen2VLConfig))
    assert config.text_config.hidden_size == 64 and config.text_config.num_hidden_layers == 2
    assert config.vision_config.depth == 2 and config.vision_config.embed_dim == 64
    assert config.vision_config.hidden_size == 64  # the tower's output feeds the text model


def test_the_image_prompt_goes_through_the_small_vision_tower(tmp_path: Path) -> None:
    import torch

    from enginehooks_testkit.engines import synthetic_image
    from tests.engines.conformance.vlm import prompts, vlm_family

    family = vlm_family("Qwen2VLForConditionalGeneration")
    from tests.engines.conformance.families import build

    folder = build(family, "local", tmp_path / "d0")  # no engine: no placeholder lookup
    config = transformers.AutoConfig.from_pretrained(folder)
    processor = transformers.AutoProcessor.from_pretrained(folder)
    tokenizer = processor.tokenizer
    assert config.image_token_id == tokenizer.convert_tokens_to_ids(processor.image_token)
    assert config.image_token_id < config.text_config.vocab_size
    image_prompt = prompts("local", folder)[2]
    text = image_prompt["text"].replace("{image}", image_prompt["placeholder"])
    inputs = processor(text=[text], images=[synthetic_image(0, image_prompt["side"])],
                       return_tensors="pt")
    ids = inputs["input_ids"][0].tolist()
    assert ids.count(config.image_token_id) == 4  # 4 x 4 patches, merged 2 x 2
    assert ids[0] == 5 and ids[-2:] == [6, 7]
    model = transformers.Qwen2VLForConditionalGeneration.from_pretrained(folder)
    with torch.no_grad():  # the small tower embeds the image as the 4 tokens' embeddings
        features = model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
        features = torch.cat(list(getattr(features, "pooler_output", features)))
        assert features.shape == (4, config.text_config.hidden_size)
        assert torch.isfinite(features).all() and features.abs().sum() > 0
