"""Targets as users load them: a remote-code DeepSeek-V3-like model, transformers' MoE models, multimodal wrappers
around a text model, and a target dispatched by accelerate with CPU/disk offload."""

import copy
import json
import shutil
from pathlib import Path

import torch
from tiny import EOS
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    CLIPVisionConfig,
    GenerationMixin,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    PretrainedConfig,
    PreTrainedModel,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)
from transformers.modeling_outputs import CausalLMOutputWithPast

REMOTE_SOURCE = Path(__file__).parent / "remote_target"
REMOTE_FILES = ("configuration_toyseek.py", "modeling_toyseek.py")


def build_remote_target(tmp_path: Path, seed: int = 0, **config_overrides) -> Path:
    """Write a loadable remote-code ToySeek checkpoint (code files, `auto_map` config, random weights) and return
    its folder; load it with `AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`."""
    folder = Path(tmp_path) / f"toyseek-{seed}"
    folder.mkdir(parents=True)
    for name in REMOTE_FILES:
        shutil.copy(REMOTE_SOURCE / name, folder / name)
    config = json.loads((REMOTE_SOURCE / "config.json").read_text())
    config.update(config_overrides)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder, trust_remote_code=True),
                                             trust_remote_code=True)
    model.save_pretrained(folder)
    return folder


def load_remote_target(folder: Path, **kwargs):
    return AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, **kwargs).eval()


def tiny_qwen3_moe(seed: int = 0, vocab_size: int = 96, num_layers: int = 4) -> Qwen3MoeForCausalLM:
    """Qwen3-MoE at toy size, its first layer dense (`mlp_only_layers`) like the released checkpoints' variants."""
    torch.manual_seed(seed)
    config = Qwen3MoeConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_experts=4,
        num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[0], num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512, norm_topk_prob=True,
        eos_token_id=EOS, pad_token_id=0, bos_token_id=1,
    )
    return Qwen3MoeForCausalLM(config).eval()


def tiny_llava(seed: int = 0, vocab_size: int = 96, num_layers: int = 4) -> LlavaForConditionalGeneration:
    """transformers' own Llava at toy size: text model at `model.language_model`, lm_head on the outer model."""
    torch.manual_seed(seed)
    text = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                       eos_token_id=EOS, pad_token_id=0, bos_token_id=1)
    vision = CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                              image_size=8, patch_size=4, projection_dim=16)
    config = LlavaConfig(text_config=text, vision_config=vision, image_token_index=vocab_size - 2,
                         image_seq_length=4)
    model = LlavaForConditionalGeneration(config).eval()
    model.generation_config.eos_token_id = EOS
    model.generation_config.pad_token_id = 0
    return model


class ToyVLMConfig(PretrainedConfig):
    """Kimi-VL-style outer config: the text model's config under `text_config`, a patch projector's sizes beside it."""

    model_type = "toy_vlm"
    sub_configs = {"text_config": AutoConfig}

    def __init__(self, text_config=None, patch_dim: int = 12, image_token_id: int = 94, **kwargs):
        if isinstance(text_config, dict):
            text_config = AutoConfig.for_model(**text_config)
        self.text_config = text_config
        self.patch_dim = patch_dim
        self.image_token_id = image_token_id
        super().__init__(**kwargs)


