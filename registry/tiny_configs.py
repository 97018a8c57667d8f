"""Tiny random-weight configs per architecture: the conformance suite's test cases, as data.

Each builder returns a `transformers` config small enough to build, save and run on a CPU in
well under a second. `tie_word_embeddings=False` by default: tied random models repeat one
token forever and would make token comparisons vacuous.
"""

from __future__ import annotations

from typing import Any

_TEXT = dict(
    vocab_size=1000,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)


def _build(class_name: str, overrides: dict[str, Any] | None = None, **fields: Any) -> Any:
    """A config of `class_name`: the shared text defaults, then the builder's fields, then the
    caller's overrides (which may replace any of them)."""
    import transformers

    return getattr(transformers, class_name)(**{**_TEXT, **fields, **(overrides or {})})


def llama(**overrides: Any) -> Any:
    return _build("LlamaConfig", num_hidden_layers=2, overrides=overrides)


def mistral(**overrides: Any) -> Any:
    return _build("MistralConfig", num_hidden_layers=2, head_dim=16, sliding_window=6, overrides=overrides)


def qwen2(**overrides: Any) -> Any:
    return _build("Qwen2Config", num_hidden_layers=2, overrides=overrides)


def qwen3(**overrides: Any) -> Any:
    return _build("Qwen3Config", num_hidden_layers=2, head_dim=16, overrides=overrides)


def phi3(**overrides: Any) -> Any:
    # Partial rotary (8 of 16 channels) and LongRoPE past an original length of 4: every
    # conformance sequence outgrows it, so transformers rotates all of it by the long factors
    # (as slotrunner does), cos/sin times sqrt(1 + ln(256 / 4) / ln(4)) = 2. With
    # max_position_embeddings <= original_max_position_embeddings the short factors serve.
    rope = dict(rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.5,
                short_factor=[1.0, 1.3, 1.7, 2.2], long_factor=[1.5, 2.5, 4.0, 6.0])
    return _build("Phi3Config", num_hidden_layers=2, original_max_position_embeddings=4, rope_parameters=rope,
                  overrides=overrides)  # fmt: skip


# Gemma: a window of 6 (shorter than most prompts), scores and logits soft-capped by small caps
# so that the caps change them, query_pre_attn_scalar != head_dim. eager attention: transformers
# 5.17's default (sdpa) drops the attention soft cap.
def gemma2(**overrides: Any) -> Any:
    return _build(
        "Gemma2Config", num_hidden_layers=4, head_dim=16, query_pre_attn_scalar=24, sliding_window=6,
        attn_logit_softcapping=2.0, final_logit_softcapping=3.0, initializer_range=0.1,
        attn_implementation="eager", overrides=overrides,
    )  # fmt: skip


def gemma3(**overrides: Any) -> Any:
    # Local/global every third layer (real Gemma 3: every sixth), each type its own RoPE: local
    # theta 100, global theta 5000 with linear scaling (as Gemma 3 4B+ ships, factor 8).
    rope = {"sliding_attention": dict(rope_type="default", rope_theta=100.0),
            "full_attention": dict(rope_type="linear", factor=2.0, rope_theta=5000.0)}
    return _build(
        "Gemma3TextConfig", num_hidden_layers=4, sliding_window_pattern=3, head_dim=16, query_pre_attn_scalar=24,
        sliding_window=6, rope_parameters=rope, final_logit_softcapping=3.0, initializer_range=0.1,
        overrides=overrides,
    )  # fmt: skip


# MoE: more experts than a decode step has tokens, and top-k leaving most of them empty.
def mixtral(**overrides: Any) -> Any:
    return _build(
        "MixtralConfig", num_hidden_layers=2, head_dim=16, intermediate_size=32, num_local_experts=8,
        num_experts_per_tok=2, sliding_window=6, overrides=overrides,
    )  # fmt: skip


def qwen3_moe(**overrides: Any) -> Any:
    # Layer 1 dense (mlp_only_layers), layers 0 and 2 sparse.
    return _build(
        "Qwen3MoeConfig", num_hidden_layers=3, head_dim=16, moe_intermediate_size=32, num_experts=16,
        num_experts_per_tok=4, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1], overrides=overrides,
    )  # fmt: skip


