"""An out-of-tree slotrunner plugin: GPT-2 (default decoder state) and RWKV-4 (its own
ModelState), registered through the `slotrunner.plugins` entry point (see pyproject.toml).

`register` names classes by "module:Class" strings, so loading the plugin imports no model
code: a mistake in one model surfaces when that architecture is used, and only then.
"""

from slotrunner.registry import register_model

_P = "slotrunner_example_plugin"


def register() -> None:
    register_model("GPT2LMHeadModel", f"{_P}.gpt2:GPT2LMHeadModel", tiny_config=f"{_P}.tiny_configs:gpt2")
    register_model(
        "RwkvForCausalLM",
        f"{_P}.rwkv:RwkvForCausalLM",
        model_state_cls=f"{_P}.rwkv_state:RwkvModelState",
        tiny_config=f"{_P}.tiny_configs:rwkv",
    )
