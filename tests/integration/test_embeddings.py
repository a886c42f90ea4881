"""``POST /v1/embeddings`` through the ``openai`` SDK, answers validated against ``openai.types``.

The real SmolLM2 (``smollm2_server``: ``smollm2`` on the rolling engine, ``dyn`` on dynamic batching) is checked
against transformers' ``AutoModel`` on the same fp32 folder; a small BERT built here with a fixed seed, saved as a
sentence-transformers folder, against ``SentenceTransformer(folder).encode``. Both the decoder and the encoder
paths, the Matryoshka ``dimensions``, base64, token-id inputs, the errors in OpenAI's shape, and a greedy
generation stream that runs while embeddings share its steps.
"""

from __future__ import annotations

import asyncio
import base64
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import torch
from openai.types import CreateEmbeddingResponse

from rollcore.errors import ConfigError
from serving.config.model_config import load_model_config
from tests.integration.harness import ServerProcess
from tests.real_model import smollm2_folder

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Embeddings map text to vectors.",
         "A rolling batch admits new requests between steps, so short prompts never wait for long answers."]
# The engine computes in fp32 like transformers but not in the same order: its C prompt-attention kernel over paged
# KV blocks, fused residual-add + RMSNorm and oneDNN-packed linears round differently at ~1e-7 relative per
# operation; over 30 layers that drift stays below 1e-5 in a unit vector's entries (its largest are ~0.2), while any
# wrong row, position or pooling moves entries by 1e-2 or more.
ATOL = 1e-5
BERT_WORDS = "the a cat dog sat on mat sun rain blue red green run jump quick brown fox lazy over hello world".split()
BERT_TEXTS = ["the cat sat on the mat", "hello world", "quick brown fox", "the lazy dog runs in the rain"]


def vectors(answer: CreateEmbeddingResponse) -> np.ndarray:
    """The answer's vectors in input order, after checking the SDK's own type and the indices."""
    CreateEmbeddingResponse.model_validate(answer.model_dump())
    assert answer.object == "list" and [d.index for d in answer.data] == list(range(len(answer.data)))
    assert all(d.object == "embedding" for d in answer.data)
    return np.array([d.embedding for d in answer.data], dtype=np.float64)


@pytest.fixture(scope="module")
def smol(smollm2_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=smollm2_server.url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference() -> Any:
    """transformers' ``AutoModel`` (the decoder without its LM head) on the served fp32 folder: the last token's
    final hidden state, L2-normalised (vLLM's embed default for decoders)."""
    from transformers import AutoModel, AutoTokenizer

    folder = smollm2_folder()
    model = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)

    def embed(text: str) -> tuple[np.ndarray, int]:
        ids = tokenizer(text)["input_ids"]
        with torch.no_grad():
            hidden = model(torch.tensor([ids])).last_hidden_state[0, -1]
        return torch.nn.functional.normalize(hidden, dim=0).numpy().astype(np.float64), len(ids)
    return embed


@pytest.mark.parametrize("model", ["smollm2", "dyn"])
def test_the_vector_is_the_models_last_hidden_state(smol: openai.OpenAI, reference: Any, model: str) -> None:
    answer = smol.embeddings.create(model=model, input=TEXTS[0], encoding_format="float")
    got = vectors(answer)
    want, num_tokens = reference(TEXTS[0])
    assert answer.model == model and got.shape == (1, 576)
    np.testing.assert_allclose(got[0], want, atol=ATOL, rtol=0)
    assert abs(np.linalg.norm(got[0]) - 1) < 1e-6
    assert answer.usage.prompt_tokens == answer.usage.total_tokens == num_tokens


@pytest.mark.parametrize("model", ["smollm2", "dyn"])
def test_a_batch_equals_one_by_one(smol: openai.OpenAI, reference: Any, model: str) -> None:
    batch = vectors(smol.embeddings.create(model=model, input=TEXTS, encoding_format="float"))
    alone = np.concatenate([vectors(smol.embeddings.create(model=model, input=t, encoding_format="float"))
                            for t in TEXTS])
    np.testing.assert_allclose(batch, alone, atol=ATOL, rtol=0)
    for k, text in enumerate(TEXTS):
        np.testing.assert_allclose(batch[k], reference(text)[0], atol=ATOL, rtol=0)


def test_dimensions_truncate_and_normalise_again(smol: openai.OpenAI) -> None:
    full = vectors(smol.embeddings.create(model="smollm2", input=TEXTS[1], encoding_format="float"))[0]
    cut = vectors(smol.embeddings.create(model="smollm2", input=TEXTS[1], encoding_format="float", dimensions=64))[0]
    assert cut.shape == (64,)
    np.testing.assert_allclose(cut, full[:64] / np.linalg.norm(full[:64]), atol=1e-6, rtol=0)
    with pytest.raises(openai.BadRequestError) as err:
        smol.embeddings.create(model="smollm2", input=TEXTS[1], dimensions=577)
    assert err.value.status_code == 400 and err.value.body["param"] == "dimensions"  # type: ignore[index]
    assert "576" in err.value.body["message"]  # type: ignore[index]


