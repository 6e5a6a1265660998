"""Tiny random-init diffusers pipeline folders, built offline in seconds (CPU tests of pipeline parts).

``build_qwen_image_pipeline`` writes a complete ``QwenImagePipeline`` folder (or ``QwenImageEditPipeline``
with ``edit=True``) with ``save_pretrained``; ``from_pretrained`` on it generates like the real one, only
with small random networks.  Every component is built under one seed, so a folder is a function of its
arguments (byte for byte).  The edit folder's ``processor/`` loads as a ``Qwen2VLProcessor`` only where
torchvision is installed (transformers 5.x needs it for the processor's video half, even for images).

The tokenizer is a byte-level BPE trained here on a fixed corpus that holds both prompt templates, so
every word of a template is one token: the template prefix is then exactly the 34 (text-to-image) /
64 (edit) tokens that the pipelines drop, as with the real Qwen2.5-VL tokenizer.  The byte alphabet makes
any text (letters, digits, punctuation: OCR-style prompts) tokenize.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                  "<|image_pad|>", "<|video_pad|>")
CORPUS = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n",
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
    "background), then explain how the user's text instruction should alter or modify the image. Generate a new "
    "image that meets the user's requirements while maintaining consistency with the original input where "
    "appropriate.<|im_end|>\n<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>",
    "<|im_end|>\n<|im_start|>assistant\n",
    "a red cat sitting on a blue mat, a photo of a dog in the park at night",
    "a sign that reads OPEN 24 HOURS; the number 0123456789 written in black ink on white paper",
    "ABCDEFGHIJKLMNOPQRSTUVWXYZ abcdefghijklmnopqrstuvwxyz 0 1 2 3 4 5 6 7 8 9 . , ! ? : ; ' \" ( ) - +",
    "make the sky green and add the word HELLO, remove the tree, turn it into a watercolor painting",
)
# Qwen-Image's scheduler/scheduler_config.json (FlowMatchEulerDiscreteScheduler with dynamic shifting)
QWEN_IMAGE_SCHEDULER = dict(base_image_seq_len=256, base_shift=0.5, invert_sigmas=False, max_image_seq_len=8192,
                            max_shift=0.9, num_train_timesteps=1000, shift=1.0, shift_terminal=0.02,
                            stochastic_sampling=False, time_shift_type="exponential", use_beta_sigmas=False,
                            use_dynamic_shifting=True, use_exponential_sigmas=False, use_karras_sigmas=False)
VISION_PATCH, VISION_MERGE, VISION_TEMPORAL = 14, 2, 2  # Qwen2.5-VL's; the image processor must agree
PROCESSOR_CLASS = ["transformers", "Qwen2VLProcessor"]  # model_index.json entry of the edit pipeline


def build_tokenizer(vocab_size: int = 1024):
    """Byte-level BPE trained on ``CORPUS`` wrapped as the ``Qwen2TokenizerFast`` that Qwen-Image loads.  The
    default size lets training merge every word of the corpus (it stops there, at 630 tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import Qwen2TokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), min_frequency=1,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(CORPUS, trainer=trainer)
    return Qwen2TokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                              unk_token=None, bos_token=None, padding_side="right")


def _text_encoder(tokenizer, hidden: int, layers: int, heads: int = 4, kv_heads: int = 2,
                  intermediate: int | None = None, section: list[int] | None = None,
                  dtype: torch.dtype | None = None):
    """``Qwen2_5_VLForConditionalGeneration`` of width ``hidden`` (default: 4 heads of hidden/4, 2 KV heads, MLP
    2 * hidden) with a one-block vision tower projecting to ``hidden``; ``dtype``: built straight in it."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    head_dim = hidden // heads
    if hidden % (2 * heads):
        raise ValueError(f"text_hidden={hidden}; expected a multiple of {2 * heads} ({heads} heads with an even "
                         f"rotary half)")
    if section is None:
        quarter = head_dim // 2 // 4  # M-RoPE sections (temporal, height, width) over head_dim / 2 frequencies
        section = [quarter, quarter, head_dim // 2 - 2 * quarter]
    ids = {name: tokenizer.convert_tokens_to_ids(tok) for name, tok in (
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"))}
    text = dict(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=intermediate or 2 * hidden,
                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                max_position_embeddings=2048,
                rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": section},
                bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=hidden,
                  patch_size=VISION_PATCH, spatial_merge_size=VISION_MERGE, temporal_patch_size=VISION_TEMPORAL,
                  window_size=112, fullatt_block_indexes=[0])
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids)
    if dtype is None:
        return Qwen2_5_VLForConditionalGeneration(config).eval()
    return Qwen2_5_VLForConditionalGeneration._from_config(config, dtype=dtype).eval()


def _write_processor(folder: Path, tokenizer) -> None:
    """The ``processor/`` folder of QwenImageEditPipeline (a ``Qwen2VLProcessor``), laid out as Qwen-Image-Edit's:
    the image processor's ``preprocessor_config.json``, a video processor config and the tokenizer files.  The
    pixel budget is capped at 4 x 28 x 28 so that a source image costs the text encoder at most 4 vision tokens.

    It is written file by file: transformers 5.x cannot build a ``Qwen2VLProcessor`` object without torchvision
    (it type-checks its absent video processor; transformers#43986), so ``save_pretrained`` is not available."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    side = VISION_PATCH * VISION_MERGE
    images = Qwen2VLImageProcessorPil(patch_size=VISION_PATCH, merge_size=VISION_MERGE,
                                      temporal_patch_size=VISION_TEMPORAL,
                                      size={"shortest_edge": side * side, "longest_edge": 4 * side * side})
    folder.mkdir(parents=True, exist_ok=True)
    images.save_pretrained(folder)
    video = {k: v for k, v in images.to_dict().items() if k != "image_processor_type"}
    video.update(video_processor_type="Qwen2VLVideoProcessor", processor_class=PROCESSOR_CLASS[1])
    (folder / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2) + "\n")
    tokenizer.save_pretrained(folder)