def gpt_oss(**overrides: Any) -> Any:
    # Sliding and full layers (window 6), YaRN scaling. The released SwiGLU limit (7.0) clamps
    # nothing in a tiny random model; the conformance suite lowers it where transformers reads it.
    rope = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                original_max_position_embeddings=64)  # fmt: skip
    return _build(
        "GptOssConfig", num_hidden_layers=2, head_dim=16, intermediate_size=32, num_local_experts=8,
        num_experts_per_tok=2, sliding_window=6, rope_parameters=rope, overrides=overrides,
    )  # fmt: skip


# DeepSeek: multi-head latent attention (latent 32 + rope 8 per token; nope 16 != v 12), one
# dense layer before the MoE ones, 16 experts in 4 groups with the best 2 groups open, so most
# experts get no token in a decode step. num_key_value_heads = heads, as DeepSeek checkpoints
# have it (transformers would repeat the expanded heads otherwise).
_DEEPSEEK = dict(
    num_hidden_layers=3, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
    moe_intermediate_size=16, n_routed_experts=16, n_group=4, topk_group=2, first_k_dense_replace=1, initializer_range=0.1,
)  # fmt: skip


def deepseek_v2(**overrides: Any) -> Any:
    # V2-Lite's shape: no q LoRA, YaRN with mscale = mscale_all_dim (cos/sin unscaled, the softmax
    # scale raised by mscale^2); group-limited greedy softmax routing, top-3, 2 shared experts.
    rope = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, mscale=0.707, mscale_all_dim=0.707,
                beta_fast=32.0, beta_slow=1.0, original_max_position_embeddings=64)  # fmt: skip
    return _build(
        "DeepseekV2Config", **_DEEPSEEK, q_lora_rank=None, num_experts_per_tok=3, n_shared_experts=2,
        topk_method="group_limited_greedy", routed_scaling_factor=1.5, rope_parameters=rope, overrides=overrides,
    )  # fmt: skip


def deepseek_v3(**overrides: Any) -> Any:
    # q LoRA (rank 24), YaRN with mscale != mscale_all_dim (both the cos/sin factor and the
    # softmax scale move), interleaved rope, sigmoid grouped top-4 with a correction bias,
    # renormalised and scaled by 2.5; an MTP layer in the config but none in the file.
    rope = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, mscale=1.0, mscale_all_dim=0.8,
                beta_fast=32.0, beta_slow=1.0, original_max_position_embeddings=64)  # fmt: skip
    return _build(
        "DeepseekV3Config", **_DEEPSEEK, q_lora_rank=24, num_experts_per_tok=4, n_shared_experts=1,
        norm_topk_prob=True, routed_scaling_factor=2.5, rope_interleave=True, num_nextn_predict_layers=1,
        rope_parameters=rope, overrides=overrides,
    )  # fmt: skip


# Mamba2 has no attention or MLP: the text defaults' attention/MLP fields do not apply.
_MAMBA2 = {k: v for k, v in _TEXT.items() if k not in ("intermediate_size", "num_attention_heads", "num_key_value_heads", "max_position_embeddings")}


def mamba2(**overrides: Any) -> Any:
    import transformers

    fields = dict(num_heads=8, head_dim=16, state_size=16, n_groups=2, expand=2, conv_kernel=4, num_hidden_layers=2, chunk_size=4)
    return transformers.Mamba2Config(**{**_MAMBA2, **fields, **overrides})


def bamba(**overrides: Any) -> Any:
    return _build(
        "BambaConfig",
        num_hidden_layers=4,
        attn_layer_indices=[1, 3],
        mamba_n_heads=8,
        mamba_n_groups=1,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=4,
        overrides=overrides,
    )



def granite_moe_hybrid(**overrides: Any) -> Any:
    # Rotary on (Granite 4.0 ships without) and non-unit multipliers, so that each is exercised.
    return _build(
        "GraniteMoeHybridConfig",
        num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        intermediate_size=32,  # per expert
        num_local_experts=4,
        num_experts_per_tok=2,
        shared_intermediate_size=64,
        position_embedding_type="rope",
        embedding_multiplier=2.0,
        attention_multiplier=0.2,
        residual_multiplier=0.5,
        logits_scaling=1.5,
        mamba_n_heads=8,
        mamba_n_groups=1,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=4,
        overrides=overrides,
    )