class ToyVLMForConditionalGeneration(PreTrainedModel, GenerationMixin):
    """A multimodal-style wrapper whose whole causal LM (layers and lm_head) lives under `language_model`, as in
    Kimi-VL / Kimi-K2.x: image patches are projected into the embedding stream at `image_token_id` positions."""

    config_class = ToyVLMConfig
    base_model_prefix = ""
    _no_split_modules = []

    def __init__(self, config: ToyVLMConfig, language_model: PreTrainedModel | None = None):
        super().__init__(config)
        text = config.text_config
        self.multi_modal_projector = nn.Linear(config.patch_dim, text.hidden_size, bias=False)
        self.language_model = language_model if language_model is not None else AutoModelForCausalLM.from_config(text)
        self.post_init()

    @classmethod
    def wrap(cls, language_model: PreTrainedModel, seed: int = 0) -> "ToyVLMForConditionalGeneration":
        """The wrapper around an existing text model (kept as is, weights shared)."""
        torch.manual_seed(seed)
        # A copy: building the outer model resets settings (attention backend) on its sub-configs.
        config = ToyVLMConfig(text_config=copy.deepcopy(language_model.config))
        model = cls(config, language_model=language_model).eval()
        model.generation_config.eos_token_id = language_model.generation_config.eos_token_id
        model.generation_config.pad_token_id = language_model.generation_config.pad_token_id
        return model

    def get_input_embeddings(self):
        return self.language_model.get_input_embeddings()

    def get_output_embeddings(self):
        return self.language_model.get_output_embeddings()

    def forward(self, input_ids=None, pixel_values=None, attention_mask=None, position_ids=None, cache=None,
                inputs_embeds=None, use_cache=None, output_hidden_states=None, return_dict=None, **kwargs):
        if inputs_embeds is None:
            inputs_embeds = self.get_input_embeddings()(input_ids)
        if pixel_values is not None:
            image_positions = (input_ids == self.config.image_token_id).unsqueeze(-1).expand_as(inputs_embeds)
            image_embeds = self.multi_modal_projector(pixel_values.to(inputs_embeds.dtype))
            inputs_embeds = inputs_embeds.masked_scatter(image_positions, image_embeds)
        outputs = self.language_model(
            inputs_embeds=inputs_embeds, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
            use_cache=use_cache, output_hidden_states=output_hidden_states, return_dict=True,
        )
        return CausalLMOutputWithPast(logits=outputs.logits, cache=outputs.cache, hidden_states=outputs.hidden_states)


def offloaded_target(model: PreTrainedModel, folder: Path, cpu_layers: int = 1, disk_modules: tuple = ()):
    """`model` saved to `folder` and reloaded with an accelerate device map: a `max_memory` budget that fits the
    embedding, lm_head, final norm and about `cpu_layers` decoder layers on the CPU, the rest offloaded to disk
    (streamed in by accelerate hooks). `disk_modules` (e.g. `("lm_head",)`) are offloaded as well.

    The input embedding cannot go to disk: `model.device` would then be `meta`, and transformers' assisted decoding
    moves its candidate ids to `model.device` (whatever the assistant)."""
    from accelerate import infer_auto_device_map, init_empty_weights

    folder = Path(folder)
    model.save_pretrained(folder)
    remote = bool(getattr(model.config, "auto_map", None))
    with init_empty_weights():
        skeleton = AutoModelForCausalLM.from_config(model.config, trust_remote_code=remote)
    sizes = {name: sum(p.numel() * p.element_size() for p in module.parameters())
             for name, module in skeleton.named_modules()}
    layers = [f"model.layers.{i}" for i in range(model.config.num_hidden_layers)]
    kept = ("model.embed_tokens", "lm_head", "model.norm")
    # accelerate keeps room for the largest offloaded layer to be brought in, hence the one layer extra.
    budget = sum(sizes[name] for name in kept) + (cpu_layers + 1) * max(sizes[name] for name in layers)
    inferred = infer_auto_device_map(skeleton, max_memory={"cpu": budget},
                                     no_split_module_classes=skeleton._no_split_modules)
    # The inferred map may group modules ("model.layers": "disk"); spell it out per module before overriding.
    device_map = {name: _placement(inferred, name) for name in (*kept, *layers)}
    for name in kept:
        device_map[name] = "disk" if name in disk_modules else "cpu"
    target = AutoModelForCausalLM.from_pretrained(folder, device_map=device_map, offload_folder=folder / "offload",
                                                  trust_remote_code=remote)
    return target.eval()


def _placement(device_map: dict, module_name: str):
    """Where an inferred device map puts a module: the entry of its longest listed prefix."""
    prefixes = [key for key in device_map if key == "" or module_name == key or module_name.startswith(key + ".")]
    return device_map[max(prefixes, key=len)]
