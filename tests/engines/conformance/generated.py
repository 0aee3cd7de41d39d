"""The generated matrix: every decoder-only text architecture an engine registers that
transformers can build, from its default config shrunk by one generic rule.

No per-architecture configs here: an architecture's default config (transformers'
own) is shrunk by setting the size fields it has (hidden size, layers, heads, experts,
vocabulary...) to small values, and cutting per-layer lists to the new layer count. A
family that cannot be built that way is reported as such ("transformers cannot build it
small"), never patched by hand. Cells are named `gen:<Architecture>`; `cell.py` runs
them like the hand-written families. Where the config has `tie_word_embeddings`, the
other setting is a cell of its own, `gen:<Architecture>+tied` or `+untied` (the engines
load tied and untied heads by different paths).
"""

from __future__ import annotations

from typing import Any

from tests.engines.conformance.families import Family

#: size field -> small value, set only where the default config has the field.
SMALL: dict[str, Any] = {
    "vocab_size": 256, "hidden_size": 64, "n_embd": 64, "d_model": 64, "intermediate_size": 128,
    "ffn_hidden_size": 128, "n_inner": 128, "num_hidden_layers": 2, "n_layer": 2,
    "num_layers": 2, "num_attention_heads": 2, "n_head": 2, "num_key_value_heads": 1,
    "num_kv_heads": 1, "head_dim": 32, "max_position_embeddings": 512, "n_positions": 512,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64, "num_experts": 4,
    "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
    "moe_num_experts": 4, "moe_topk": 2, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
    "kv_lora_rank": 32, "q_lora_rank": 32, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16,
    "v_head_dim": 32, "sliding_window": 64, "attention_window_size": 64,
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
}
LAYER_FIELDS = ("num_hidden_layers", "n_layer", "num_layers")
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def _original_layers(cfg: Any) -> int | None:
    for f in LAYER_FIELDS:
        v = getattr(cfg, f, None)
        if isinstance(v, int):
            return v
    return None


TIES = ("tied", "untied")


def split_variant(name: str) -> tuple[str, str | None]:
    """`Arch+untied` -> ("Arch", "untied"); `Arch` -> ("Arch", None)."""
    arch, _, variant = name.partition("+")
    if variant and variant not in TIES:
        raise LookupError(f"unknown variant {variant!r} of {arch} (known: {', '.join(TIES)})")
    return arch, variant or None


def flipped_tie(config_class: type) -> str | None:
    """The variant that flips the default config's `tie_word_embeddings`, or None when
    the config has no such field."""
    default = config_class()
    if not hasattr(default, "tie_word_embeddings"):
        return None
    return "untied" if default.tie_word_embeddings else "tied"


def shrink(config_class: type, variant: str | None = None) -> dict[str, Any]:
    """Keyword arguments that build `config_class` small (see the module docstring)."""
    return _shrink(config_class(), config_class, variant, SMALL)


def _shrink(default: Any, config_class: type, variant: str | None,
            small: dict[str, Any]) -> dict[str, Any]:
    layers = _original_layers(default)
    kwargs: dict[str, Any] = {k: v for k, v in small.items() if hasattr(default, k)
                              and getattr(default, k) is not None
                              and not isinstance(getattr(config_class, k, None), property)}
    # Shrinking never grows a field: a default of one expert per token (Llama 4) or no
    # dense first layer stays so (token ids are ids, not sizes).
    for k, v in kwargs.items():
        d = getattr(default, k)
        if k not in TOKEN_IDS and type(d) is int and type(v) is int and d < v:
            kwargs[k] = d
    # Per-layer lists (layer_types, ...) keep one layer of every kind they name, so the
    # small model still has each kind of layer (2 to 4 layers).
    lists = {k: v for k, v in vars(default).items()
             if isinstance(v, list) and layers and len(v) == layers and layers > 2}
    n = max([2] + [min(4, len(dict.fromkeys(map(repr, v)))) for v in lists.values()])
    for key, value in lists.items():
        kinds = list({repr(x): x for x in value}.values())
        kwargs[key] = (kinds + value)[:n]
    for f in LAYER_FIELDS:
        if f in kwargs:
            kwargs[f] = n
    if hasattr(default, "tie_word_embeddings"):
        kwargs["tie_word_embeddings"] = (variant == "tied" if variant
                                         else bool(default.tie_word_embeddings))
    elif variant:
        raise LookupError(f"{config_class.__name__} has no tie_word_embeddings to set")
    return kwargs


def is_text_decoder(config_class: type) -> bool:
    default = config_class()
    return not (getattr(default, "is_encoder_decoder", False)
                or getattr(default, "sub_configs", None))


def generated_family(name: str) -> Family:
    """The `gen:<name>` family, `name` an architecture with an optional `+tied`/`+untied`
    (raises `LookupError` when transformers has no such class or it is not a text
    decoder)."""
    import transformers

    arch, variant = split_variant(name)
    cls = getattr(transformers, arch, None)
    if cls is None or getattr(cls, "config_class", None) is None:
        raise LookupError(f"transformers has no class {arch}")
    config_class = cls.config_class
    from tests.engines.conformance.vlm import is_vlm, vlm_family

    if is_vlm(config_class) and not variant:
        return vlm_family(arch)
    if not is_text_decoder(config_class):
        raise LookupError(f"{arch} is not a decoder-only text architecture")
    kwargs = shrink(config_class, variant)
    try:  # transformers must build it small (on meta: no memory), or there is no cell
        import torch

        with torch.device("meta"):
            cls._from_config(config_class(**kwargs))
    except Exception as e:
        raise LookupError(f"transformers cannot build {arch} small: {type(e).__name__}: "
                          f"{str(e).splitlines()[0][:300]}") from e
    return Family(f"gen:{name}", config_class.__name__, kwargs, model_class=arch,
                  tags=("generated",))


def registered(engine: str) -> list[str]:
    """Text-generation architectures `engine` registers that transformers has a class for
    (import in that engine's environment)."""
    import transformers

    if engine == "vllm":
        from vllm.model_executor.models.registry import _TEXT_GENERATION_MODELS

        archs = sorted(_TEXT_GENERATION_MODELS)
    else:
        from sglang.srt.models.registry import ModelRegistry

        archs = sorted(a for a in ModelRegistry.get_supported_archs() if a.endswith("ForCausalLM")
                       or a.endswith("LMHeadModel"))
    return [a for a in archs if getattr(transformers, a, None) is not None]
