"""Images in chat calls through the official ``openai`` client (``image_url`` parts with ``data:`` URLs) on
the omni demo's tiny Qwen3-Omni thinker: expanded by relax-multimodal, generated with the image tensors."""

import asyncio
import base64
import io

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("relax_multimodal")


@pytest.fixture(scope="module")
def omni_dir(tmp_path_factory) -> str:
    """The omni demo's model (``build_tiny_mm_model("qwen3_omni")``) and its media-extended tokenizer."""
    mm_models = pytest.importorskip("relax_app.demo.mm_models")
    from relax_app.demo.tokenizer import train_tokenizer

    out = tmp_path_factory.mktemp("omni")
    base = train_tokenizer(["What is on the screen? A red square."] * 20)
    tok = mm_models.extend_tokenizer(base, "qwen3_omni")
    mm_models.build_tiny_mm_model("qwen3_omni", tok, out_dir=out, seed=0)
    return str(out)


@pytest.fixture(scope="module")
def omni(omni_dir, serve):
    """(base URL of a server on the omni model, its tokenizer)."""
    from transformers import AutoTokenizer

    from relax_rollout.engines.torch_engine import TorchEngine

    tok = AutoTokenizer.from_pretrained(omni_dir)
    engine = TorchEngine(model_path=omni_dir, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id)
    return serve(engine, tok), tok


def _png(width: int, height: int, colour=(200, 30, 30)) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _ask(url: str, text: str = "What is on the screen?") -> dict:
    parts = [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}}]
    messages = [{"role": "user", "content": parts}]
    return {"model": "default", "messages": messages, "max_tokens": 3, "temperature": 0}


def test_an_image_part_is_expanded_by_relax_multimodal_and_reaches_the_engine(omni):
    from relax_multimodal import process_image

    base, tok = omni
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    small, wide = _png(64, 64), _png(128, 64)
    got = {}
    for name, url in (("small", small), ("wide", wide)):
        r = client.chat.completions.create(**_ask(url), logprobs=True)
        assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens >= 1
        ids = r.model_extra["prompt_token_ids"]
        assert r.usage.prompt_tokens == len(ids)
        # the placeholder run is exactly as long as relax-multimodal's processor makes the image
        assert ids.count(pad) == process_image(url, "qwen3_omni").num_tokens
        got[name] = (ids, r)
    assert got["wide"][1].usage.prompt_tokens - got["small"][1].usage.prompt_tokens == 8 - 4  # image tokens
    # where the part was: after the text part
    text_ids = tok.encode("What is on the screen?", add_special_tokens=False)
    ids = got["small"][0]
    assert ids.index(pad) > ids.index(text_ids[-1])
    # the pixels reach the model: the same prompt ids, another image → other log-probs
    blue = client.chat.completions.create(**_ask(_png(64, 64, (20, 40, 220))), logprobs=True)
    assert blue.model_extra["prompt_token_ids"] == ids
    first = [got["small"][1].choices[0].logprobs.content[0], blue.choices[0].logprobs.content[0]]
    assert (first[0].token, first[0].logprob) != (first[1].token, first[1].logprob)


def test_the_async_client_streams_an_answer_about_an_image(omni):
    base, _ = omni

    async def main():
        client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        ask = _ask(_png(96, 64))
        whole = await client.chat.completions.create(**ask)
        options = {"include_usage": True}
        stream = await client.chat.completions.create(**ask, stream=True, stream_options=options)
        chunks = [c async for c in stream]
        await client.close()
        return whole, chunks

    whole, chunks = asyncio.run(main())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    prompt_ids = whole.model_extra["prompt_token_ids"]
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens == len(prompt_ids)


def test_a_bad_image_is_a_400_naming_its_part(omni):
    base, _ = omni
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
    not_png = "data:image/png;base64," + base64.b64encode(b"not an image at all").decode()
    for url, where, says in (
        (not_png, r"messages\[0\]\.content\[1\]", "cannot decode image"),
        ("data:image/png;base64,", r"messages\[0\]\.content\[1\]\.image_url\.url", "empty"),
        ("https://example.com/shot.png", r"messages\[0\]\.content\[1\]\.image_url\.url", "not fetched"),
        ("/etc/hosts", r"messages\[0\]\.content\[1\]\.image_url\.url", "only data: URLs"),
    ):
        with pytest.raises(openai.BadRequestError, match=f"{where}: .*{says}") as e:
            client.chat.completions.create(**_ask(url))
        assert e.value.body["param"].startswith("messages[0].content[1]")
    # an agent session records token ids only: images there are refused, by name
    with pytest.raises(openai.BadRequestError, match=r"messages\[0\]\.content\[1\]: images are not recorded"):
        client.chat.completions.create(**_ask(_png(64, 64)), extra_headers={"X-Relax-Session": "agent-1"})
    assert client.chat.completions.create(**_ask(_png(64, 64))).choices  # the server still serves


def test_a_text_only_model_refuses_an_image_part_by_name(chat_model_dir, scripted, serve):
    from transformers import AutoTokenizer

    base = serve(scripted(chat_model_dir), AutoTokenizer.from_pretrained(chat_model_dir))
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError, match=r"messages\[0\]\.content\[1\]: .*takes no images") as e:
        client.chat.completions.create(**_ask(_png(64, 64)))
    assert e.value.body["param"] == "messages[0].content[1]"
