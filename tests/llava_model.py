"""A tiny random LLaVA-1.5 saved by transformers (LlavaForConditionalGeneration: a 2-layer CLIP
tower of 56-pixel images in 14-pixel patches, 16 image tokens each, the projector, a 2-layer
Llama), with SmolLM2's tokenizer plus an <image> token, the LlavaProcessor on CLIP's PIL image
processor, and a LLaVA-1.5 chat template; and what every vision-language test shares: the
small generated images they send, and one forward of a prompt with images through the engine.
With `anyres`, the same model as a LLaVA-NeXT."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import torch

from ember import LLM, SamplingParams
from ember.scheduler.scheduler import ScheduledChunk, SchedulerOutput

# LLaVA-1.5's own template (llava-hf's): the images of a message first, then its text
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': ' }}{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] + ' ' }}{% else %}"
    "{% for item in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\\n' }}{% endfor %}"
    "{% for item in message['content'] | selectattr('type', 'equalto', 'text') %}{{ item['text'] + ' ' }}"
    "{% endfor %}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)
TOKENS_PER_IMAGE = 16  # (56 / 14)^2, the CLS position dropped
# LLaVA-NeXT's default pinpoints' shapes at 56-pixel tiles (1 x 2, 2 x 1, 2 x 2, 3 x 1, 1 x 3)
PINPOINTS = [[56, 112], [112, 56], [112, 112], [168, 56], [56, 168]]


def save_tiny_llava(tokenizer_dir: Path, out: Path, anyres: bool = False) -> Path:
    """The model directory, as transformers writes it (model, processor, tokenizer, template).
    anyres: a LLaVA-NeXT (LlavaNextForConditionalGeneration, its image processor tiling each
    image over PINPOINTS, its processor expanding the image token to the image's count)."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=2, image_size=56, patch_size=14, projection_dim=32)
    text = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                    bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    image_token = tok.convert_tokens_to_ids("<image>")
    if anyres:
        config = transformers.LlavaNextConfig(vision_config=vision, text_config=text, image_token_index=image_token,
                                              image_grid_pinpoints=PINPOINTS)
        model_class, processor_class = transformers.LlavaNextForConditionalGeneration, transformers.LlavaNextProcessor
        images = transformers.LlavaNextImageProcessorPil(size={"shortest_edge": 56},
                                                         crop_size={"height": 56, "width": 56},
                                                         image_grid_pinpoints=PINPOINTS)
    else:
        config = transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_index=image_token,
                                          image_seq_length=TOKENS_PER_IMAGE)
        model_class, processor_class = transformers.LlavaForConditionalGeneration, transformers.LlavaProcessor
        images = transformers.CLIPImageProcessorPil(size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56})
    torch.manual_seed(0)
    model = model_class(config)
    with torch.no_grad():  # transformers' init leaves the tiny model's logits nearly flat: spread them
        for p in model.parameters():
            p.normal_(0, 0.2)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    processor_class(image_processor=images, tokenizer=tok, patch_size=14, vision_feature_select_strategy="default",
                    num_additional_image_tokens=1, chat_template=CHAT_TEMPLATE).save_pretrained(str(out))
    return out


def image(color: tuple[int, int, int], size: tuple[int, int] = (40, 30)):
    """A small picture: a colored field with a lighter square, so crops and resizes matter."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", size, color)
    ImageDraw.Draw(img).rectangle([size[0] // 4, size[1] // 4, size[0] // 2, size[1] // 2],
                                  fill=tuple(min(255, c + 90) for c in color))
    return img


def data_url(img, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64,{base64.b64encode(buf.getvalue()).decode()}"


WORDS = ("USER ASSISTANT What is in the picture ? Which red blue : and the a of to it this that . , hi "
         "look cat dog sea sky tree house car sun moon star one two three four five six seven eight nine").split()


def word_tokenizer_dir(out: Path) -> Path:
    """A word-level tokenizer (tokenizers' WordLevel over WORDS, <s> / </s> / <unk>, the
    numbers 0-199 as words to fill a vocabulary), saved by transformers: for machines without
    the default model's package, where bpe_tokenizer_dir cannot be made."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>", *WORDS, *map(str, range(200))])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                unk_token="<unk>")
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    return out


def make_llm(model_dir, **kw) -> LLM:
    """The exact path (float32, no quantization) over a small pool of 4-token blocks."""
    return LLM(str(model_dir), dtype="float32", quantization="none", num_kv_blocks=96, block_size=4,
               max_model_len=256, **kw)