def build_qwen_image_pipeline(out_dir: str | os.PathLike, *, seed: int = 0, edit: bool = False, layers: int = 2,
                              text_hidden: int = 32, text_layers: int = 2, heads: int = 4, head_dim: int = 32,
                              vae_base_dim: int = 16, z_dim: int = 16) -> Path:
    """Write a tiny random-init ``QwenImagePipeline`` (``edit``: ``QwenImageEditPipeline``) folder at ``out_dir``
    and return its path.  ``layers``: transformer blocks; ``text_hidden``: the text encoder's width, which is
    the transformer's ``joint_attention_dim``; the transformer takes ``4 * z_dim`` packed channels."""
    from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageEditPipeline,
                           QwenImagePipeline, QwenImageTransformer2DModel)

    if head_dim % 8:
        raise ValueError(f"head_dim={head_dim}; expected a multiple of 8 (three even RoPE axes)")
    axes = (head_dim // 4, 3 * head_dim // 8, 3 * head_dim // 8)  # (frame, height, width), as (16, 56, 56) / 128
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        tokenizer = build_tokenizer()
        text_encoder = _text_encoder(tokenizer, text_hidden, text_layers)
        vae = AutoencoderKLQwenImage(base_dim=vae_base_dim, z_dim=z_dim, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                                     attn_scales=[], temperal_downsample=[False, True, True])
        transformer = QwenImageTransformer2DModel(
            patch_size=2, in_channels=4 * z_dim, out_channels=z_dim, num_layers=layers, attention_head_dim=head_dim,
            num_attention_heads=heads, joint_attention_dim=text_hidden, axes_dims_rope=axes)
    components = dict(scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER), vae=vae.eval(),
                      text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer.eval())
    out = Path(out_dir)
    if not edit:
        QwenImagePipeline(**components).save_pretrained(out, safe_serialization=True)
        return out
    saver = logging.getLogger("diffusers.pipelines.pipeline_utils")
    level = saver.level
    saver.setLevel(logging.ERROR)  # it warns that processor=None is not saved: _write_processor writes it
    try:
        QwenImageEditPipeline(processor=None, **components).save_pretrained(out, safe_serialization=True)
    finally:
        saver.setLevel(level)
    _write_processor(out / "processor", tokenizer)
    index = json.loads((out / "model_index.json").read_text())
    index["processor"] = PROCESSOR_CLASS
    (out / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return out


# Qwen-Image's text encoder is Qwen2.5-VL-7B-Instruct; its language model's config
QWEN25_VL_7B_TEXT = dict(hidden=3584, layers=28, heads=28, kv_heads=4, intermediate=18944, section=[16, 24, 24])


def build_full_size_qwen_image_pipeline(out_dir: str | os.PathLike, *, layers: int = 60, text_layers: int = 28,
                                        seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                                        device: str | torch.device = "cpu", transformer_weights: bool = True) -> Path:
    """Write a random-init ``QwenImagePipeline`` folder with Qwen-Image's shapes at ``out_dir`` (for benchmarks: it
    loads and runs as the real one does, at its cost) and return its path.

    * transformer: ``QwenImageTransformer2DModel`` at diffusers' defaults = Qwen-Image's (24 heads of 128, 64 packed
      channels, text width 3584), ``layers`` blocks (60 = Qwen-Image, 20.4 B params, ~41 GB in bf16);
    * text_encoder: ``Qwen2_5_VLForConditionalGeneration`` with Qwen2.5-VL-7B's language-model shape (hidden 3584,
      28 heads / 4 KV heads, MLP 18944, M-RoPE sections 16/24/24), ``text_layers`` layers (28 = Qwen2.5-VL-7B,
      ~6.5 B params, ~13 GB in bf16); the vocabulary is the tiny byte-level tokenizer's (~640 tokens: the real
      one's 152064-row embedding costs memory, not FLOPs per token) and the vision tower is one small block (the
      text-to-image pipeline never runs it);
    * vae: ``AutoencoderKLQwenImage`` at diffusers' defaults = Qwen-Image's VAE config (~127 M params);
    * scheduler: Qwen-Image's (dynamic shifting), tokenizer: ``build_tokenizer``'s (the template is 34 tokens).

    Components are built one at a time on ``device`` in ``dtype`` (a GPU initialises 20 B params in seconds, a CPU
    in minutes) and written with ``save_pretrained``; the disk holds ~55 GB at full size (``layers`` /
    ``text_layers`` cut it).  A folder is a function of its arguments and the device's RNG."""
    import shutil

    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel

    if layers < 1 or text_layers < 1:
        raise ValueError(f"layers={layers}, text_layers={text_layers}; expected >= 1")
    out = build_qwen_image_pipeline(out_dir, seed=seed)  # scheduler, tokenizer, model_index.json; then replaced:
    tokenizer = build_tokenizer()
    saved = torch.get_default_dtype()
    builders = (("vae", lambda: AutoencoderKLQwenImage()),
                ("text_encoder", lambda: _text_encoder(tokenizer, **{**QWEN25_VL_7B_TEXT, "layers": text_layers},
                                                       dtype=dtype)),
                ("transformer", lambda: QwenImageTransformer2DModel(num_layers=layers)))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for name, build in builders:
            torch.set_default_dtype(dtype)  # diffusers models are built straight in dtype (no fp32 copy)
            try:
                skip = name == "transformer" and not transformer_weights  # its config only: built on meta
                with torch.device("meta" if skip else device):
                    module = build().eval().requires_grad_(False)
            finally:
                torch.set_default_dtype(saved)
            shutil.rmtree(out / name)
            if name == "transformer" and not transformer_weights:  # its config only: a run with model.random_init
                module.save_config(out / name)
            else:
                module.save_pretrained(out / name, safe_serialization=True)
            del module
    return out


def edit_pipeline_processor(folder: str | os.PathLike):
    """The ``processor/`` of an edit folder as the ``Qwen2VLProcessor`` that ``QwenImageEditPipeline`` takes (pass
    it as ``from_pretrained(folder, processor=...)``).  Without torchvision, transformers 5.x cannot construct one
    (its type check of the absent video processor fails: transformers#43986); the check alone is skipped then,
    the processor's call path (image processor + image-token expansion + tokenizer) is transformers' own."""
    import importlib.util
    from unittest import mock

    from transformers import AutoImageProcessor, AutoTokenizer, Qwen2VLProcessor

    folder = Path(folder)
    if importlib.util.find_spec("torchvision") is not None:
        return Qwen2VLProcessor.from_pretrained(folder / "processor")
    with mock.patch.object(Qwen2VLProcessor, "check_argument_for_proper_class", lambda self, name, arg: None):
        return Qwen2VLProcessor(image_processor=AutoImageProcessor.from_pretrained(folder / "processor"),
                                tokenizer=AutoTokenizer.from_pretrained(folder / "processor"))


# ---- StableDiffusion3Pipeline ------------------------------------------------------------------------------------
CLIP_SPECIALS = ("<|startoftext|>", "<|endoftext|>")
T5_SPECIALS = ("<pad>", "</s>", "<unk>")  # ids 0, 1, 2 as in T5's sentencepiece vocabulary
SD3_SCHEDULER = dict(num_train_timesteps=1000, shift=3.0)  # SD3 / SD3.5's scheduler_config.json (static shift)


def build_clip_tokenizer(vocab_size: int = 600):
    """A CLIP-style BPE (lower-cased NFC text, byte-level words ending in ``</w>``, every text wrapped in
    ``<|startoftext|>`` ... ``<|endoftext|>``) trained on ``CORPUS``, as the ``CLIPTokenizerFast`` SD3 loads
    (77 tokens, padded with ``<|endoftext|>``)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import CLIPTokenizerFast

    bpe = Tokenizer(models.BPE(end_of_word_suffix="</w>", unk_token="<|endoftext|>"))
    bpe.normalizer = normalizers.Sequence([normalizers.NFC(), normalizers.Lowercase()])
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(CLIP_SPECIALS), min_frequency=1,
                                  end_of_word_suffix="</w>", initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    bpe.train_from_iterator(CORPUS, trainer=trainer)
    bos, eos = CLIP_SPECIALS
    bpe.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A {eos}", pair=f"{bos} $A {eos} $B {eos}",
        special_tokens=[(t, bpe.token_to_id(t)) for t in CLIP_SPECIALS])
    return CLIPTokenizerFast(tokenizer_object=bpe, bos_token=bos, eos_token=eos, unk_token=eos, pad_token=eos,
                             model_max_length=77)


def build_t5_tokenizer(vocab_size: int = 300):
    """A T5-style Unigram (Metaspace words, ``</s>`` appended) trained on ``CORPUS``, as ``T5TokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import T5TokenizerFast

    unigram = Tokenizer(models.Unigram())
    unigram.pre_tokenizer = pre_tokenizers.Metaspace()
    unigram.decoder = decoders.Metaspace()
    trainer = trainers.UnigramTrainer(vocab_size=vocab_size, special_tokens=list(T5_SPECIALS), unk_token="<unk>",
                                      show_progress=False)
    unigram.train_from_iterator(CORPUS, trainer=trainer)
    unigram.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", unigram.token_to_id("</s>"))])
    return T5TokenizerFast(tokenizer_object=unigram, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
                           extra_ids=0, model_max_length=512)


def _clip_encoder(tokenizer, hidden: int, projection: int, layers: int = 2, heads: int = 4):
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    config = CLIPTextConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                            num_hidden_layers=layers, num_attention_heads=heads, projection_dim=projection,
                            max_position_embeddings=77, bos_token_id=tokenizer.bos_token_id,
                            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return CLIPTextModelWithProjection(config).eval()


def build_sd3_pipeline(out_dir: str | os.PathLike, *, seed: int = 0, layers: int = 2, heads: int = 4,
                       head_dim: int = 16, clip_hidden: int = 32, clip_projection: int = 32, t5_dim: int = 64,
                       dual_attention_layers: tuple[int, ...] = (0,), qk_norm: str | None = "rms_norm") -> Path:
    """Write a tiny random-init ``StableDiffusion3Pipeline`` folder at ``out_dir`` (SD3.5-Medium's shape by default:
    MMDiT-X dual attention in block 0, RMS q/k norm) and return its path.  CLIP-L and CLIP-G are two small
    ``CLIPTextModelWithProjection``s sharing one tokenizer; T5 has width ``t5_dim``, the transformer's
    ``joint_attention_dim`` (CLIP's hidden states are zero-padded to it); ``pooled_projection_dim`` is the two
    projections concatenated.  VAE: a 4-level ``AutoencoderKL`` (factor 8) with 16 latent channels and SD3's
    scaling / shift factors; scheduler: SD3's static shift 3."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import T5Config, T5EncoderModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        clip_tok, t5_tok = build_clip_tokenizer(), build_t5_tokenizer()
        clip_l = _clip_encoder(clip_tok, clip_hidden, clip_projection)
        clip_g = _clip_encoder(clip_tok, clip_hidden, clip_projection)
        t5 = T5EncoderModel(T5Config(vocab_size=len(t5_tok), d_model=t5_dim, d_kv=t5_dim // 4, d_ff=2 * t5_dim,
                                     num_layers=2, num_heads=4, pad_token_id=t5_tok.pad_token_id,
                                     eos_token_id=t5_tok.eos_token_id, decoder_start_token_id=t5_tok.pad_token_id))
        vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
                            up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(8,) * 4, layers_per_block=1,
                            norm_num_groups=4, latent_channels=16, scaling_factor=1.5305, shift_factor=0.0609,
                            use_quant_conv=False, use_post_quant_conv=False)
        transformer = SD3Transformer2DModel(
            sample_size=32, patch_size=2, in_channels=16, num_layers=layers, attention_head_dim=head_dim,
            num_attention_heads=heads, joint_attention_dim=t5_dim, caption_projection_dim=heads * head_dim,
            pooled_projection_dim=2 * clip_projection, out_channels=16, pos_embed_max_size=64,
            dual_attention_layers=tuple(dual_attention_layers), qk_norm=qk_norm)
    pipe = StableDiffusion3Pipeline(
        transformer=transformer.eval(), scheduler=FlowMatchEulerDiscreteScheduler(**SD3_SCHEDULER), vae=vae.eval(),
        text_encoder=clip_l, tokenizer=clip_tok, text_encoder_2=clip_g, tokenizer_2=clip_tok, text_encoder_3=t5.eval(),
        tokenizer_3=t5_tok)
    out = Path(out_dir)
    pipe.save_pretrained(out, safe_serialization=True)
    return out
