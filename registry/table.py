"""The architecture table: HF architecture name -> where its model, ModelState and tiny config live.

Entries are strings ("module:attr") so that importing the registry imports no model code.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ArchEntry:
    model: str  # "package.module:ClassName"
    model_state: str | None = None  # None: the model class's `model_state_cls`, else DefaultModelState
    tiny_config: str | None = None  # "package.module:function" returning a tiny HF config


_M = "slotrunner.models"
_T = "slotrunner.registry.tiny_configs"
_S = "slotrunner.model_states"

# The families, by the ModelState that serves them: every in-tree entry names its own.
DEFAULT = f"{_S}.default:DefaultModelState"
RECURRENT_HYBRID = f"{_S}.recurrent_hybrid:RecurrentHybridModelState"
ENCODER_DECODER = f"{_S}.encoder_decoder:EncoderDecoderModelState"
AUDIO_ENCODER_DECODER = f"{_S}.encoder_decoder:AudioEncoderDecoderModelState"
MULTIMODAL = f"{_S}.multimodal:MultimodalModelState"

IN_TREE: dict[str, ArchEntry] = {
    "LlamaForCausalLM": ArchEntry(f"{_M}.llama:LlamaForCausalLM", DEFAULT, f"{_T}:llama"),
    "MistralForCausalLM": ArchEntry(f"{_M}.llama:MistralForCausalLM", DEFAULT, f"{_T}:mistral"),
    "Qwen2ForCausalLM": ArchEntry(f"{_M}.llama:Qwen2ForCausalLM", DEFAULT, f"{_T}:qwen2"),
    "Qwen3ForCausalLM": ArchEntry(f"{_M}.llama:Qwen3ForCausalLM", DEFAULT, f"{_T}:qwen3"),
    "Phi3ForCausalLM": ArchEntry(f"{_M}.phi3:Phi3ForCausalLM", DEFAULT, f"{_T}:phi3"),
    "Gemma2ForCausalLM": ArchEntry(f"{_M}.gemma:Gemma2ForCausalLM", DEFAULT, f"{_T}:gemma2"),
    "Gemma3ForCausalLM": ArchEntry(f"{_M}.gemma:Gemma3ForCausalLM", DEFAULT, f"{_T}:gemma3"),
    "MixtralForCausalLM": ArchEntry(f"{_M}.mixtral:MixtralForCausalLM", DEFAULT, f"{_T}:mixtral"),
    "Qwen3MoeForCausalLM": ArchEntry(f"{_M}.qwen3_moe:Qwen3MoeForCausalLM", DEFAULT, f"{_T}:qwen3_moe"),
    "GptOssForCausalLM": ArchEntry(f"{_M}.gpt_oss:GptOssForCausalLM", DEFAULT, f"{_T}:gpt_oss"),
    "DeepseekV2ForCausalLM": ArchEntry(f"{_M}.deepseek:DeepseekV2ForCausalLM", DEFAULT, f"{_T}:deepseek_v2"),
    "DeepseekV3ForCausalLM": ArchEntry(f"{_M}.deepseek:DeepseekV3ForCausalLM", DEFAULT, f"{_T}:deepseek_v3"),
    "Mamba2ForCausalLM": ArchEntry(f"{_M}.mamba2:Mamba2ForCausalLM", RECURRENT_HYBRID, f"{_T}:mamba2"),
    "BambaForCausalLM": ArchEntry(f"{_M}.bamba:BambaForCausalLM", RECURRENT_HYBRID, f"{_T}:bamba"),
    "GraniteMoeHybridForCausalLM": ArchEntry(
        f"{_M}.granite_moe_hybrid:GraniteMoeHybridForCausalLM", RECURRENT_HYBRID, f"{_T}:granite_moe_hybrid"
    ),
    "NemotronHForCausalLM": ArchEntry(f"{_M}.nemotron_h:NemotronHForCausalLM", RECURRENT_HYBRID, f"{_T}:nemotron_h"),
    "FalconH1ForCausalLM": ArchEntry(f"{_M}.falcon_h1:FalconH1ForCausalLM", RECURRENT_HYBRID, f"{_T}:falcon_h1"),
    "Qwen3NextForCausalLM": ArchEntry(f"{_M}.qwen3_next:Qwen3NextForCausalLM", RECURRENT_HYBRID, f"{_T}:qwen3_next"),
    "Qwen3_5ForCausalLM": ArchEntry(f"{_M}.qwen3_next:Qwen3_5ForCausalLM", RECURRENT_HYBRID, f"{_T}:qwen3_5"),
    "Qwen3_5MoeForCausalLM": ArchEntry(f"{_M}.qwen3_next:Qwen3_5MoeForCausalLM", RECURRENT_HYBRID, f"{_T}:qwen3_5_moe"),
    "BartForConditionalGeneration": ArchEntry(f"{_M}.bart:BartForConditionalGeneration", ENCODER_DECODER, f"{_T}:bart"),
    "T5ForConditionalGeneration": ArchEntry(f"{_M}.t5:T5ForConditionalGeneration", ENCODER_DECODER, f"{_T}:t5"),
    "WhisperForConditionalGeneration": ArchEntry(
        f"{_M}.whisper:WhisperForConditionalGeneration", AUDIO_ENCODER_DECODER, f"{_T}:whisper"
    ),
    "LlavaForConditionalGeneration": ArchEntry(f"{_M}.llava:LlavaForConditionalGeneration", MULTIMODAL, f"{_T}:llava"),
    "Qwen2VLForConditionalGeneration": ArchEntry(
        f"{_M}.qwen2_vl:Qwen2VLForConditionalGeneration", MULTIMODAL, f"{_T}:qwen2_vl"
    ),
    "Qwen2AudioForConditionalGeneration": ArchEntry(
        f"{_M}.qwen2_audio:Qwen2AudioForConditionalGeneration", MULTIMODAL, f"{_T}:qwen2_audio"
    ),
}


# GGUF `general.architecture` -> the reader that turns such a file into a HF-style checkpoint
# ("module:function(gguf_file, path, dtype, pack=False)"), kept next to the model it feeds.
GGUF_READERS: dict[str, str] = {
    "llama": f"{_M}.llama_gguf:read_llama_gguf",  # also Mistral: llama.cpp writes it as `llama`
    **{arch: f"{_M}.decoder_gguf:read_decoder_gguf" for arch in ("qwen2", "qwen3", "qwen3moe", "gemma2", "gemma3", "phi3", "gpt-oss")},
    "mamba2": f"{_M}.mamba2_gguf:read_mamba2_gguf",
    "deepseek2": f"{_M}.deepseek2_gguf:read_deepseek2_gguf",  # DeepSeek-V2 and V3
    "qwen3next": f"{_M}.qwen3next_gguf:read_qwen3next_gguf",
    "qwen35": f"{_M}.qwen3next_gguf:read_qwen3next_gguf",  # Qwen3.5: the Qwen3-Next family
    "qwen35moe": f"{_M}.qwen3next_gguf:read_qwen3next_gguf",
    "falcon-h1": f"{_M}.falcon_h1_gguf:read_falcon_h1_gguf",
    "granitehybrid": f"{_M}.granite_hybrid_gguf:read_granite_hybrid_gguf",  # GraniteMoeHybrid and Bamba
    "nemotron_h": f"{_M}.nemotron_h_gguf:read_nemotron_h_gguf",
    "nemotron_h_moe": f"{_M}.nemotron_h_gguf:read_nemotron_h_gguf",
}

# transformers spells some GGUF architectures with an underscore where llama.cpp has none or a dash
TRANSFORMERS_GGUF_NAMES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss"}
