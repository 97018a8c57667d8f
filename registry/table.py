"""The architecture table: HF architecture name -> where its model, ModelState and tiny config live.

Entries are strings ("module:attr") so that importing the registry imports no model code.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ArchEntry:
    model: str  # "package.module:ClassName"
    model_state: str | None = None  # None: resolve (model declaration, then config traits, then default)
    tiny_config: str | None = None  # "package.module:function" returning a tiny HF config


_M = "slotrunner.models"
_T = "slotrunner.registry.tiny_configs"

IN_TREE: dict[str, ArchEntry] = {
    "LlamaForCausalLM": ArchEntry(f"{_M}.llama:LlamaForCausalLM", tiny_config=f"{_T}:llama"),
    "MistralForCausalLM": ArchEntry(f"{_M}.llama:MistralForCausalLM", tiny_config=f"{_T}:mistral"),
    "Qwen2ForCausalLM": ArchEntry(f"{_M}.llama:Qwen2ForCausalLM", tiny_config=f"{_T}:qwen2"),
    "Qwen3ForCausalLM": ArchEntry(f"{_M}.llama:Qwen3ForCausalLM", tiny_config=f"{_T}:qwen3"),
    # Mamba hybrids: the ModelState is resolved from the config (recurrent layers -> mamba_hybrid).
    "Mamba2ForCausalLM": ArchEntry(f"{_M}.mamba2:Mamba2ForCausalLM", tiny_config=f"{_T}:mamba2"),
    "BambaForCausalLM": ArchEntry(f"{_M}.bamba:BambaForCausalLM", tiny_config=f"{_T}:bamba"),
    "GraniteMoeHybridForCausalLM": ArchEntry(
        f"{_M}.granite_moe_hybrid:GraniteMoeHybridForCausalLM", tiny_config=f"{_T}:granite_moe_hybrid"
    ),
    "NemotronHForCausalLM": ArchEntry(f"{_M}.nemotron_h:NemotronHForCausalLM", tiny_config=f"{_T}:nemotron_h"),
    "FalconH1ForCausalLM": ArchEntry(f"{_M}.falcon_h1:FalconH1ForCausalLM", tiny_config=f"{_T}:falcon_h1"),
    # Encoder-decoders: BART and T5 resolve from the config (is_encoder_decoder); Whisper names
    # the audio variant of the family's ModelState.
    "BartForConditionalGeneration": ArchEntry(f"{_M}.bart:BartForConditionalGeneration", tiny_config=f"{_T}:bart"),
    "T5ForConditionalGeneration": ArchEntry(f"{_M}.t5:T5ForConditionalGeneration", tiny_config=f"{_T}:t5"),
    "WhisperForConditionalGeneration": ArchEntry(
        f"{_M}.whisper:WhisperForConditionalGeneration",
        model_state="slotrunner.model_states.encoder_decoder:AudioEncoderDecoderModelState",
        tiny_config=f"{_T}:whisper",
    ),
    # Multimodal: MultimodalModelState, resolved from the vision/audio config.
    "LlavaForConditionalGeneration": ArchEntry(f"{_M}.llava:LlavaForConditionalGeneration", tiny_config=f"{_T}:llava"),
    "Qwen2VLForConditionalGeneration": ArchEntry(
        f"{_M}.qwen2_vl:Qwen2VLForConditionalGeneration", tiny_config=f"{_T}:qwen2_vl"
    ),
    "Qwen2AudioForConditionalGeneration": ArchEntry(
        f"{_M}.qwen2_audio:Qwen2AudioForConditionalGeneration", tiny_config=f"{_T}:qwen2_audio"
    ),
}

# The families, by the ModelState that serves them.
FAMILY_STATES: dict[str, str] = {
    "default": "slotrunner.model_states.default:DefaultModelState",
    "encoder_decoder": "slotrunner.model_states.encoder_decoder:EncoderDecoderModelState",
    "mamba_hybrid": "slotrunner.model_states.mamba_hybrid:MambaHybridModelState",
    "multimodal": "slotrunner.model_states.multimodal:MultimodalModelState",
}


# GGUF `general.architecture` -> the reader that turns such a file into a HF-style checkpoint
# ("module:function(gguf_file, path, dtype, pack=False)"), kept next to the model it feeds.
GGUF_READERS: dict[str, str] = {
    "llama": f"{_M}.llama_gguf:read_llama_gguf",
}