def test_base64_is_the_float_answer_as_little_endian_float32(smol: openai.OpenAI, smollm2_server: ServerProcess
                                                             ) -> None:
    floats = vectors(smol.embeddings.create(model="smollm2", input=TEXTS, encoding_format="float"))
    default = vectors(smol.embeddings.create(model="smollm2", input=TEXTS))  # the SDK asks for base64 and decodes it
    np.testing.assert_array_equal(default, floats)
    raw = httpx.post(f"{smollm2_server.url}/v1/embeddings", timeout=60,
                     json={"model": "smollm2", "input": TEXTS[2], "encoding_format": "base64", "dimensions": 8}).json()
    packed = base64.b64decode(raw["data"][0]["embedding"])
    assert len(packed) == 8 * 4
    cut = floats[2][:8] / np.linalg.norm(floats[2][:8])
    np.testing.assert_allclose(struct.unpack("<8f", packed), cut, atol=1e-6, rtol=0)


@pytest.mark.parametrize("model", ["smollm2", "dyn"])
def test_token_id_inputs_equal_text_inputs(smol: openai.OpenAI, model: str) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_folder())
    ids = [tokenizer(t)["input_ids"] for t in TEXTS[:2]]
    text = vectors(smol.embeddings.create(model=model, input=TEXTS[:2], encoding_format="float"))
    one = smol.embeddings.create(model=model, input=ids[0], encoding_format="float")
    many = smol.embeddings.create(model=model, input=ids, encoding_format="float")
    np.testing.assert_allclose(vectors(one)[0], text[0], atol=ATOL, rtol=0)
    np.testing.assert_allclose(vectors(many), text, atol=ATOL, rtol=0)
    assert many.usage.prompt_tokens == len(ids[0]) + len(ids[1])


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"input": []}, "input", "'input' must not be empty"),
    ({"input": ""}, "input", "'input' must not be empty"),
    ({"input": [[1, 2], [49152]]}, "input", "'input[1]' holds token id 49152, outside the vocabulary"),
    ({"input": "hi " * 2100}, "input", "embeds at most 2048 (max_model_len)"),
    ({"input": "hi", "encoding_format": "hex"}, "encoding_format", "'encoding_format' must be one of"),
    ({"input": "hi", "dimensions": 0}, "dimensions", "'dimensions' must be >= 1"),
    ({"input": "hi", "model": "nope"}, None, "nope"),
])
def test_bad_requests_get_openai_errors_naming_the_field(smollm2_server: ServerProcess, body: dict[str, Any],
                                                         param: str | None, words: str) -> None:
    client = openai.OpenAI(base_url=smollm2_server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    with pytest.raises(openai.APIStatusError) as err:
        client.embeddings.create(**{"model": "smollm2", **body})
    error = err.value.body
    assert isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}, error
    assert err.value.status_code == (404 if "model" in body else 400)
    assert error["param"] == param and words in error["message"], error
    assert "/" not in error["message"].replace("/v1/", ""), error  # no server path
    # the model serves the next request as if nothing happened
    assert vectors(client.embeddings.create(model="smollm2", input="still fine", encoding_format="float")).shape == \
        (1, 576)


def test_unknown_fields_are_ignored_and_named_as_on_completions(smollm2_server: ServerProcess) -> None:
    answer = httpx.post(f"{smollm2_server.url}/v1/embeddings", timeout=60,
                        json={"model": "dyn", "input": "hi", "colour": "red"})
    assert answer.status_code == 200 and answer.headers["x-ignored-parameters"] == "colour"
    CreateEmbeddingResponse.model_validate(answer.json())


def test_generation_beside_embeddings_is_its_solo_answer(smollm2_server: ServerProcess, reference: Any) -> None:
    """A greedy stream runs while embedding requests join the engine's steps: its text is the one it has alone,
    and the embeddings are the ones they have alone."""
    prompt = "Once upon a time, in a small village by the sea,"
    greedy = {"max_tokens": 40, "temperature": 0, "extra_body": {"ignore_eos": True}}

    async def scenario() -> tuple[str, str, list[np.ndarray]]:
        client = openai.AsyncOpenAI(base_url=smollm2_server.url + "/v1", api_key="none", max_retries=0, timeout=120)
        solo = await client.completions.create(model="smollm2", prompt=prompt, **greedy)  # type: ignore[arg-type]
        stream = await client.completions.create(model="smollm2", prompt=prompt, stream=True,
                                                 **greedy)  # type: ignore[arg-type]
        parts: list[str] = []
        embeddings: list[Any] = []
        async for chunk in stream:
            parts.append(chunk.choices[0].text if chunk.choices else "")
            if len(parts) == 2:  # the stream is decoding: the embeddings' prompts join its steps
                embeddings = [asyncio.ensure_future(client.embeddings.create(model="smollm2", input=TEXTS,
                                                                             encoding_format="float"))
                              for _ in range(3)]
        answers = await asyncio.gather(*embeddings)
        await client.close()
        return solo.choices[0].text, "".join(parts), [vectors(a) for a in answers]

    solo, mixed, batches = asyncio.run(scenario())
    assert mixed == solo and len(solo) > 40
    assert len(batches) == 3
    want = np.array([reference(t)[0] for t in TEXTS])
    for got in batches:
        np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)


