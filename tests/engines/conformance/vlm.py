"""Vision-language cells of the generated matrix (issue 39 item 2): every image-capable
multimodal architecture an engine registers that transformers can build small.

The same rule as the text cells (`generated.py`), applied to each part: the composite
config's default is shrunk field by field (`SMALL`), its text config as a text model,
every other sub-config (the vision tower) by `SMALL` plus the vision towers' own size
fields (`VISION_SMALL`), the tower's input image to 4 x 4 patches. Nothing is written
per architecture. What an engine needs beside the weights is built the same generic way
from transformers' own classes for the model type: the image processor (its sizes cut
to the small image), the processor, and the word-level test tokenizer with every special
token the processor names (`image_token`, `boi_token`, ...) at the top of the
vocabulary; each `<x>_token_id` / `<x>_token_index` of the config then points at its
token (a config id with no processor token gets a token `<x>` of its own).

A VLM cell prompts with text alone and with a small synthetic image (`PROMPTS`), so the
oracle's repeated prompts after each push send the same image again: an engine that
answers it from an encoder cache filled by the old vision tower fails the cell.
"""

from __future__ import annotations

import inspect
import os
import re
import sys
from pathlib import Path
from typing import Any

from tests.engines.conformance.families import Family
from tests.engines.conformance.generated import SMALL, _shrink

#: a vision tower's size fields beyond the text ones (set only where the config has them)
VISION_SMALL: dict[str, Any] = dict(SMALL, depth=2, embed_dim=64, num_heads=2,
                                    out_hidden_size=64, projection_dim=64,
                                    mm_tokens_per_image=4, vision_output_dim=64)
#: the small image is this many patches on a side
PATCHES = 4


def prompts(engine: str, folder: Path) -> list[Any]:
    """Prompts of a VLM cell: text ids (as the text cells), then text with a small image
    (`{image}` becomes the placeholder for one image, `image_placeholder`; the image is
    drawn from its seed, the same every time: `enginehooks_testkit.engines.synthetic_image`)."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(folder)
    side, placeholder = image_side(config), image_placeholder(engine, folder)
    return [[5, 6, 7, 8], [10, 11, 12],
            {"text": "w5 {image} w6 w7", "image": 0, "side": side, "placeholder": placeholder},
            {"text": "w10 w11 {image} w12", "image": 1, "side": side,
             "placeholder": placeholder}]


def image_placeholder(engine: str, folder: Path) -> str | None:
    """What a prompt writes for one image: the engine's placeholder where the tokenizer
    holds each of its special tokens (None: the driver asks the engine), else the
    processor's own `image_token` (the generic tokenizer spells a token the engine
    calls `<start_of_image>` by its processor name, `<boi>`)."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(folder)
    arch = (config.architectures or [""])[0]
    wanted = placeholder_tokens(engine, arch)
    vocab = transformers.AutoTokenizer.from_pretrained(folder).get_vocab()
    if wanted and all(t in vocab for t in wanted.values()):
        # vLLM's driver asks vLLM; SGLang's has no such question: its spelling here
        return None if engine == "vllm" else engine_placeholder(engine, arch)
    processor = transformers.AutoProcessor.from_pretrained(folder)
    return getattr(processor, "image_token", None)


_TOKEN_FIELD = re.compile(r"^(\w+)_token_(?:id|index)$")


def is_vlm(config_class: type) -> bool:
    """A composite config with a text part and a vision part (not encoder-decoder)."""
    subs = getattr(config_class, "sub_configs", None) or {}
    return "text_config" in subs and "vision_config" in subs


def shrink_vlm(config_class: type) -> dict[str, Any]:
    """Keyword arguments that build the VLM config small (see the module docstring)."""
    default = config_class()
    kwargs = _shrink(default, config_class, None, VISION_SMALL)
    for name in config_class.sub_configs:
        sub = getattr(default, name, None)
        if sub is None or not hasattr(sub, "to_dict"):
            continue
        small = _shrink(sub, type(sub), None, SMALL if name == "text_config" else VISION_SMALL)
        if name == "text_config":
            _shrink_mrope(sub, small)
        patch, size = _first(getattr(sub, "patch_size", None)), getattr(sub, "image_size", None)
        if isinstance(patch, int) and isinstance(size, int):
            small["image_size"] = PATCHES * patch
        elif isinstance(patch, int) and isinstance(size, list | tuple):  # [height, width]
            small["image_size"] = [PATCHES * patch] * len(size)
        kwargs[name] = dict(sub.to_dict(), **small)
    return kwargs