def nemotron_h(**overrides: Any) -> Any:
    fields = {k: v for k, v in _TEXT.items() if k != "intermediate_size"}
    import transformers

    return transformers.NemotronHConfig(**{
        **fields,
        "intermediate_size": 128,
        "layers_block_type": ["linear_attention", "full_attention", "mlp", "moe"],
        "head_dim": 16,
        "ssm_state_size": 16,
        "mamba_num_heads": 8,
        "mamba_head_dim": 16,
        "n_groups": 1,
        "conv_kernel": 4,
        "expand": 2,
        "chunk_size": 4,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "moe_shared_expert_intermediate_size": 32,
        **overrides,
    })


def falcon_h1(**overrides: Any) -> Any:
    # Non-unit muP multipliers (one per z/x/B/C/dt section too), so that each is exercised.
    return _build(
        "FalconH1Config",
        num_hidden_layers=2,
        mamba_d_ssm=128,
        mamba_n_heads=8,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=4,
        embedding_multiplier=1.5,
        lm_head_multiplier=0.7,
        key_multiplier=0.8,
        attention_in_multiplier=1.2,
        attention_out_multiplier=0.9,
        ssm_in_multiplier=1.1,
        ssm_out_multiplier=0.6,
        ssm_multipliers=[0.9, 1.1, 1.2, 0.8, 1.3],
        mlp_multipliers=[1.25, 0.75],
        overrides=overrides,
    )


# Gated delta-net hybrids: delta-net layers (2 key heads serving 4 value heads, head dims 16 and
# 8) between gated full-attention layers with partial rotary (a quarter of each head, as released).
_GDN = dict(
    num_hidden_layers=4, layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
    linear_conv_kernel_dim=4, rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25),
)  # fmt: skip
_GDN_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)


def qwen3_next(**overrides: Any) -> Any:
    # Layer 2 dense (mlp_only_layers), the others sparse with a gated shared expert.
    return _build("Qwen3NextConfig", **_GDN, **_GDN_MOE, norm_topk_prob=True, mlp_only_layers=[2], overrides=overrides)


def qwen3_5(**overrides: Any) -> Any:
    return _build("Qwen3_5TextConfig", **_GDN, overrides=overrides)


def qwen3_5_moe(**overrides: Any) -> Any:
    text = {k: v for k, v in _TEXT.items() if k != "intermediate_size"}  # every layer is sparse
    import transformers

    return transformers.Qwen3_5MoeTextConfig(**{**text, **_GDN, **_GDN_MOE, **overrides})

# Encoder-decoders (CONFORMANCE.md's table). Built field by field: the decoder-only text
# defaults above name fields these configs do not have.
def whisper(**overrides: Any) -> Any:
    import transformers

    fields = dict(
        vocab_size=1000, num_mel_bins=80, d_model=64, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
        max_source_positions=32, max_target_positions=64, pad_token_id=3, bos_token_id=4, eos_token_id=5,
        decoder_start_token_id=6, begin_suppress_tokens=None, suppress_tokens=None, tie_word_embeddings=False,
    )
    return transformers.WhisperConfig(**{**fields, **overrides})


def bart(**overrides: Any) -> Any:
    import transformers

    fields = dict(
        vocab_size=1000, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=128,
        pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None,
        tie_word_embeddings=False,
    )
    return transformers.BartConfig(**{**fields, **overrides})


def t5(**overrides: Any) -> Any:
    import transformers

    tie = overrides.pop("tie_word_embeddings", False)
    fields = dict(
        vocab_size=1000, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=32, feed_forward_proj="gated-gelu",
        pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    )
    config = transformers.T5Config(**{**fields, **overrides}, tie_word_embeddings=tie)
    # T5Config forces tie_word_embeddings=True in its constructor (the kwarg only decides
    # scale_decoder_outputs); an untied case must set it afterwards.
    config.tie_word_embeddings = tie
    return config


def whisper_feature_extractor(hf_config: Any) -> Any:
    """The feature extractor saved beside a tiny Whisper: one-second chunks whose hop gives
    exactly the 2 * max_source_positions frames the encoder takes (real Whisper: 30 s, 3000)."""
    import transformers

    sampling_rate, frames = 16000, 2 * hf_config.max_source_positions
    assert sampling_rate % frames == 0, f"{frames} frames do not divide one second at {sampling_rate} Hz"
    return transformers.WhisperFeatureExtractor(
        feature_size=hf_config.num_mel_bins, sampling_rate=sampling_rate, hop_length=sampling_rate // frames, chunk_length=1, n_fft=400
    )


# -- multimodal: a tiny tower + a 2-layer language model; placeholder ids sit below the text ids.