# --- a BERT-family sentence-transformers folder, and models that cannot embed or only embed -------------------
def build_bert(folder: Path) -> Path:
    """A 2-layer BERT with seeded random weights and a word-piece tokenizer, saved as a sentence-transformers folder
    (mean pooling, Normalize)."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
    from transformers import BertConfig, BertModel, BertTokenizerFast

    raw = folder / "raw"
    raw.mkdir(parents=True)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *BERT_WORDS, "##s", "##ing", "##ed"]
    (raw / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tokenizer = BertTokenizerFast(vocab_file=str(raw / "vocab.txt"), do_lower_case=True)
    torch.manual_seed(1234)
    config = BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64)
    BertModel(config).save_pretrained(raw)
    tokenizer.save_pretrained(raw)
    st = SentenceTransformer(modules=[Transformer(str(raw)), Pooling(32, "mean"), Normalize()])
    st.save(str(folder / "st"))
    return folder / "st"


@pytest.fixture(scope="module")
def bert_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_bert(tmp_path_factory.mktemp("bert"))


@pytest.fixture(scope="module")
def task_server(tmp_path_factory: pytest.TempPathFactory, bert_folder: Path) -> Iterator[ServerProcess]:
    """``bert`` (option.task=embedding, dynamic batching, unknown fields refused), ``tiny-embed`` (the tiny decoder,
    embedding only, rolling engine), ``tiny-gen`` (option.task=generate) and ``echo``."""
    srv = ServerProcess.start(tmp_path_factory.mktemp("tasks"), models={
        "bert": {"option.task": "embedding", "batch_size": "4", "max_batch_delay": "20",
                 "option.strict_parameters": "true"},
        "tiny-embed": {"option.task": "embedding", "option.rolling_batch": "auto"},
        "tiny-gen": {"option.task": "generate"},
        "echo": {"option.entryPoint": "echo"},
    }, sources={"bert": bert_folder}, timeout_s=300)
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def tasks(task_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=task_server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def test_bert_vectors_are_sentence_transformers(tasks: openai.OpenAI, bert_folder: Path) -> None:
    from sentence_transformers import SentenceTransformer

    want = SentenceTransformer(str(bert_folder)).encode(BERT_TEXTS, normalize_embeddings=True)
    answer = tasks.embeddings.create(model="bert", input=BERT_TEXTS, encoding_format="float")
    got = vectors(answer)
    assert got.shape == (4, 32)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    np.testing.assert_array_equal(vectors(tasks.embeddings.create(model="bert", input=BERT_TEXTS)), got)
    # [CLS] + the word pieces + [SEP], as sentence-transformers' tokenizer counts them
    tokenizer = SentenceTransformer(str(bert_folder)).tokenizer
    assert answer.usage.prompt_tokens == sum(len(tokenizer(t)["input_ids"]) for t in BERT_TEXTS)
    one = vectors(tasks.embeddings.create(model="bert", input=BERT_TEXTS[1], encoding_format="float"))
    np.testing.assert_allclose(one[0], want[1], atol=1e-5, rtol=0)


def test_a_strict_models_unknown_field_is_a_400_naming_it(tasks: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        tasks.embeddings.create(model="bert", input="hello", extra_body={"colour": "red"})
    # type: ignore[index]
    assert err.value.body["param"] == "colour" and "unknown fields: colour" in err.value.body["message"]


@pytest.mark.parametrize("model", ["bert", "tiny-embed"])
def test_generation_on_an_embedding_model_is_a_400_naming_its_task(tasks: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        tasks.completions.create(model=model, prompt="hello", max_tokens=3)
    assert "task 'embedding'" in err.value.message and model in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        tasks.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert "task 'embedding'" in err.value.message
    assert vectors(tasks.embeddings.create(model=model, input="hello world", encoding_format="float")).shape[0] == 1


@pytest.mark.parametrize(("model", "why"), [("tiny-gen", "it serves the task 'generate' (option.task)"),
                                            ("echo", "its handler is not one of the built-in model handlers")])
def test_embeddings_on_a_model_that_cannot_embed_is_a_400_naming_it(tasks: openai.OpenAI, model: str,
                                                                     why: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        tasks.embeddings.create(model=model, input="hello")
    assert err.value.body == {"message": f"model {model!r} does not compute embeddings: {why}",  # type: ignore[comparison-overlap]
                              "type": "invalid_request_error", "param": "model", "code": "invalid_request"}
    assert tasks.completions.create(model="tiny-gen", prompt="hello", max_tokens=2).choices[0].text is not None


def test_an_encoder_on_the_rolling_engine_fails_at_load_by_name(bert_folder: Path, tmp_path: Path) -> None:
    model = tmp_path / "bert-rolling"
    model.symlink_to(bert_folder, target_is_directory=True)
    with pytest.raises(ConfigError) as err:
        load_model_config(model, overrides={"option.task": "embedding", "option.rolling_batch": "scheduler"})
    assert "option.task=embedding" in str(err.value) and "option.rolling_batch" in str(err.value)