def _shrink_mrope(default: Any, small: dict[str, Any]) -> None:
    """Multimodal rope (Qwen-VL style) splits each head's rotary half into sections,
    which must add up to it: cut them in proportion to the smaller head."""
    for key in ("rope_parameters", "rope_scaling"):
        rope = getattr(default, key, None)
        if not isinstance(rope, dict) or not isinstance(rope.get("mrope_section"), list):
            continue
        sections = rope["mrope_section"]
        head = small.get("head_dim") or (small.get("hidden_size", 64)
                                         // small.get("num_attention_heads", 2))
        half, total = head // 2, sum(sections)
        cut = [max(1, s * half // total) for s in sections]
        cut[-1] += half - sum(cut)
        small[key] = dict(rope, mrope_section=cut)


def _first(value: Any) -> Any:
    """A size given per axis (`[14, 14]`) as one number."""
    return value[0] if isinstance(value, list | tuple) and value else value


def image_side(config: Any) -> int:
    """The synthetic image's side: `PATCHES` patches of the vision tower."""
    patch = _first(getattr(config.vision_config, "patch_size", 14))
    return PATCHES * (patch if isinstance(patch, int) else 14)


def _small_size(size: Any, side: int) -> dict[str, int] | None:
    """An image processor's `size` cut to the small image: heights and widths to `side`;
    `shortest_edge` / `longest_edge` to `side` or, where they count pixels (Qwen-style,
    a longest edge above 100,000), to `side * side`."""
    have = {k: v for k, v in dict(size).items() if isinstance(v, int)}
    if not have:
        return None
    area = have.get("longest_edge", 0) > 100_000
    return {k: (side * side if area and k.endswith("_edge") else side) for k in have}


def _sub_processor(kind: str, model_type: str, side: int, vision: Any) -> Any:
    import transformers
    from transformers.models.auto.image_processing_auto import IMAGE_PROCESSOR_MAPPING_NAMES
    from transformers.models.auto.video_processing_auto import VIDEO_PROCESSOR_MAPPING_NAMES

    table = IMAGE_PROCESSOR_MAPPING_NAMES if kind == "image" else VIDEO_PROCESSOR_MAPPING_NAMES
    names = table.get(model_type)
    if isinstance(names, dict):
        names = [names.get("torchvision"), names.get("pil")]
    elif isinstance(names, str | type(None)):
        names = [names]
    name = next((n for n in names if n and getattr(transformers, n, None)), None)
    if name is None:
        raise LookupError(f"transformers has no {kind} processor for {model_type}")
    cls = getattr(transformers, name)
    default = cls()
    kwargs: dict[str, Any] = {}
    for key in ("size", "crop_size", "max_image_size"):
        small = _small_size(getattr(default, key, None) or {}, side)
        if small:
            kwargs[key] = small
    for key in ("min_pixels", "max_pixels"):
        if isinstance(getattr(default, key, None), int):
            kwargs[key] = side * side
    # the patches it cuts are the tower's (Qwen3-VL's tower takes 16-pixel patches, its
    # image processor's default is 14)
    for key in ("patch_size", "temporal_patch_size"):
        ours, tower = getattr(default, key, None), _first(getattr(vision, key, None))
        if isinstance(ours, int) and isinstance(tower, int):
            kwargs[key] = tower
    return cls(**kwargs)


def _processor_tokens(processor: Any) -> dict[str, str]:
    """The special tokens a processor names: attribute prefix -> token string."""
    out = {}
    for attr in dir(processor):
        if attr.endswith("_token") and not attr.startswith("_"):
            value = getattr(processor, attr, None)
            if isinstance(value, str) and value:
                out[attr[: -len("_token")]] = value
    return out


def _tokenizer(vocab_size: int, specials: dict[str, str]) -> Any:
    """The word-level test tokenizer (`w<i>` is id i) with the special tokens as the top
    ids, each also an attribute by its name (`tokenizer.image_token`: some processors
    read their tokens from the tokenizer)."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens = list(dict.fromkeys(specials.values()))
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for i in range(len(vocab), vocab_size - len(tokens)):
        vocab[f"w{i}"] = i
    for i, tok in enumerate(tokens):
        vocab[tok] = vocab_size - len(tokens) + i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in tokens])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", bos_token="<s>",
        eos_token="</s>", extra_special_tokens={f"{n}_token": t for n, t in specials.items()})


_MISSING_TOKEN = re.compile(r"has no attribute '?(\w+)_token'?")


def _processor_for(config: Any, specials: dict[str, str]) -> tuple[Any, dict[str, str]]:
    """The processor over a tokenizer holding `specials`, and the special tokens it
    needs: a processor that reads a token the tokenizer lacks (`tokenizer.image_token`)
    gets a token `<name>` of that name, until it builds."""
    specials = dict(specials)
    for _ in range(8):
        vocab = config.get_text_config().vocab_size
        try:
            return _processor(config, _tokenizer(vocab, specials)), specials
        except AttributeError as e:
            m = _MISSING_TOKEN.search(str(e))
            if m is None or m.group(1) in specials:
                raise
            specials[m.group(1)] = f"<{m.group(1)}>"
    raise LookupError(f"the processor of {config.model_type} keeps asking for tokens")


def _processor(config: Any, tokenizer: Any) -> Any:
    import transformers
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    name = PROCESSOR_MAPPING_NAMES.get(config.model_type)
    cls = getattr(transformers, name, None) if name else None
    if cls is None:
        raise LookupError(f"transformers has no processor for {config.model_type}")
    side = image_side(config)
    parts: dict[str, Any] = {"tokenizer": tokenizer}
    for attr in cls.get_attributes():
        if attr in ("image_processor", "video_processor"):
            parts[attr] = _sub_processor(attr.split("_")[0], config.model_type, side,
                                         config.vision_config)
    params = inspect.signature(cls.__init__).parameters
    vision = config.vision_config
    patch = getattr(vision, "patch_size", None)
    for p in params:
        if p in parts or p in ("self", "chat_template", "kwargs"):
            continue
        if p in ("image_seq_length", "num_image_tokens"):
            parts[p] = getattr(config, "mm_tokens_per_image", None) or PATCHES * PATCHES
        elif p == "patch_size" and isinstance(patch, int):
            parts[p] = patch
        elif hasattr(config, p) and not p.endswith("_token"):
            parts[p] = getattr(config, p)
    return cls(**parts)


#: a special token in an engine's image placeholder: `<|vision_start|>`, `<image>`, `[IMG]`
_SPECIAL = re.compile(r"<\|?[A-Za-z_]+\|?>|\[[A-Z_]+\]")


def placeholder_tokens(engine: str, arch: str) -> dict[str, str]:
    """The special tokens of the engine's placeholder for one image, by bare name
    (`<|vision_start|>` -> `vision_start`), which the tokenizer must hold whole."""
    text = engine_placeholder(engine, arch) or ""
    return {t.strip("<|>[]").lower(): t for t in _SPECIAL.findall(text)}


def engine_placeholder(engine: str, arch: str) -> str | None:
    """What the engine expects in a prompt's text for one image, by its own word: vLLM's
    model class says it (`get_placeholder_str`); SGLang's multimodal processor for the
    architecture declares it as the `image_token` of its `MultimodalSpecialTokens`
    (`sglang_image_token`). None: the engine names none (it places the image itself,
    or reads the token from the checkpoint's processor)."""
    if engine == "vllm":
        from vllm.model_executor.models.registry import ModelRegistry

        model_cls = ModelRegistry._try_load_model_cls(arch)
        return model_cls.get_placeholder_str("image", 1) if model_cls is not None else None
    if engine == "sglang":
        return sglang_image_token(arch)
    return None


_IMAGE_TOKEN_ARG = re.compile(  # the first `image_token=` argument, past comments
    r'MultimodalSpecialTokens\((?:\s|#[^\n]*)*image_token\s*=\s*(?:"([^"]+)"|self\.(\w+))')


def sglang_image_token(arch: str) -> str | None:
    """The image token SGLang's processor for `arch` splits prompts on. SGLang states it
    only in the processor's constructor (`MultimodalSpecialTokens(image_token=...)`),
    which needs a running engine's context, so it is read from that constructor's source:
    a string literal, or an attribute of the processor set to one (`self.IMAGE_TOKEN =
    "<|image|>"`). None where it comes from the checkpoint (`_processor.image_token`,
    the tokenizer): the checkpoint's own processor token is then the right spelling."""
    import inspect

    cls = _sglang_processors().get(arch)
    if cls is None:
        return None
    for klass in type.mro(cls):
        if not klass.__module__.startswith("sglang.srt.multimodal.processors"):
            continue
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        m = _IMAGE_TOKEN_ARG.search(source)
        if m is None:
            continue
        if m.group(1):
            return m.group(1)
        value = getattr(klass, m.group(2), None)
        if isinstance(value, str):
            return value
        attr = re.search(rf'\b{m.group(2)}\s*=\s*"([^"]+)"', source)
        return attr.group(1) if attr else None
    return None


def _sglang_processors() -> dict[str, type]:
    """Architecture -> SGLang's multimodal processor class for it (as SGLang's tokenizer
    manager imports them; the `sgl_kernel` stand-in must be importable)."""
    from enginehooks.demo.servers import cpu_env

    env = cpu_env()  # the stand-in for the kernels the processors' modules bind
    os.environ.update({k: env[k] for k in ("SGLANG_USE_CPU_ENGINE", "PYTHONPATH") if k in env})
    for p in reversed(env.get("PYTHONPATH", "").split(os.pathsep)):
        if p and p not in sys.path:
            sys.path.insert(0, p)
    from sglang.srt.managers.multimodal_processor import PROCESSOR_MAPPING, import_processors

    if not PROCESSOR_MAPPING:
        import_processors("sglang.srt.multimodal.processors")
    return {model_cls.__name__: proc for model_cls, proc in PROCESSOR_MAPPING.items()}


def build_vlm(family: Family, engine: str, folder: Path, seed: int = 0) -> Path:
    """Write `family`'s small checkpoint with its processor and tokenizer into `folder`."""
    import transformers

    from enginehooks_testkit.tiny import save_tiny

    config_cls = getattr(transformers, family.config)
    config = config_cls(**family.kwargs)
    text = config.get_text_config()
    # first pass: which special tokens the processor names (and reads from the tokenizer)
    processor, asked = _processor_for(config, {})
    # what the processor reads from the tokenizer wins over its own attributes (Gemma 3's
    # processor calls its begin-of-image token `image_token`, the tokenizer's is the soft one)
    names = dict(_processor_tokens(processor), **asked)
    fields = {m.group(1): f for f in config.to_dict() if (m := _TOKEN_FIELD.match(f))
              and f not in ("bos_token_id", "eos_token_id", "pad_token_id")}
    # the engine's own spelling of a token the config names (`<|vision_start|>`)
    for name, tok in placeholder_tokens(engine, family.model_class or "").items():
        if name in fields and name not in names:
            names[name] = tok
    for prefix in fields:
        names.setdefault(prefix, f"<{prefix}>")
    processor, names = _processor_for(config, names)
    tokenizer = processor.tokenizer
    for prefix, field in fields.items():
        setattr(config, field, tokenizer.convert_tokens_to_ids(names[prefix]))
        if hasattr(text, field):
            setattr(text, field, getattr(config, field))
    out = save_tiny(folder, config, model_class=family.model_class, seed=seed)
    processor.save_pretrained(out)
    return out


def vlm_family(arch: str) -> Family:
    """The `gen:<arch>` family of a VLM architecture (raises `LookupError` when
    transformers cannot build it, or its processor, small)."""
    import torch
    import transformers

    cls = getattr(transformers, arch)
    config_class = cls.config_class
    kwargs = shrink_vlm(config_class)
    try:
        config = config_class(**kwargs)
        with torch.device("meta"):
            cls._from_config(config)
        _processor_for(config, {})
    except Exception as e:
        raise LookupError(f"transformers cannot build {arch} small: {type(e).__name__}: "
                          f"{str(e).splitlines()[0][:300] if str(e) else ''}") from e
    return Family(f"gen:{arch}", config_class.__name__, kwargs, model_class=arch,
                  tags=("generated", "vision-language"))


def registered_vlms(engine: str) -> list[str]:
    """Image-capable multimodal architectures `engine` registers that transformers has a
    class (vLLM: its model class names a placeholder for an image, or answers None, as
    an engine that places the image itself does, for a config with a vision part; it
    raises for a model without images)."""
    import transformers

    if engine == "sglang":
        return _sglang_vlms()
    if engine != "vllm":
        return []
    from vllm.model_executor.models.registry import _MULTIMODAL_MODELS, ModelRegistry

    out = []
    for arch in sorted(_MULTIMODAL_MODELS):
        cls = getattr(transformers, arch, None)
        if cls is None:
            continue
        try:
            model_cls = ModelRegistry._try_load_model_cls(arch)
            # None: the engine places the image itself, or (audio models) has none
            if model_cls is not None and (model_cls.get_placeholder_str("image", 1)
                                          or is_vlm(cls.config_class)):
                out.append(arch)
        except Exception:  # no image modality (audio-only models raise here)
            continue
    return out


def _sglang_vlms() -> list[str]:
    """SGLang's image-capable generative multimodal architectures: those it registers a
    model and a multimodal processor for, that generate (`is_generation_model`: not CLIP
    or an embedding model), and whose transformers config has a vision part (audio-only
    models have a processor too)."""
    import transformers

    processors = _sglang_processors()  # first: it puts the stand-in on the path
    from sglang.srt.configs.model_config import is_generation_model
    from sglang.srt.models.registry import ModelRegistry

    supported = set(ModelRegistry.get_supported_archs())
    out = []
    for arch in sorted(processors):
        cls = getattr(transformers, arch, None)
        if (arch in supported and cls is not None and is_generation_model([arch])
                and is_vlm(cls.config_class)):
            out.append(arch)
    return out
