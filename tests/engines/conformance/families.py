"""The model families of the conformance matrix, as tiny random checkpoints built offline.

This table belongs to the tests: it says how to build a small but real model of each
family with transformers (config class and sizes), never how to map its weights (that
is transformers' and the engines' business, which the matrix checks). Where an engine
needs a config value transformers 5 no longer writes, or a CPU kernel constrains a
size, `engine_config` adds it for that engine's checkpoint, with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

BASE: dict[str, Any] = dict(vocab_size=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                            max_position_embeddings=512)
LLAMA_LIKE: dict[str, Any] = dict(BASE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=2, num_key_value_heads=1, head_dim=32)
MOE: dict[str, Any] = dict(num_experts_per_tok=2, moe_intermediate_size=32)
# DeepSeek MLA: vLLM's CPU MLA kernel only takes kv_lora_rank + qk_rope_head_dim == 576;
# SGLang's CPU MLA wants a yarn rope and reads three keys transformers 5 dropped.
YARN: dict[str, Any] = dict(rope_type="yarn", rope_theta=10000.0, factor=1.0,
                            original_max_position_embeddings=512, beta_fast=32.0, beta_slow=1.0,
                            mscale=1.0, mscale_all_dim=1.0)
DEEPSEEK: dict[str, Any] = dict(
    BASE, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=2, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32,
    v_head_dim=32, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
    moe_intermediate_size=32, first_k_dense_replace=1, n_group=1, topk_group=1,
    routed_scaling_factor=1.0, tie_word_embeddings=False, rope_parameters=dict(YARN),
    moe_layer_freq=1)


@dataclass(frozen=True)
class Family:
    name: str
    config: str                      # transformers config class
    kwargs: dict[str, Any]
    model_class: str | None = None   # transformers model class when not AutoModelForCausalLM
    engine_config: dict[str, dict[str, Any]] = field(default_factory=dict)
    engine_args: dict[str, dict[str, Any]] = field(default_factory=dict)
    tags: tuple[str, ...] = ()       # what the family exercises
    # engine -> (transformers image processor class, its kwargs), saved beside the
    # weights for an engine that starts a vision-language model with its processor
    image_processor: dict[str, tuple[str, dict[str, Any]]] = field(default_factory=dict)

    def config_kwargs(self, engine: str) -> dict[str, Any]:
        return {**self.kwargs, **self.engine_config.get(engine, {})}


FAMILIES: dict[str, Family] = {f.name: f for f in [
    Family("llama", "LlamaConfig", dict(LLAMA_LIKE, tie_word_embeddings=False), tags=("dense",)),
    Family("mistral", "MistralConfig", dict(LLAMA_LIKE, tie_word_embeddings=False,
                                            sliding_window=None), tags=("dense",)),
    Family("qwen2", "Qwen2Config", dict(LLAMA_LIKE, tie_word_embeddings=True),
           tags=("tied", "qkv bias")),
    Family("qwen3", "Qwen3Config", dict(LLAMA_LIKE, tie_word_embeddings=True),
           tags=("tied", "q/k norm")),
    Family("qwen3_moe", "Qwen3MoeConfig", dict(LLAMA_LIKE, **MOE, num_experts=4,
                                               decoder_sparse_step=1, mlp_only_layers=[],
                                               norm_topk_prob=True, tie_word_embeddings=False),
           tags=("moe",)),
    Family("qwen2_moe", "Qwen2MoeConfig", dict(LLAMA_LIKE, **MOE, num_experts=4,
                                               decoder_sparse_step=1, mlp_only_layers=[],
                                               shared_expert_intermediate_size=64,
                                               tie_word_embeddings=False),
           tags=("moe", "shared expert")),
    Family("mixtral", "MixtralConfig", dict(LLAMA_LIKE, num_local_experts=4, num_experts_per_tok=2,
                                            sliding_window=None, tie_word_embeddings=False),
           tags=("moe",)),
    Family("phi3", "Phi3Config", dict(LLAMA_LIKE, tie_word_embeddings=False),
           tags=("fused qkv / gate_up in the checkpoint",)),
    # hidden_act: SGLang's gemma2 reads the transformers 4 name (5 writes hidden_activation).
    Family("gemma2", "Gemma2Config", dict(LLAMA_LIKE, query_pre_attn_scalar=32, sliding_window=64,
                                          tie_word_embeddings=True, hidden_act="gelu_pytorch_tanh"),
           tags=("tied, no output head", "norm offsets", "softcapping")),
    Family("gemma3_text", "Gemma3TextConfig", dict(LLAMA_LIKE, query_pre_attn_scalar=32,
                                                   sliding_window=64, tie_word_embeddings=True),
           tags=("tied, no output head", "norm offsets")),
    Family("olmo2", "Olmo2Config", dict(LLAMA_LIKE, tie_word_embeddings=False),
           tags=("post-norm", "q/k norm")),
    # vLLM picks its AMX MLA backend on a CPU with AMX tiles and the reference CPU_MLA
    # elsewhere; AMX_MLA cannot start in fp32 (its weight packing takes bf16 only) and
    # vLLM's own in-place reload fails under it in bf16 (`_copy_and_restore_kernel_tensors`:
    # size 0 vs 512, with or without the copy plan). CPU_MLA, named, keeps the cells the
    # same on every host.
    Family("deepseek_v2", "DeepseekV2Config", dict(DEEPSEEK, q_lora_rank=None, topk_method="greedy",
                                                   scoring_func="softmax"),
           tags=("mla", "moe", "shared expert"),
           engine_args={"vllm": {"attention_backend": "CPU_MLA"}}),
    Family("deepseek_v3", "DeepseekV3Config", dict(DEEPSEEK, q_lora_rank=32, topk_method="noaux_tc",
                                                   scoring_func="sigmoid"),
           tags=("mla", "moe", "fp32 router bias"),
           engine_args={"vllm": {"attention_backend": "CPU_MLA"}}),
    Family("gpt2", "GPT2Config", dict(vocab_size=256, n_embd=64, n_layer=2, n_head=2,
                                      n_positions=512, bos_token_id=1, eos_token_id=2,
                                      pad_token_id=0, tie_word_embeddings=True),
           tags=("transformer.h.N names", "Conv1D layout", "tied")),
    Family("gpt_neox", "GPTNeoXConfig", dict(BASE, hidden_size=64, intermediate_size=128,
                                             num_hidden_layers=2, num_attention_heads=2,
                                             rotary_pct=0.5, tie_word_embeddings=False),
           tags=("gpt_neox.layers.N names", "fused qkv")),
    Family("gpt_oss", "GptOssConfig", dict(LLAMA_LIKE, num_local_experts=4, num_experts_per_tok=2,
                                           sliding_window=64, tie_word_embeddings=False),
           tags=("moe", "attention sinks", "expert biases")),
    Family("apertus", "ApertusConfig", dict(LLAMA_LIKE, tie_word_embeddings=False),
           tags=("xIELU activation (parameters read at build)",)),
    Family("mamba2", "Mamba2Config", dict(BASE, hidden_size=64, num_hidden_layers=2, num_heads=8,
                                          head_dim=16, expand=2, state_size=16, n_groups=1,
                                          conv_kernel=4, chunk_size=64, tie_word_embeddings=False),
           tags=("state space", "conv buffer aliasing a parameter")),
    Family("paligemma", "PaliGemmaConfig", dict(
        text_config=dict(model_type="gemma", vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=32, max_position_embeddings=512, bos_token_id=1,
                         eos_token_id=2, pad_token_id=0, tie_word_embeddings=True),
        vision_config=dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64,
                           num_hidden_layers=1, num_attention_heads=2, image_size=28,
                           patch_size=14, projection_dim=64),
        image_token_index=255, vocab_size=256, projection_dim=64, hidden_size=64,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=True),
        model_class="PaliGemmaForConditionalGeneration",
        engine_args={"vllm": {"language_model_only": True}},
        # SGLang serves it through its Transformers backend, which loads the processor
        image_processor={"sglang": ("SiglipImageProcessor", {"size": {"height": 28, "width": 28}})},
        tags=("vision-language (language part)",)),
]}


def build(family: Family, engine: str, folder: Any, seed: int = 0) -> Any:
    """Write `family`'s tiny checkpoint for `engine` into `folder`."""
    import transformers

    from enginehooks_testkit.tiny import save_tiny

    if "vision-language" in family.tags and family.name.startswith("gen:"):
        from tests.engines.conformance.vlm import build_vlm

        return build_vlm(family, engine, folder, seed=seed)
    config = getattr(transformers, family.config)(**family.config_kwargs(engine))
    out = save_tiny(folder, config, model_class=family.model_class, seed=seed)
    if engine in family.image_processor:
        cls, kwargs = family.image_processor[engine]
        getattr(transformers, cls)(**kwargs).save_pretrained(out)
    return out


def family_named(name: str) -> Family:
    """A hand-written family, or a generated one (`gen:<Architecture>`, see
    `generated.py`)."""
    if name.startswith("gen:"):
        from tests.engines.conformance.generated import generated_family

        return generated_family(name[4:])
    return FAMILIES[name]