def prompt(text: str, images: list, video: object = None, mm_processor_kwargs: dict | None = None) -> dict:
    """vLLM's prompt of text and images (and a video, its frames or (frames, metadata)), and
    its mm_processor_kwargs."""
    data = {"image": images} | ({"video": video} if video is not None else {})
    return {"prompt": text, "multi_modal_data": data} | (
        {"mm_processor_kwargs": mm_processor_kwargs} if mm_processor_kwargs is not None else {})


def ember_logits(llm: LLM, text: str, images: list, video: object = None, mm_processor_kwargs: dict | None = None
                 ) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """One forward of the whole prompt (its images embedded by the runner): its token ids, the
    positions its rows turned by ([T], or M-RoPE's [3, T]) and every position's logits."""
    core = llm.engine
    req = llm.inputs.make_request("logits", prompt(text, images, video, mm_processor_kwargs),
                                  SamplingParams(max_tokens=1))
    req.block_ids = core.block_pool.allocate(core.scheduler.blocks_for(req.num_tokens))
    try:
        plan = SchedulerOutput([ScheduledChunk(req, req.num_tokens)])
        ids, positions, meta, _, _ = core.runner._prepare(plan)
        with torch.inference_mode():
            images = core.runner.images.inputs(plan, ids)
            hidden = core.runner.model(ids, positions, meta, images.embeds, images.deepstack)
            logits = core.runner.model.compute_logits(hidden).float()
    finally:
        core.block_pool.free(req.block_ids)
        core.runner.release(req.request_id)
    return req.prompt_token_ids, positions.cpu(), logits


def assert_a_repeated_image_hits(llm: LLM, text: str, size: tuple[int, int], image_tokens: int,
                                 params: SamplingParams) -> None:
    """The same (green) image after the same one-image `text`, twice: the second hits the prefix
    cache past the image's `image_tokens` placeholders and answers the same, the tower run once."""
    green = image((30, 160, 40), size)
    llm.engine.reset_prefix_cache()
    encoded = llm.engine.runner.images.num_encoded
    first = llm.generate(prompt(text, [green]), params)[0]
    again = llm.generate(prompt(text, [green]), params)[0]
    start = first.prompt_token_ids.index(llm.config.model_config.vision.image_token_id)
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens >= start + image_tokens
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert llm.engine.runner.images.num_encoded == encoded + 1
    llm.engine.check_idle()


def hf_greedy(hf, inputs: list[dict], max_new_tokens: int) -> list[tuple[list[int], list[float]]]:
    """transformers' greedy tokens of each prompt's inputs (on hf's device) and their logprobs
    (of the raw logits): what the -m gpu tests compare the engine's with."""
    out = []
    for enc in inputs:
        enc = {k: v.to(hf.device) for k, v in enc.items()}
        with torch.no_grad():
            gen = hf.generate(**enc, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                              output_logits=True, return_dict_in_generate=True)
        tokens = gen.sequences[0, enc["input_ids"].shape[1]:]
        logprobs = torch.stack(gen.logits)[:, 0].float().log_softmax(-1).gather(1, tokens[:, None])[:, 0]
        out.append((tokens.tolist(), logprobs.tolist()))
    return out


def tokens_and_logprobs(output) -> tuple[list[int], list[float]]:
    """An engine output's tokens and each one's logprob (sampled with logprobs=0)."""
    c = output.outputs[0]
    return c.token_ids, [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]


def assert_engine_matches_on_cuda(model_dir: Path, prompts: list[tuple[str, list]],
                                  expected: list[tuple[list[int], list[float]]], min_hit: int, atol: float,
                                  **engine) -> None:
    """The whole engine in float32 on CUDA against `expected` (hf_greedy's, the same prompts):
    every prompt's greedy tokens equal and their logprobs within `atol`, batched (decode steps in
    the CUDA graphs), then the second prompt again, which hits its images' blocks (>= min_hit
    tokens); no block held after."""
    greedy = SamplingParams(temperature=0, max_tokens=len(expected[0][0]), ignore_eos=True, logprobs=0)
    llm = LLM(str(model_dir), dtype="float32", quantization="none", max_model_len=1024, block_size=16, **engine)
    asks = [{"prompt": t, "multi_modal_data": {"image": i}} if i else t for t, i in prompts]
    outs = llm.generate(asks, greedy) + llm.generate(asks[1], greedy)
    assert outs[-1].num_cached_tokens >= min_hit
    for output, (tokens, logprobs) in zip(outs, expected + expected[1:2]):
        got_tokens, got_logprobs = tokens_and_logprobs(output)
        assert got_tokens == tokens
        torch.testing.assert_close(got_logprobs, logprobs, rtol=0, atol=atol)
    llm.engine.check_idle()