def _text(model_type: str, **fields: Any) -> dict[str, Any]:
    return {"model_type": model_type, **_TEXT, "num_hidden_layers": 2, **fields}


def llava(**overrides: Any) -> Any:
    import transformers

    vision = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, image_size=32, patch_size=8, projection_dim=32)
    fields = dict(vision_config=vision, text_config=_text("llama"), image_token_id=3, image_seq_length=16,
                  vision_feature_layer=-2, vision_feature_select_strategy="default", tie_word_embeddings=False,
                  architectures=["LlavaForConditionalGeneration"])
    return transformers.LlavaConfig(**{**fields, **overrides})


def qwen2_vl(**overrides: Any) -> Any:
    import transformers

    vision = dict(depth=2, embed_dim=32, num_heads=4, mlp_ratio=2, patch_size=4, spatial_merge_size=2,
                  temporal_patch_size=2, hidden_size=64, in_channels=3)
    text = _text("qwen2_vl_text", rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3]))
    fields = dict(vision_config=vision, text_config=text, image_token_id=3, video_token_id=4, vision_start_token_id=5,
                  vision_end_token_id=6, tie_word_embeddings=False, architectures=["Qwen2VLForConditionalGeneration"])
    return transformers.Qwen2VLConfig(**{**fields, **overrides})


def qwen2_audio(**overrides: Any) -> Any:
    import transformers

    audio = dict(num_mel_bins=16, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=128, d_model=64,
                 max_source_positions=32)
    fields = dict(audio_config=audio, text_config=_text("qwen2"), audio_token_id=3, tie_word_embeddings=False,
                  architectures=["Qwen2AudioForConditionalGeneration"])
    return transformers.Qwen2AudioConfig(**{**fields, **overrides})


# Processors saved beside the tiny multimodal models, built offline: a word-level tokenizer
# ("w<id>" is token <id>) whose special tokens sit at the config's placeholder ids.


def tiny_tokenizer(special_tokens: list[str], vocab_size: int = 1000) -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    vocab.update({tok: 3 + i for i, tok in enumerate(special_tokens)})
    vocab.update({f"w{i}": i for i in range(len(vocab), vocab_size - 1)})
    vocab["<unk>"] = vocab_size - 1
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>",
        additional_special_tokens=special_tokens,
    )


def llava_processor(hf_config: Any) -> Any:
    """LlavaProcessor: CLIP preprocessing to the tower's image size, `<image>` at id 3."""
    from transformers import LlavaProcessor

    try:
        from transformers import CLIPImageProcessorPil as ImageProcessor  # no torchvision needed
    except ImportError:
        from transformers import CLIPImageProcessor as ImageProcessor
    size = hf_config.vision_config.image_size
    images = ImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size})
    return LlavaProcessor(
        images, tiny_tokenizer(["<image>"]), patch_size=hf_config.vision_config.patch_size,
        vision_feature_select_strategy=hf_config.vision_feature_select_strategy, num_additional_image_tokens=1,
    )


def qwen2_vl_image_processor(hf_config: Any) -> Any:
    """The image processor alone: Qwen2VLProcessor needs a video processor, which needs
    torchvision; without one, slotrunner expands `<|image_pad|>` itself."""
    try:
        from transformers import Qwen2VLImageProcessorPil as ImageProcessor
    except ImportError:
        from transformers import Qwen2VLImageProcessor as ImageProcessor
    vc = hf_config.vision_config
    unit = vc.patch_size * vc.spatial_merge_size
    return ImageProcessor(
        patch_size=vc.patch_size, temporal_patch_size=vc.temporal_patch_size, merge_size=vc.spatial_merge_size,
        min_pixels=unit * unit, max_pixels=(8 * unit) ** 2,
    )


def qwen2_vl_tokenizer() -> Any:
    return tiny_tokenizer(["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"])


def qwen2_audio_processor(hf_config: Any) -> Any:
    """Qwen2AudioProcessor: one-second chunks giving the encoder's 2 * max_source_positions frames."""
    import transformers

    frames = 2 * hf_config.audio_config.max_source_positions
    features = transformers.WhisperFeatureExtractor(
        feature_size=hf_config.audio_config.num_mel_bins, sampling_rate=16000, hop_length=16000 // frames,
        chunk_length=1, n_fft=400,
    )
    return transformers.Qwen2AudioProcessor(features, tiny_tokenizer(["<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>"]))
